"""`Profile`: what was chosen, on what device, and what it measured (profile.yaml, schema 1).

A profile is written atomically, is human-readable, and loads back into equal objects.
"""

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import yaml
from loguru import logger

from autofit.base.atomic import atomic_write_text
from autofit.base.documents import read_yaml
from autofit.base.errors import ProfileError
from autofit.base.paths import default_store_dir
from autofit.config.reader import read_as, Reader
from autofit.config.spec import ModelSpec, OptimizerSpec, parse_optimizer
from autofit.config.train_config import TrainConfig
from autofit.profiles import export
from autofit.profiles.demotions import record_demotion
from autofit.profiles.fitting import fit_now

PROFILE_SCHEMA = 1


# The shapes of a profile's free-form sections: `Profile.from_dict` reads every field by
# these annotations (autofit.config.reader.read_as), so a wrongly typed one is an error
# naming its key path at load, not a TypeError in `apply` later.


class ProcessFlags(TypedDict, total=False):
    """`autofit.device.precision.process_flags()`, as measured."""

    cuda_matmul_allow_tf32: bool
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool
    float32_matmul_precision: Literal["highest", "high", "medium"]
    cpu_threads: int  # torch's intra-op threads: a CPU figure holds for them


class Baseline(TypedDict, total=False):
    config: dict  # TrainConfig.to_dict() of the 32-true baseline: shown, never applied
    samples_per_s: float | None


class LossCurve(TypedDict, total=False):
    """`search.trial_health.LossCurveCheck.summary()`."""

    reference: str | None
    steps: int
    window_steps: int
    rtol: float
    gap: float | None
    note: str
    rejected: dict[str, float]


class MicroBatchFloorRecord(TypedDict, total=False):
    """`MicroBatchFloor.to_dict()`; empty for a model without a floor."""

    size: int
    excludes_accumulation: bool
    reason: str


class DataAssumptions(TypedDict, total=False):
    """`TextData.describe()`: the lengths a varying-length profile was measured for."""

    kind: str
    samples: int
    longest_tokens: int
    mean_tokens: float
    max_length: int
    padding: str
    packing: bool
    pad_to_multiple_of: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileModel:
    name: str
    spec_hash: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileDevice:
    name: str
    memory_bytes: int
    compute_capability: str | None  # "9.0"; None on a CPU
    driver: str | None
    torch: str
    fingerprint: str
    slug: str  # file-name-safe device name
    # Tuned for a card that was emulated (--memory-budget, or the service's inventory file):
    # used only when asked for by that budget or file name, never in place of a real device.
    emulated: bool = False

    @property
    def kind(self) -> str:
        """"cpu" or "cuda": where a job with this profile trains (a CPU has no compute capability
        and no driver)."""
        return "cpu" if self.compute_capability is None and self.driver is None else "cuda"

    @property
    def is_emulated(self) -> bool:
        # Profiles written before the flag existed are known by their fingerprint's tag.
        return self.emulated or "-budget-" in self.fingerprint or self.fingerprint.endswith("-emulated")


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    samples_per_s: float
    tokens_per_s: float | None
    peak_memory_bytes: int
    step_time_s: float
    validated_steps: int
    # What the validation run ran with: the optimizer's implementation (autofit.optim.
    # implementation, e.g. torch.AdamW/fused) and the process-wide flags (precision.process_flags).
    # `apply` builds or checks the one, and sets (then restores) the others.
    optimizer: str | None = None
    flags: ProcessFlags = field(default_factory=dict)
    compile_s: float | None = None  # compile=true: seconds compiling took, apart from step_time_s
    runs: int | None = None  # runs behind these figures (the median run's, the largest peak): validation runs, or where unvalidated the search's
    threads: int | None = None  # torch's intra-op threads the runs used: a CPU figure holds for them

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("compile_s", "runs", "threads"):  # unknown: left out, as profiles were before
            if out[key] is None:
                del out[key]
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSummary:
    trials: int  # configurations considered
    measured: int  # of those, run in a child
    pruned: int  # rejected by the memory estimate without running
    oom: int
    unhealthy: int
    failed: int  # error or timeout
    wall_s: float
    sampler: str
    storage: str
    baseline: Baseline = field(default_factory=dict)  # the 32-true largest-fitting baseline, if measured
    speedup: float | None = None  # winner over that baseline: the median of interleaved pairs' ratios
    # The interval of the speed-up (the pairs' smallest and largest ratio) and the pairs behind
    # it (autofit/tuning/speedup.py). A speed-up of None with an interval: not measurable.
    speedup_interval: list[float] | None = None
    speedup_pairs: int = 0
    foreign_cores: float | None = None  # cores other work kept busy while validating (median)
    stop_reason: str = ""  # why the search stopped
    choice: str = ""  # how the winner was chosen among contenders within noise
    noise: float | None = None  # run-to-run relative spread of repeated measurements
    host_load: float | None = None  # 1-minute load average per CPU core while validating
    note: str = ""  # why the profile is the baseline, or what to distrust in its figures
    # The winner's loss curve against the 32-true reference's over the same validation
    # batches: reference, steps, window_steps, rtol (the limit) and gap (the largest seen).
    loss_curve: LossCurve = field(default_factory=dict)
    # The smallest micro batch the space held and why (a model with BatchNorm): size, reason.
    micro_batch_floor: MicroBatchFloorRecord = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # search trials measured by each worker sharing the study
    validated_by: str = ""  # the worker that validated the winner and wrote the profile
    # False: the time budget ran out, or a stop came, before the winner's validation run: its
    # figures are the median run of the search's runs it was ranked by, and `unvalidated` says why.
    validated: bool = True
    unvalidated: str = ""
    # What the baseline is: "one-liner" (the AMP one-liner on a GPU; on the CPU 32-true at the
    # largest micro batch that fits), "fallback" (the expert's, every block checkpointed at the
    # halved micro batch: faster than a one-liner that did not fit the global batch) or
    # "32-true" (profiles from before the one-liner).
    baseline_kind: str = "32-true"
    # The winner over the 32-true trial of the search (largest micro batch measured without
    # checkpointing, else the fastest), from the search trials' figures (no interval): 32-true's
    # throughput is not validated on a GPU.
    speedup_over_32_true: float | None = None
    # Model FLOPs utilisation of the winner's figure: its training FLOPs per second (6N +
    # attention, workload/flops.py) over the card's dense peak for its precision
    # (device/peak.py); None where either is unknown (a CPU, an unlisted card, a ConvNet).
    mfu: float | None = None
    # What each knob the winner changed from the baseline is worth: its speed over the
    # measured config that differs in that knob alone (tuning/ablation.py); None: no such twin.
    knob_shares: dict[str, float | None] = field(default_factory=dict)
    # The GPU kind (fingerprint) whose configs for the same spec were measured first
    # (`search.warm_start`, the service's new kinds); "" for a cold start.
    warm_start_from: str = ""
    # The winner's offloading (tuning/offload_record.py): the knobs, the pinned host bytes, its
    # step time and the fastest measured config without offloading; {}: nothing offloaded.
    offload: dict = field(default_factory=dict)
    # The whole tune's time budget and why it was that: given (--time-budget,
    # search.time_budget) or sized to train.steps at the floor's speed; None: profiles from before.
    time_budget_s: float | None = None
    time_budget_why: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSetup:
    """What the measured steps ran beyond the config, so `apply` can build it again."""

    optimizer: dict  # the spec's optimizer: name, lr, betas, weight_decay, momentum
    max_grad_norm: float | None  # None: no clipping
    # The spec's own loss ({python, args, per_sample}) when it named one; None: the model's.
    loss: dict | None = None

    def __post_init__(self):
        self.optimizer_spec()  # read as a model.yaml's optimizer section is: checked at load

    def optimizer_spec(self) -> OptimizerSpec:
        return parse_optimizer(Reader(self.optimizer, "optimizer", error=ProfileError))


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontierPoint:
    """One point of the memory/throughput frontier: a config validated like the winner,
    with its validated figures (`measured.peak_memory_bytes` is the reserved peak plus the
    device overhead, what the budget has to hold)."""

    config: TrainConfig
    measured: Measured

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "measured": self.measured.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    model: ProfileModel
    device: ProfileDevice
    budget_bytes: int
    config: TrainConfig
    measured: Measured
    search: SearchSummary
    created: str
    autofit: str
    # Varying-length data: the lengths the peak and speed were measured for (e.g. text's
    # longest_tokens, padding, packing). Empty for fixed-size data.
    data: DataAssumptions = field(default_factory=dict)
    # The validated frontier, smallest peak first, the winner last (see autofit/frontier.py).
    # Empty in profiles written before it existed: `points` is then the winner alone.
    frontier: tuple[FrontierPoint, ...] = ()
    # The optimizer and clipping the trials ran; None in profiles written before it was recorded.
    training: TrainingSetup | None = None
    schema: int = PROFILE_SCHEMA

    @property
    def points(self) -> tuple[FrontierPoint, ...]:
        """The configs this profile may run, smallest peak first; the winner last."""
        return self.frontier or (FrontierPoint(config=self.config, measured=self.measured),)

    def at(self, point: FrontierPoint) -> "Profile":
        """This profile running `point`: its config and figures in place of the winner's."""
        return dataclasses.replace(self, config=point.config, measured=point.measured)

    @property
    def file_name(self) -> str:
        return f"{self.model.name}--{self.device.slug}.yaml"

    def to_dict(self) -> dict:
        return {
            "schema": self.schema,
            "model": dataclasses.asdict(self.model),
            "device": dataclasses.asdict(self.device),
            "budget_bytes": self.budget_bytes,
            "config": self.config.to_dict(),
            "measured": self.measured.to_dict(),
        } | ({"frontier": [p.to_dict() for p in self.frontier]} if self.frontier else {}) | (
            {"training": {k: v for k, v in dataclasses.asdict(self.training).items() if k != "loss" or v}}
            if self.training is not None else {}) | {
            "search": dataclasses.asdict(self.search),
            "created": self.created,
            "autofit": self.autofit,
        } | ({"data": dict(self.data)} if self.data else {})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_yaml())

    @classmethod
    def from_dict(cls, raw: Any, *, where: str = "profile") -> "Profile":
        """A profile document, every field checked against its annotation (a ProfileError
        naming `where` and the key path otherwise); unknown keys are refused."""
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: expected a mapping, got {type(raw).__name__}")
        model = raw.get("model")
        if isinstance(model, dict) and {"builtin", "hf", "python"} & set(model):
            raise ProfileError(f"{where}: this is a model.yaml, not a profile; make a profile with "
                               f"`autofit tune {where}`")
        if raw.get("schema") != PROFILE_SCHEMA or isinstance(raw.get("schema"), bool):
            raise ProfileError(f"{where}: schema: this autofit reads profile schema {PROFILE_SCHEMA}, "
                               f"got {raw.get('schema')!r}")
        profile = read_as(raw, cls, document=where, error=ProfileError)
        _check_frontier(profile, where)
        return profile

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        if path.is_dir():
            raise ProfileError(f"{path}: is a folder, not a profile file")
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file")
        return cls.from_dict(read_yaml(path, error=ProfileError), where=str(path))

    def check_spec(self, spec: ModelSpec) -> bool:
        """False (with a warning) when the profile was tuned for another version of the spec."""
        if self.model.name != spec.name:
            raise ProfileError(f"profile is for model {self.model.name!r}, the spec is {spec.name!r}")
        if self.config.global_batch_size != spec.train.global_batch_size:
            raise ProfileError(
                f"profile's micro batch x accumulation = {self.config.global_batch_size}, but "
                f"train.global_batch_size is {spec.train.global_batch_size}: re-run `autofit tune`")
        if self.model.spec_hash != spec.spec_hash:
            logger.warning("profile {} is stale: the model.yaml changed since it was tuned "
                           "(re-run `autofit tune` to refresh it)", self.file_name)
            return False
        return True

    def data_differences(self, assumptions: dict) -> list[str]:
        """Where the data now steps outside what the profile was measured on: longer samples
        than its worst case (memory), or another padding (speed). Empty: within them."""
        if not self.data or not assumptions:
            return []
        diffs = []
        if assumptions.get("longest_tokens", 0) > self.data.get("longest_tokens", 0):
            diffs.append(f"samples of up to {assumptions['longest_tokens']} tokens, the profile's peak was "
                         f"measured at {self.data.get('longest_tokens')}: it may run out of memory")
        for key in ("padding", "packing", "pad_to_multiple_of"):
            if key in self.data and assumptions.get(key) != self.data[key]:
                diffs.append(f"{key} is {assumptions.get(key)!r}, the profile was measured with {self.data[key]!r}")
        return diffs

    def device_differences(self, device: "ProfileDevice") -> list[str]:
        """What differs between the tuned-on device and `device` (empty: same kind)."""
        diffs = []
        for name in ("name", "memory_bytes", "compute_capability", "driver", "torch"):
            mine, theirs = getattr(self.device, name), getattr(device, name)
            if name == "driver":
                mine, theirs = _major(mine), _major(theirs)
            if mine != theirs:
                diffs.append(f"{name}: profile {mine!r}, here {theirs!r}")
        return diffs

    # --- using a profile: the plan (autofit.train.training_plan) and the exports (autofit.profiles.export)

    def fitted(self, *, memory_budget: int | str | None = None, device=None,
               memory_headroom: float | None = None, name: str | None = None) -> "Profile":
        """This profile at the fastest frontier point that fits the memory available now:
        `memory_budget` (bytes, "24GiB", a fraction) if given, else the GPU's memory less what
        other processes hold (NVML) less `memory_headroom` (default: the spec's 0.05); a CPU
        without a budget keeps the winner. Logs the choice (naming the profile `name`, default
        its file name); NothingFitsError when none fits."""
        return fit_now(self, memory_budget=memory_budget, device=device, memory_headroom=memory_headroom, name=name)

    def _for_export(self, memory_budget, device) -> "Profile":
        return fit_now(self, memory_budget=memory_budget, device=device, export=True)

    def apply(self, model, optimizer_factory=None, *, device=None, max_grad_norm: float | None | str = "profile",
              store=None, memory_budget: int | str | None = None, memory_headroom: float | None = None,
              state_dir=None):
        """A `TrainingPlan`: `model` with this profile's checkpointing, freezing, dtype and
        device applied, plus autocast, GradScaler and the runner's step for a custom loop.

        What was measured is what is built: without `optimizer_factory` the plan builds the
        optimizer the profile ran (`autofit.train.optim.build_optimizer`: the spec's optimizer, the
        same implementation); a factory whose optimizer is another implementation (a foreach
        AdamW where the fused one was measured) is used with a warning. `max_grad_norm`
        "profile" clips as the profile's trials did; None: no clipping. The process-wide
        TF32/cuDNN flags are set as measured and put back by `plan.close()` or a with block.
        Profiles written before these were recorded build no optimizer and clip only if asked.

        The config is the fastest frontier point that fits the memory available now (see
        `fitted`): the winner when the device is all yours, a smaller point when another
        process holds part of it or `memory_budget` is smaller.

        `plan.step(batch=..., loss_fn=...)` survives an out-of-memory error by halving the
        micro batch; when this profile is in `store` (a folder or `ProfileStore`; default
        the store `load_profile` reads), each such demotion is recorded beside it, where the
        next `autofit tune` starts from it. `state_dir`: where the tune kept inductor's cache
        (default: autofit's state folder)."""
        # torch here, not at the top: reading and writing profiles (the tune's parent) needs none.
        from autofit.train.configure import prepare_process
        from autofit.train.training_plan import TrainingPlan

        chosen = self.fitted(memory_budget=memory_budget, device=device, memory_headroom=memory_headroom)
        # Before the plan moves the model (CUDA may start): the allocator setting measured, and
        # inductor's cache in the state folder for a compiled config.
        prepare_process(chosen.config, state_dir)
        on_demotion = _demotion_recorder(self, store)
        max_grad_norm = _clip_norm(self, max_grad_norm)
        factory = optimizer_factory
        if factory is None:
            factory = _measured_optimizer_factory(self.training, chosen.config, device)
        plan = TrainingPlan(model, chosen.config, factory, device=device, max_grad_norm=max_grad_norm,
                            on_demotion=on_demotion, flags=chosen.measured.flags,
                            min_micro_batch_size=self.search.micro_batch_floor.get("size", 1))
        if optimizer_factory is not None:
            _warn_other_optimizer(self, plan, chosen.measured.optimizer)
        return plan

    # The exports, like `apply`, take the fastest point that fits now (see `fitted`).

    def to_hf_training_args(self, *, n_blocks: int | None = None, memory_budget: int | str | None = None,
                            device=None) -> dict:
        """kwargs for `transformers.TrainingArguments`; see `autofit.profiles.export.hf_notes`."""
        return export.to_hf_training_args(self._for_export(memory_budget, device), n_blocks=n_blocks)

    def to_lightning(self, *, memory_budget: int | str | None = None, device=None) -> dict:
        """kwargs for `lightning.Trainer`; see `autofit.profiles.export.lightning_notes`."""
        return export.to_lightning(self._for_export(memory_budget, device))

    def to_env(self, *, memory_budget: int | str | None = None, device=None) -> dict[str, str]:
        """AUTOFIT_* environment variables."""
        return export.to_env(self._for_export(memory_budget, device))


def _demotion_recorder(profile: Profile, store):
    """What records the plan's out-of-memory demotions beside the profile in `store` (a
    folder, or a ProfileStore: its root; None: the store `load_profile` reads); None where the
    profile is not in that store."""
    root = Path(store if isinstance(store, (str, Path)) else getattr(store, "root", None) or default_store_dir())
    if not (root / profile.file_name).is_file():
        return None

    def on_demotion(event):
        record_demotion(root / profile.file_name, event, spec_hash=profile.model.spec_hash)
    return on_demotion


def _clip_norm(profile: Profile, max_grad_norm: float | None | str) -> float | None:
    """The norm to clip at: the one the trials clipped at for "profile"; another value is kept,
    with a warning where it is not the one measured."""
    training = profile.training
    if max_grad_norm == "profile":
        return training.max_grad_norm if training is not None else None
    if training is not None and max_grad_norm != training.max_grad_norm:
        logger.warning("profile {}: max_grad_norm={} differs from the {} it was measured with", profile.file_name,
                       max_grad_norm, training.max_grad_norm)
    return max_grad_norm


def _measured_optimizer_factory(training: TrainingSetup | None, config: TrainConfig, device):
    """A factory for the optimizer the profile ran; None for a profile that did not record it."""
    if training is None:
        return None
    from autofit.train.optim import build_optimizer  # torch: see Profile.apply
    from autofit.train.training_plan import resolve_plan_device

    optimizer_spec, where = training.optimizer_spec(), resolve_plan_device(device)

    def factory(params):
        return build_optimizer(optimizer_spec, params, config=config, device=where)
    return factory


def _warn_other_optimizer(profile: Profile, plan, measured: str | None) -> None:
    """The user's factory built another implementation than the one measured: say so."""
    from autofit.train.optim import implementation  # torch: see Profile.apply

    if plan.optimizer is None or measured is None:
        return
    built = implementation(plan.optimizer)
    if built != measured:
        logger.warning("profile {}: the optimizer built is {}, the profile was measured with {}: its "
                       "speed and peak memory may not hold (a foreach AdamW holds temporaries the size "
                       "of all parameters; leave optimizer_factory out to build the measured one)",
                       profile.file_name, built, measured)


def _major(version: str | None) -> str | None:
    return None if version is None else version.split(".")[0]


def _check_frontier(profile: "Profile", where: str) -> None:
    """Every point trains the same job as the winner: same global batch, same ranks."""
    for i, point in enumerate(profile.frontier):
        for name in ("global_batch_size", "world_size"):
            if getattr(point.config, name) != getattr(profile.config, name):
                raise ProfileError(f"{where}: frontier[{i}].config: {name} {getattr(point.config, name)} differs "
                                   f"from the config's {getattr(profile.config, name)}")


def device_from_info(info) -> ProfileDevice:
    """The profile's record of a probed `DeviceInfo`."""
    cc = info.compute_capability
    return ProfileDevice(
        name=info.name, memory_bytes=info.memory_total_bytes,
        compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
        driver=info.driver_version, torch=str(info.torch_version),
        fingerprint=info.fingerprint, slug=info.slug,
        emulated=info.emulated or info.emulated_budget_bytes is not None,
    )


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
