"""Offloading on a lent GPU (issue 45): a decoder that fits a 24 GiB card only with offload.

    python benchmarks/gpu_offload.py                  # ~1 B decoder under 8 GiB: about 8 min (estimated)
    python benchmarks/gpu_offload.py --size 3b        # ~3 B decoder under 24 GiB (the issue's): about 16 min
    python benchmarks/gpu_offload.py --size tiny --budget 64MiB --time-budget 30 --out /tmp/x
                                                      # the script's path on a CPU (offload is inert there)

`offload_check(...)` is the part `benchmarks/gpu_check.py` can call (it returns the record).
In order, each in its own process, the record written after each stage:
1. `autofit estimate` of the leanest plain config and of the same with every offload knob,
   on this card: device and host bytes predicted;
2. `autofit tune --memory-budget BUDGET --time-budget N --json`: the profile it writes (its
   `search.offload`: what is offloaded, the pinned host bytes, the step time against the best
   config without offload where one was measured);
3. 50 steps with the profile (`Profile.apply`, a loop as a user writes one), measuring the
   card's reserved peak and the pinned host allocator's peak (torch.cuda.host_memory_stats);
4. `autofit tune` of the same spec without a budget (the whole card, where a config without
   offload fits): its samples/s beside the offloaded profile's.
Writes `<out>/<date>-<device>-gpu-offload.{json,md}` (default out: benchmarks/results).
"""

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import _last_json, _run, REPO  # noqa: E402  (the same process runner and JSON reading)

# Decoders sized so that, with AdamW in fp32 or bf16 state, weights + gradients + state pass
# the budget while weights + gradients alone do not (bf16-true: 2 + 2 bytes a parameter).
SIZES = {
    "3b": ({"n_layer": 32, "n_embd": 2560, "n_head": 32, "vocab_size": 50304, "seq_len": 2048}, 16, "24GiB"),
    "1b": ({"n_layer": 24, "n_embd": 1792, "n_head": 16, "vocab_size": 50304, "seq_len": 1024}, 16, "8GiB"),
    "tiny": ({"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq_len": 16}, 8, "64MiB"),
}
# Estimated for an H100 from the stages (two estimates, two --time-budget 150 tunes, 50 steps whose
# CPU AdamW step takes seconds), not measured: no GPU was lent when this was written. "tiny" on
# this 2-core CPU took 4.6 min (the script's path only: offloading is inert there). The 3 B
# check is longer than one 10-minute device call: run it with --time-budget 90, or run 1b.
MINUTES = {"3b": 16, "1b": 8, "tiny": 5}
TRAIN_STEPS = 50


def spec_text(size: str) -> str:
    args, global_batch, _ = SIZES[size]
    return json.dumps({
        "schema": 1, "name": f"offload-{size}", "model": {"builtin": "gpt", "args": args},
        "data": {"kind": "synthetic"}, "optimizer": {"name": "adamw", "lr": 3.0e-4, "weight_decay": 0.1},
        "train": {"global_batch_size": global_batch, "steps": TRAIN_STEPS, "seed": 0},
        "search": {"precisions": ["bf16-mixed", "bf16-true"], "window_s": 2, "validate_steps": 10},
    })


def offload_check(out: Path, *, size: str = "1b", budget: str | None = None, time_budget: str = "150") -> dict:
    """The four stages above; returns the record (also written under `out`)."""
    import torch

    budget = budget or SIZES[size][2]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device, "size": size,
              "budget": budget, "time_budget": time_budget, "torch": torch.__version__, "stages": {}}
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    stem = out / f"{record['date'][:10]}-{slug}-gpu-offload"
    start = time.monotonic()

    def save() -> None:
        record["wall_s"] = round(time.monotonic() - start, 1)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text("```json\n" + json.dumps(record, indent=1, default=str) + "\n```\n")

    with tempfile.TemporaryDirectory(prefix="autofit-gpu-offload-") as folder:
        spec = Path(folder) / "spec.yaml"
        spec.write_text(spec_text(size))  # JSON is YAML
        stages = record["stages"]
        stages["estimate"] = _estimates(spec)
        save()
        tuned = _tune(spec, folder, "budget", budget, time_budget)
        stages["tune_under_budget"] = tuned
        save()
        if tuned.get("profile_path"):
            got = _run([sys.executable, __file__, "--measure", tuned["profile_path"], "--spec", str(spec)],
                       timeout_s=300)
            stages["train_with_profile"] = _last_json(got) | {"rc": got["rc"], "wall_s": got["wall_s"]}
            save()
        whole = _tune(spec, folder, "whole", None, time_budget)
        stages["tune_whole_card"] = whole
        offloaded, plain = (tuned.get("best") or {}).get("samples_per_s"), (whole.get("best") or {}).get("samples_per_s")
        record["offloaded_over_whole_card"] = round(offloaded / plain, 3) if offloaded and plain else None
        save()
    print(stem.with_suffix(".md"))
    return record


def _estimates(spec: Path) -> dict:
    n_layer = json.loads(spec.read_text())["model"]["args"]["n_layer"]
    lean = ["precision=bf16-true", "micro_batch_size=1", f"checkpoint_blocks={n_layer}"]
    offloaded = lean + ["offload_activations=true", "offload_optimizer=true"]
    out = {}
    for name, sets in (("leanest_plain", lean), ("leanest_offloaded", offloaded)):
        got = _run([sys.executable, "-m", "autofit", "estimate", str(spec), "--json",
                    *[a for s in sets for a in ("--set", s)]], timeout_s=300)
        out[name] = _json(got) | {"rc": got["rc"]}
    return out


def _json(got: dict) -> dict:
    """`autofit estimate --json` prints one indented document."""
    try:
        return json.loads(got["stdout"])
    except ValueError:
        return _last_json(got)


def _tune(spec: Path, folder: str, name: str, budget: str | None, time_budget: str) -> dict:
    cmd = [sys.executable, "-m", "autofit", "tune", str(spec), "--time-budget", time_budget, "--no-report", "--json",
           "--state-dir", f"{folder}/state-{name}", "--out", f"{folder}/profiles-{name}"]
    got = _run(cmd + (["--memory-budget", budget] if budget else []), timeout_s=float(time_budget) + 180)
    summary = _last_json(got)
    out = {"rc": got["rc"], "wall_s": got["wall_s"], "best": summary.get("best"), "stderr_tail": got["stderr"][-3000:]}
    if summary.get("profile_path"):
        out |= {"profile_path": summary["profile_path"], "profile": Path(summary["profile_path"]).read_text()}
    return out


def measure_profile(profile_path: str, spec_path: str) -> dict:
    """TRAIN_STEPS steps with the profile applied, as a user's loop: the card's reserved peak,
    the pinned host allocator's peak, samples/s over the last half."""
    import torch

    from autofit.config.spec import load_spec
    from autofit.profiles.profile import Profile
    from autofit.workload import build_workload, split_batch

    spec = load_spec(spec_path)
    workload, profile = build_workload(spec), Profile.load(Path(profile_path))
    plan = profile.apply(workload.build_model())
    generator, times, cuda = torch.Generator().manual_seed(0), [], torch.cuda.is_available()
    for _ in range(TRAIN_STEPS):
        begun = time.perf_counter()
        batch = workload.data.batch(spec.train.global_batch_size, generator)
        for micro in split_batch(batch, plan.micro_batch_size):
            with plan.autocast():
                loss = workload.loss_fn(plan.model, plan.to_device(micro))
            plan.step(loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begun)
    host = torch.cuda.host_memory_stats() if cuda else {}
    late = times[TRAIN_STEPS // 2:]
    return {"steps": TRAIN_STEPS, "config": profile.config.to_dict(),
            "samples_per_s": round(spec.train.global_batch_size * len(late) / sum(late), 2),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "host_pinned_peak_bytes": host.get("allocated_bytes.peak", host.get("allocated_bytes.all.peak")),
            "predicted_host_bytes": profile.search.offload.get("host_bytes"), "loss": float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--budget", help="--memory-budget of the offloaded tune (default: the size's)")
    parser.add_argument("--time-budget", default="150", help="each tune's --time-budget, seconds (default 150)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a child: train with this profile
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_profile(args.measure, args.spec)))
        return 0
    offload_check(args.out, size=args.size, budget=args.budget, time_budget=args.time_budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
