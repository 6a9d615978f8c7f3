"""Hostile input, round 2 (issue 27): every document checked, every write guarded, nothing lost.

`ROUND_2` is the second table, run as the first (tests/test_robust.py): each row ends with its
exit code and exactly one `autofit: error:` line on stderr, no traceback, within CASE_LIMIT_S,
and the files it names as the user's are still there, byte for byte. The tests after it take
one class of the issue each (3 documents, 4 writes, 5 resume and data, 6 parser attacks,
8 concurrent tunes, 9 environment and service) and check that what the user had is intact
and readable after every failure.
"""

import copy
import hashlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import autofit
from autofit.base import documents
from autofit.base.atomic import atomic_write, atomic_write_text
from autofit.base.errors import AutofitError, ProfileError, SpecError, WriteError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.profiles.profile import Profile
from autofit.profiles.store import ProfileStore
from conftest import REPO, run_main, tiny_gpt_dict, write_spec
from test_profile import make_profile

CASE_LIMIT_S = 30.0


# ---- the files the table's rows name ------------------------------------------------------------


def _laughs(levels: int = 9) -> list[str]:
    """A billion laughs: 9 aliases, each a list of 9 of the one before: 9^9 strings."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return lines


def _spec_text(**sections) -> str:
    return yaml.safe_dump(tiny_gpt_dict(**sections), sort_keys=False)


def _with_data_args(block: str) -> str:
    """The tiny spec with `block` (YAML lines) as data.args: a free mapping the spec hash walks."""
    return _spec_text().replace("data:\n", "data:\n  args:\n" + "".join(f"    {line}\n" for line in
                                                                       block.splitlines()), 1)


def _spec_variants() -> dict[str, str]:
    deep = "[" * 5000 + "]" * 5000
    alias_deep = "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [[[[[[[[[[*a{i - 1}]]]]]]]]]]\n" for i in range(1, 10))
    return {
        "laughs": _with_data_args("\n".join(_laughs())),
        "deep": _spec_text().replace("data:\n", f"data:\n  args: {deep}\n", 1),
        "recursive": _spec_text().replace("data:\n", "data:\n  args: &r {x: *r}\n", 1),
        "alias_deep": _with_data_args(alias_deep),
        "huge_int": _spec_text().replace("  seed: 0", "  seed: " + "9" * 5000),
        "bad_date": _spec_text().replace("  seed: 0", "  seed: 2026-13-45"),
        "int_keys": _spec_text().replace("data:\n", "data:\n  args: {1: a, b: c}\n", 1),
        "python_tag": _spec_text().replace("  seed: 0", "  seed: !!python/object/apply:os.getpid []"),
    }


def _profile_raw(spec) -> dict:
    return make_profile(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2)).to_dict()


def _bad_profiles(spec) -> dict[str, dict | str]:
    """Profiles a hand edit (or a hostile one) could leave: each field of the wrong type."""
    good = _profile_raw(spec)

    def changed(section: str | None, key: str, value) -> dict:
        raw = copy.deepcopy(good)
        (raw[section] if section else raw)[key] = value
        return raw

    return {
        "p_samples_str": changed("measured", "samples_per_s", "fast"),
        "p_fingerprint_int": changed("device", "fingerprint", 5),
        "p_unknown_key": changed(None, "comment", "tuned on friday"),
        "p_flags": changed("measured", "flags", {"cudnn_benchmark": "yes"}),
        "p_lr_str": changed("training", "optimizer", {**good["training"]["optimizer"], "lr": "fast"}),
        "p_floor": changed("search", "micro_batch_floor", {"size": "x"}),
        "p_data": changed(None, "data", {"longest_tokens": "many"}),
        "p_frontier": changed(None, "frontier", [{"config": good["config"], "measured": []}]),
        "p_laughs": yaml.safe_dump(good) + "padding:\n" + "".join(f"  {line}\n" for line in _laughs()),
        "p_deep": yaml.safe_dump(good) + "padding: " + "[" * 5000 + "]" * 5000 + "\n",
        "p_schema_bool": changed(None, "schema", True),
        "p_budget_str": changed(None, "budget_bytes", "16GiB"),
        "p_empty": "",
    }


def _state(**changes) -> dict:
    state = {"schema": 1, "service": {"pid": 1, "running": False}, "config": {}, "inventory": {"gpus": []},
             "models": [], "spec_errors": [], "queue": [], "running": [],
             "pairs": [{"model": "tiny", "fingerprint": "cpu-x", "device": "cpu", "tunes": 2}]}
    return {**state, **changes}


def _service_config(tmp: Path, name: str, state: str | None, **keys) -> Path:
    """autofit.yaml of a service whose state folder holds `state` as state.json (None: none)."""
    folder = tmp / name
    (folder / "state").mkdir(parents=True)
    if state is not None:
        (folder / "state" / "state.json").write_text(state)
    path = folder / "autofit.yaml"
    path.write_text(yaml.safe_dump({"models_dir": "models", "store_dir": "profiles", "state_dir": "state", **keys}))
    return path


def _damaged_study(tmp: Path, spec_path: Path) -> Path:
    """A SQLite study of `spec_path` (the name `tune --device cpu` opens) with one damaged page."""
    from autofit.config.spec import load_spec
    from autofit.device.probe import cpu_device
    from autofit.search.study import ask, make_study
    from autofit.tuning.space import study_name

    db = tmp / "damaged.db"
    study = make_study(study_name=study_name(load_spec(spec_path), cpu_device(), None), storage=f"sqlite:///{db}")
    for _ in range(200):  # trials over many pages, so one of the middle holds trial rows
        trial = ask(study)
        trial.set_user_attr("pad", "x" * 500)
        study.tell(trial, 1.0)
    data = bytearray(db.read_bytes())
    page = (len(data) // 4096) // 2
    data[page * 4096:(page + 1) * 4096] = b"\xde\xad" * 2048
    db.write_bytes(bytes(data))
    return db


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hostile2")
    f = {"tmp": tmp, "spec": write_spec(tmp, tiny_gpt_dict())}
    for name, text in _spec_variants().items():
        (tmp / f"{name}.yaml").write_text(text)
        f[name] = tmp / f"{name}.yaml"
    f["big_spec"] = tmp / "big.yaml"
    f["big_spec"].write_text(_spec_text() + ("#" * 1023 + "\n") * (17 * 1024))
    f["binary_spec"] = tmp / "binary.yaml"
    f["binary_spec"].write_bytes(b"\xff\xfe\x00name: x\n")
    f["fifo"] = tmp / "fifo.yaml"
    os.mkfifo(f["fifo"])
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp)
    for name, raw in _bad_profiles(spec).items():
        f[name] = tmp / f"{name}.yaml"
        f[name].write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    # The service: state files of the wrong shape, folders it cannot make.
    states = {"state_wrong_shape": json.dumps(_state(pairs="tiny")),
              "state_bad_status": json.dumps(_state(pairs=[{"model": "m", "fingerprint": "f", "device": "d",
                                                            "status": "sleeping"}])),
              "state_pair_type": json.dumps(_state(pairs=[{"model": "m", "fingerprint": "f", "device": "d",
                                                           "tunes": "two"}])),
              "state_gpu_row": json.dumps(_state(inventory={"gpus": [{"slot": "gpu0"}]})),
              "state_not_json": '{"schema": 1, "pairs": [',
              "state_deep": '{"schema": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}",
              "state_empty": ""}
    for name, text in states.items():
        f[name] = _service_config(tmp, name, text)
    a_file = tmp / "a-file"
    a_file.write_text("not a folder")
    f["a_file"] = a_file
    f["serve_state_under_file"] = _service_config(tmp, "serve-state", None, state_dir=str(a_file / "state"))
    f["serve_store_under_file"] = _service_config(tmp, "serve-store", None, store_dir=str(a_file / "profiles"))
    f["serve_laughs"] = tmp / "serve-laughs.yaml"
    f["serve_laughs"].write_text("models_dir: models\nx:\n" + "".join(f"  {line}\n" for line in _laughs()))
    # Resume from a checkpoint that is not one.
    for name, data in {"ckpt_truncated": None, "ckpt_garbage": b"not a checkpoint"}.items():
        run = tmp / name
        run.mkdir()
        f[name] = run
        if data is not None:
            (run / "checkpoint.pt").write_bytes(data)
    buffer = torch.nn.Linear(2, 2).state_dict()
    atomic_write(f["ckpt_truncated"] / "checkpoint.pt", lambda out: torch.save({"model": buffer}, out))
    full = (f["ckpt_truncated"] / "checkpoint.pt").read_bytes()
    (f["ckpt_truncated"] / "checkpoint.pt").write_bytes(full[:len(full) // 2])
    f["damaged_study"] = _damaged_study(tmp, f["spec"])
    return {k: str(v) for k, v in f.items()}


# Each row: (command line with {placeholders}, exit code, words the one line holds). Rows that
# get past the start of a command run with -q, so that its log stays off stderr.
ROUND_2 = {
    # --- 6. YAML that attacks the parser: refused in well under a second
    "estimate-billion-laughs": ("estimate {laughs} --device cpu", 2, "aliases expand it by"),
    "tune-billion-laughs": ("tune {laughs} --device cpu", 2, "more than 100,000"),
    "estimate-5000-levels": ("estimate {deep} --device cpu", 2, "nesting deeper than 64 levels at line"),
    "train-recursive-alias": ("train {recursive} --device cpu", 2, "an alias that contains itself"),
    "estimate-aliases-nest-deep": ("estimate {alias_deep} --device cpu", 2, "aliases nest it deeper than 64"),
    "estimate-5000-digit-int": ("estimate {huge_int} --device cpu", 2, "a value YAML cannot represent"),
    "estimate-bad-date": ("estimate {bad_date} --device cpu", 2, "month must be in 1..12"),
    "estimate-python-tag": ("estimate {python_tag} --device cpu", 2, "could not determine a constructor"),
    "estimate-int-keys": ("estimate {int_keys} --device cpu", 2, "data.args: keys are keyword argument names"),
    "estimate-17-mib-spec": ("estimate {big_spec} --device cpu", 2, "larger than 16 MiB"),
    "estimate-binary-spec": ("estimate {binary_spec} --device cpu", 2, "not a text file"),
    "estimate-fifo-spec": ("estimate {fifo} --device cpu", 2, "not a file"),
    "serve-config-laughs": ("serve --config {serve_laughs}", 2, "aliases expand it by"),
    "trial-billion-laughs": ("trial {laughs} --device cpu", 2, "aliases expand it by"),
    "profiles-list-spec-laughs": ("profiles list --spec {laughs} --store {tmp}", 2, "aliases expand it by"),
    "train-profile-5000-levels": ("train {spec} --device cpu --profile {p_deep} --checkpoint-dir {tmp}/r7", 2,
                                  "nesting deeper than 64 levels"),
    # --- 3. profiles: every field typed, unknown keys refused
    "train-profile-samples-str": ("train {spec} --device cpu --profile {p_samples_str} --checkpoint-dir {tmp}/r1", 2,
                                  "measured.samples_per_s: must be a number, got 'fast'"),
    "train-profile-fingerprint-int": ("train {spec} --device cpu --profile {p_fingerprint_int} "
                                      "--checkpoint-dir {tmp}/r2", 2, "device.fingerprint: must be a string"),
    "train-profile-unknown-key": ("train {spec} --device cpu --profile {p_unknown_key} --checkpoint-dir {tmp}/r3", 2,
                                  "comment: unknown key"),
    "train-profile-flags": ("train {spec} --device cpu --profile {p_flags} --checkpoint-dir {tmp}/r4", 2,
                            "measured.flags.cudnn_benchmark: must be true or false"),
    "profiles-show-lr-str": ("profiles show {p_lr_str} --device cpu", 2, "training.optimizer.lr: must be a number"),
    "profiles-export-floor": ("profiles export {p_floor} --device cpu --format hf", 2,
                              "search.micro_batch_floor.size: must be an integer"),
    "profiles-export-data": ("profiles export {p_data} --device cpu --format env", 2,
                             "data.longest_tokens: must be an integer"),
    "profiles-show-frontier": ("profiles show {p_frontier} --device cpu", 2,
                               "frontier[0].measured: expected a mapping"),
    "profiles-show-laughs": ("profiles show {p_laughs} --device cpu", 2, "aliases expand it by"),
    "train-profile-schema-bool": ("train {spec} --device cpu --profile {p_schema_bool} --checkpoint-dir {tmp}/r8",
                                  2, "schema: this autofit reads profile schema 1, got True"),
    "profiles-show-budget-str": ("profiles show {p_budget_str} --device cpu", 2,
                                 "budget_bytes: must be an integer, got '16GiB'"),
    "train-profile-empty": ("train {spec} --device cpu --profile {p_empty} --checkpoint-dir {tmp}/r5", 2,
                            "expected a mapping, got NoneType"),
    # --- 3 and 9. the service's state file and folders
    "status-state-wrong-shape": ("status --config {state_wrong_shape}", 2, "pairs: must be a list"),
    "status-state-bad-status": ("status --config {state_bad_status}", 2, "pairs[0].status: must be one of"),
    "status-state-pair-type": ("status --config {state_pair_type}", 2, "pairs[0].tunes: must be an integer"),
    "status-state-gpu-row": ("status --config {state_gpu_row}", 2, "inventory.gpus[0].name: required key"),
    "status-state-not-json": ("status --config {state_not_json}", 2, "not valid JSON"),
    "status-state-deep": ("status --config {state_deep}", 2, "nesting deeper than 64 levels"),
    "status-state-empty": ("status --config {state_empty}", 2, "not valid JSON"),
    "serve-state-dir-under-a-file": ("serve --config {serve_state_under_file}", 2, "state_dir: cannot create"),
    "serve-store-dir-under-a-file": ("serve --config {serve_store_under_file}", 2, "store_dir: cannot create"),
    # --- 4. writes checked before the work
    "train-metrics-out-under-a-file": ("train {spec} --device cpu --metrics-out {a_file}/m.json "
                                       "--checkpoint-dir {tmp}/r6", 2, "--metrics-out: cannot write"),
    "train-checkpoint-dir-under-a-file": ("train {spec} --device cpu --checkpoint-dir {a_file}/run", 2,
                                          "--checkpoint-dir: cannot create"),
    "tune-out-under-a-file": ("tune {spec} --device cpu --out {a_file}/profiles --state-dir {tmp}/st", 2,
                              "--out: cannot create"),
    "tune-state-dir-under-a-file": ("tune {spec} --device cpu --state-dir {a_file}/state", 2,
                                    "--state-dir: cannot create"),
    # --- 5. resume and data
    "train-resume-truncated-checkpoint": ("-q train {spec} --device cpu --resume --checkpoint-dir {ckpt_truncated}",
                                          2, "cannot be loaded into this model"),
    "train-resume-garbage-checkpoint": ("-q train {spec} --device cpu --resume --checkpoint-dir {ckpt_garbage}", 2,
                                        "cannot be loaded into this model"),
    # --- 3. a study database with one damaged page
    "tune-damaged-study": ("-q tune {spec} --device cpu --storage sqlite:///{damaged_study} --out {tmp}/out", 2,
                           "database disk image is malformed"),
}


def _digest(path: str) -> str | None:
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def test_the_second_table_covers_every_class_and_command():
    commands = {line.removeprefix("-q ").split()[0] for line, _, _ in ROUND_2.values()}
    assert commands == {"tune", "train", "estimate", "trial", "profiles", "serve", "status"}
    assert len(ROUND_2) >= 40


@pytest.mark.parametrize("case", list(ROUND_2))
def test_round_2_is_one_line_and_its_exit_code(case, files, capsys, monkeypatch, tmp_path):
    line, expected_code, words = ROUND_2[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOFIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AUTOFIT_STORE", str(tmp_path / "profiles"))
    args = [part.format(**files) for part in line.split()]
    named = [a.removeprefix("sqlite:///") for a in args]  # the study's database is the user's too
    named += [str(Path(a).parent / "state" / "state.json") for a in named if a.endswith("autofit.yaml")]
    before = {a: _digest(a) for a in named if a.startswith(files["tmp"]) and Path(a).is_file()}
    trial_folders = set(Path(os.environ["TMPDIR"]).glob("autofit-trial-*"))
    started = time.monotonic()
    code, _out, err = run_main(capsys, *args)
    took_s = time.monotonic() - started
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1 and lines[0].startswith("autofit: error: "), err
    assert words in lines[0] and "Traceback" not in err
    assert took_s < CASE_LIMIT_S
    assert {a: _digest(a) for a in before} == before  # nothing the user has is changed
    command = args[1] if args[0] == "-q" else args[0]
    if command == "tune":  # refused before any trial
        assert set(Path(os.environ["TMPDIR"]).glob("autofit-trial-*")) == trial_folders


# ---- 6. the parser's bounds -------------------------------------------------------------------


def test_a_billion_laughs_is_refused_in_well_under_a_second():
    text = "\n".join(_laughs())
    started = time.monotonic()
    with pytest.raises(SpecError, match=r"aliases expand it by [0-9,]{11} nodes, more than 100,000"):
        documents.parse_yaml(text, "laughs.yaml", error=SpecError)
    assert time.monotonic() - started < 1.0


def test_a_few_aliases_and_merge_keys_still_load():
    text = ("defaults: &d {lr: 0.001, betas: [0.9, 0.95]}\n"
            "a: {<<: *d, name: adamw}\nb: *d\nc: [*d, *d, *d]\n")
    raw = documents.parse_yaml(text, "ok.yaml")
    assert raw["a"] == {"lr": 0.001, "betas": [0.9, 0.95], "name": "adamw"} and raw["c"] == [raw["b"]] * 3


@pytest.mark.parametrize("levels, ok", [(64, True), (65, False), (5000, False)])
def test_nesting_is_bounded_in_yaml_and_json(levels, ok):
    text = "[" * levels + "]" * levels
    for parse in (documents.parse_yaml, documents.parse_json):
        if ok:
            assert parse(text, "doc") is not None
        else:
            with pytest.raises(AutofitError, match="nesting deeper than 64 levels"):
                parse(text, "doc")


# ---- 3. documents are type-checked --------------------------------------------------------------


@pytest.fixture
def spec(tmp_path):
    return parse_spec(tiny_gpt_dict(), source_dir=tmp_path)


@pytest.mark.parametrize("case", ["p_samples_str", "p_fingerprint_int", "p_unknown_key", "p_flags", "p_lr_str",
                                  "p_floor", "p_data", "p_frontier"])
def test_a_wrongly_typed_profile_is_one_error_at_load(case, spec, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_bad_profiles(spec)[case]))
    for load in (Profile.load, autofit.load_profile):
        with pytest.raises(ProfileError) as err:
            load(path)
        assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_a_profile_round_trips_through_the_typed_reader(spec):
    profile = make_profile(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1))
    assert Profile.from_dict(yaml.safe_load(profile.to_yaml())) == profile


def test_one_bad_file_in_the_store_hides_no_good_one(spec, tmp_path, capsys):
    store = ProfileStore(tmp_path / "store")
    good_path = store.save(make_profile(spec, TrainConfig(micro_batch_size=8)))
    good = good_path.read_bytes()
    for case, raw in _bad_profiles(spec).items():
        (store.root / f"{case}--x.yaml").write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    (store.root / "binary--x.yaml").write_bytes(b"\xff\x00\xfe")
    code, out, err = run_main(capsys, "profiles", "list", "--store", store.root, "--json")
    assert code == 0, err
    assert [row["file"] for row in json.loads(out)["profiles"]] == [good_path.name]
    for args in (("profiles", "show", "tiny"), ("profiles", "export", "tiny", "--format", "env")):
        code, out, err = run_main(capsys, *args, "--store", store.root, "--device", "cpu")
        assert code == 0 and "Traceback" not in err, err
    assert good_path.read_bytes() == good


def test_demotions_of_the_wrong_shape_are_skipped_and_kept_aside(spec, tmp_path):
    from autofit.profiles.demotions import demotions_path, read_demotions, record_demotion
    from autofit.train.recover import demotion

    profile_path = tmp_path / "tiny--cpu.yaml"
    bad = json.dumps({"schema": 1, "demotions": [{"step": "three"}]})
    demotions_path(profile_path).write_text(bad)
    assert read_demotions(profile_path) == []
    event = demotion(3, TrainConfig(micro_batch_size=8), RuntimeError("out of memory"))
    record_demotion(profile_path, event, spec_hash=spec.spec_hash)
    assert read_demotions(profile_path) == [event]
    assert Path(f"{demotions_path(profile_path)}.unreadable").read_text() == bad


# ---- 4. writes that can fail --------------------------------------------------------------------


@pytest.mark.parametrize("where, errno_name", [("mkstemp", "EROFS"), ("fsync", "ENOSPC"), ("replace", "EACCES")])
def test_a_refused_write_is_one_error_and_the_previous_file_stays(tmp_path, monkeypatch, where, errno_name):
    import errno
    import tempfile

    target = tmp_path / "profile.yaml"
    target.write_text("the previous profile\n")
    code = getattr(errno, errno_name)

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr({"mkstemp": tempfile, "fsync": os, "replace": os}[where], where, refuse)
    with pytest.raises(WriteError, match=rf"cannot write {target}: .*\({errno_name}\); the previous file is unchanged"):
        atomic_write_text(target, "the new profile\n")
    monkeypatch.undo()
    assert target.read_text() == "the previous profile\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.yaml"]  # no temp file left


def test_torch_saves_write_error_is_told_as_the_os_said_it(tmp_path):
    """torch.save turns its file's OSError into "unexpected pos ..."; the writer tells the cause.
    A real EFBIG: this process's file-size limit, lowered around the one write."""
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"the previous checkpoint")
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as the CLI sets it
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        with pytest.raises(WriteError, match=r"File too large \(EFBIG\); the previous file is unchanged; the fi"):
            atomic_write(target, lambda f: torch.save({"x": torch.zeros(10_000)}, f))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert target.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def _ulimit_f(limit_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


@pytest.mark.slow
def test_a_file_size_limit_is_one_line_and_the_checkpoint_before_it_stays(tmp_path):
    """`ulimit -f`: SIGXFSZ would kill the process mid-write with no word (its default
    action); ignored, the write fails with EFBIG and is one line, exit 2."""
    spec_path = write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 8, "checkpoint_every": 1}))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    first = subprocess.run([sys.executable, "-m", "autofit", "-q", "train", spec_path, "--device", "cpu",
                            "--steps", "1", "--no-progress", "--checkpoint-dir", run], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    before = (run / "checkpoint.pt").read_bytes()
    limited = subprocess.run([sys.executable, "-m", "autofit", "-q", "train", spec_path, "--device", "cpu",
                              "--steps", "3", "--no-progress", "--resume", "--checkpoint-dir", run],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                             preexec_fn=_ulimit_f(len(before) // 4))
    lines = limited.stderr.strip().splitlines()
    assert limited.returncode == 2, limited.stderr  # not -SIGXFSZ
    assert len(lines) == 1 and "File too large (EFBIG); the previous file is unchanged" in lines[0], limited.stderr
    assert (run / "checkpoint.pt").read_bytes() == before
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 1
    assert [p.name for p in run.iterdir()] == ["checkpoint.pt"]


def test_a_checkpoint_folder_made_read_only_mid_run(tmp_path, capsys, monkeypatch, read_only):
    from autofit.train import loop

    spec_path = write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 8, "checkpoint_every": 1}))
    run = tmp_path / "run"
    real_save = loop.Checkpoints.save

    def save_then_lock(self, step, history):
        real_save(self, step, history)
        if step == 1:  # the first checkpoint is written; from here the folder is read-only
            read_only(run)

    monkeypatch.setattr(loop.Checkpoints, "save", save_then_lock)
    code, _, err = run_main(capsys, "-q", "train", spec_path, "--device", "cpu", "--steps", "3", "--no-progress",
                            "--checkpoint-dir", run)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"autofit: error: cannot write {run}/checkpoint.pt: ")
    assert lines[0].endswith("the previous file is unchanged")
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["step"] == 1 and len(state["history"]["losses"]) == 1


def test_a_profile_store_made_read_only_keeps_its_profiles(spec, tmp_path, capsys, read_only):
    store = ProfileStore(tmp_path / "store")
    old = make_profile(spec, TrainConfig(micro_batch_size=8))
    path = store.save(old)
    read_only(store.root)
    with pytest.raises(WriteError, match="the previous file is unchanged"):
        store.save(make_profile(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2)))
    assert Profile.load(path) == old
    # A tune is refused before its first trial; so is a run whose metrics could not be written.
    spec_path = write_spec(tmp_path, tiny_gpt_dict())
    code, _, err = run_main(capsys, "tune", spec_path, "--device", "cpu", "--out", store.root,
                            "--state-dir", tmp_path / "state")
    assert code == 2 and err.count("\n") == 1 and f"--out: {store.root} is not writable" in err, err
    code, _, err = run_main(capsys, "train", spec_path, "--device", "cpu", "--metrics-out", store.root / "m.json",
                            "--checkpoint-dir", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and "--metrics-out: cannot write" in err, err
    assert not (tmp_path / "run").exists()  # refused before the run


# ---- 5. resume and data edge cases ----------------------------------------------------------------


def test_resume_after_the_global_batch_changed(tmp_path, capsys):
    spec_path = write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 8}))
    run = tmp_path / "run"
    common = ("-q", "train", spec_path, "--device", "cpu", "--no-progress", "--checkpoint-dir", run)
    assert run_main(capsys, *common, "--steps", "2")[0] == 0
    write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 16}))
    code, out, err = run_main(capsys, *common, "--steps", "3", "--resume", "--metrics-out", tmp_path / "m.json")
    assert code == 0, err
    assert "written with global batch 8, train.global_batch_size is now 16" in err
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["start_step"] == 2 and metrics["steps"] == 3
    assert (metrics["config"]["micro_batch_size"], metrics["config"]["grad_accum_steps"]) == (16, 1)


def _sparse_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of 4 tokens whose ids leave a gap: 'c' is id 200."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 200},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_token_ids_beyond_the_vocabulary_name_the_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = _sparse_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": "a b c a b"}) + "\n" for _ in range(32)))
    spec_path = write_spec(tmp_path, tiny_gpt_dict(data={"kind": "text", "path": "corpus.jsonl",
                                                         "tokenizer": "tokenizer.json"}))
    for extra in (("train", "--checkpoint-dir", tmp_path / "run"), ("estimate",)):
        code, _, err = run_main(capsys, "-q", extra[0], spec_path, "--device", "cpu", *extra[1:])
        assert code == 2 and err.count("\n") == 1, err
        assert f"data.tokenizer: {tokenizer} gives {tmp_path / 'corpus.jsonl'} token id 200, not below the model's " \
               f"vocab_size (64)" in err


def test_a_damaged_text_cache_is_rebuilt(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from autofit.workload import text

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("a b a\nb b a a\n")
    first = text.tokenize(tmp_path / "corpus.txt", "txt", None, tmp_path / "tokenizer.json")
    [cache] = (tmp_path / "cache" / "text").glob("*.npz")
    whole = cache.read_bytes()
    for damage in (whole[:len(whole) // 2], b"PK\x03\x04" + b"\0" * 64, b""):
        cache.write_bytes(damage)
        again = text.tokenize(tmp_path / "corpus.txt", "txt", None, tmp_path / "tokenizer.json")
        assert (again.ids == first.ids).all() and (again.offsets == first.offsets).all()
        assert text._read_cache(cache).ids.tolist() == first.ids.tolist()  # rewritten whole


def test_the_host_out_of_ram_is_out_of_memory():
    from autofit.device.oom import is_oom

    host = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                        "memory: you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")
    assert is_oom(host) and is_oom(MemoryError()) and not is_oom(RuntimeError("shape mismatch"))


_HOST_OOM = """
import resource, sys
from autofit.cli import main
import torch  # before the limit: importing maps far more address space than it uses
def vm_bytes():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
limit = vm_bytes() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_the_host_running_out_of_ram_is_recovered_like_any_oom(tmp_path):
    """Address space capped 256 MiB above what the process holds: the full batch's step
    cannot get its memory from the host, and the step is done again at a smaller micro batch."""
    spec_path = write_spec(tmp_path, tiny_gpt_dict(
        model={"builtin": "gpt", "args": {"n_layer": 1, "n_head": 2, "n_embd": 64, "vocab_size": 4096,
                                          "seq_len": 32}},
        train={"global_batch_size": 1024, "checkpoint_every": 0}))
    result = subprocess.run([sys.executable, "-c", _HOST_OOM, str(256 * 2**20), "train", str(spec_path), "--device",
                             "cpu", "--steps", "1", "--no-progress", "--checkpoint-dir", str(tmp_path / "run"),
                             "--metrics-out", str(tmp_path / "m.json")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode in (0, 3) and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "DefaultCPUAllocator" in result.stderr  # the host's own refusal, recognised
    if result.returncode == 0:
        assert json.loads((tmp_path / "m.json").read_text())["demotions"]
    else:
        assert "does not fit the host's memory" in result.stderr.strip().splitlines()[-1]


# ---- 8. concurrent tunes on one SQLite study --------------------------------------------------------


_OPEN_STUDY = """
import pathlib, sys, time
from autofit.search.study import make_study
folder = pathlib.Path(sys.argv[1])
(folder / f"ready-{sys.argv[2]}").touch()
while not (folder / "go").exists():
    time.sleep(0.001)
try:
    make_study(study_name="tiny", storage=f"sqlite:///{folder / 'studies.db'}")
except Exception as exc:
    sys.exit(f"FAILED: {exc}")
"""


@pytest.mark.slow
def test_tunes_started_together_on_one_sqlite_study_all_open_it(tmp_path):
    """Before the lock, 4 processes opening a fresh SQLite study at once failed with "table
    studies already exists" (or version_info, or alembic_version) in 4 rounds of 5."""
    import optuna

    workers, rounds = 4, 5
    for round_ in range(rounds):
        folder = tmp_path / f"round{round_}"
        folder.mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", _OPEN_STUDY, str(folder), str(i)], stderr=subprocess.PIPE,
                                  text=True) for i in range(workers)]
        deadline = time.monotonic() + 120
        while len(list(folder.glob("ready-*"))) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        (folder / "go").touch()  # all of them imported and waiting: they open the storage together
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * workers, f"round {round_}: {errors}"
        study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{folder / 'studies.db'}")
        assert study.trials == []  # one study, readable


# ---- 9. environment and service -------------------------------------------------------------------


def _no_home(monkeypatch):
    for name in ("HOME", "AUTOFIT_STATE_DIR", "XDG_STATE_HOME", "AUTOFIT_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))


def test_no_home_is_fine_where_xdg_names_the_folders(tmp_path, monkeypatch, capsys):
    from autofit.base.paths import default_cache_dir, default_state_dir

    _no_home(monkeypatch)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_state_dir() == tmp_path / "state" / "autofit"
    assert default_cache_dir() == tmp_path / "cache" / "autofit"
    monkeypatch.delenv("XDG_STATE_HOME")
    spec_path = write_spec(tmp_path, tiny_gpt_dict())
    code, _, err = run_main(capsys, "tune", spec_path, "--device", "cpu", "--out", tmp_path / "profiles")
    assert code == 2 and err.strip().splitlines() == [
        "autofit: error: no home folder (HOME is not set); set AUTOFIT_STATE_DIR or XDG_STATE_HOME, or pass "
        "--state-dir"], err


def test_the_unit_does_not_restart_what_serve_exits_with_on_a_config_error():
    unit = (REPO / "systemd" / "autofit.service").read_text()
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2" in unit
    assert {ROUND_2[case][1] for case in ROUND_2 if ROUND_2[case][0].startswith("serve")} == {2}


# Binary bytes (a disk error, a file overwritten by another program): not even text.
_BINARY_STATE = bytes(range(256)) * 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wrong shape", "binary bytes"])
def test_serve_sets_a_damaged_state_file_aside_and_starts(tmp_path, kind):
    from autofit.service.status import status_command
    from test_daemon import Serve, write_config, write_inventory

    config = write_config(tmp_path)
    (tmp_path / "state").mkdir()
    damaged = json.dumps(_state(pairs=[{"model": "m", "fingerprint": "f", "device": "d", "tunes": "two"}])).encode()
    if kind == "binary bytes":
        damaged = _BINARY_STATE
    (tmp_path / "state" / "state.json").write_bytes(damaged)
    serve = Serve(config, write_inventory(tmp_path))
    try:
        state = serve.wait_for("a fresh state file", lambda s: s.get("service", {}).get("pid") == serve.proc.pid,
                               timeout_s=120)
        assert state["pairs"] == []
    finally:
        code, _ = serve.terminate()
    assert code == 0, serve.log()
    assert (tmp_path / "state" / "state.json.damaged").read_bytes() == damaged
    warnings = [line for line in serve.log().splitlines() if "starting without the last run's state" in line]
    reason = "not a text file" if kind == "binary bytes" else "pairs[0].tunes: must be an integer"
    assert len(warnings) == 1 and reason in warnings[0]
    assert "Traceback" not in serve.log()
    assert "not running" in status_command(config)  # the fresh file reads back


@pytest.mark.parametrize("content", [_BINARY_STATE, b"\xff" * (17 << 20)])
def test_an_unreadable_state_file_is_damaged_state_which_serve_sets_aside(tmp_path, content):
    from autofit.service.state import DamagedState, read_state, set_aside

    (tmp_path / "state.json").write_bytes(content)
    with pytest.raises(DamagedState, match=r"not a state file written by this autofit serve"):
        read_state(tmp_path)
    set_aside(tmp_path)
    assert read_state(tmp_path) is None and (tmp_path / "state.json.damaged").read_bytes() == content
