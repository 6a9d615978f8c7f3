"""model.yaml validation: every malformed file gives exit code 2 and one line naming the problem."""

import pytest

from autofit.base.errors import SpecError
from autofit.config.spec import load_spec, parse_spec
from conftest import REPO, run_cli, run_main, tiny_gpt_dict, write_spec

def _with(key: str, value) -> dict:
    spec = tiny_gpt_dict()
    spec[key] = value
    return spec


MALFORMED = {
    "wrong type": (tiny_gpt_dict(train={"global_batch_size": "eight"}), "train.global_batch_size"),
    "negative size": (tiny_gpt_dict(train={"global_batch_size": -4}), "train.global_batch_size: must be a positive integer, got -4"),
    "unknown key": (tiny_gpt_dict(trian={"steps": 3}), "trian: unknown key; did you mean train?"),
    "unknown nested key": (tiny_gpt_dict(search={"max_frezee_blocks": 2}), "did you mean max_freeze_blocks"),
    "two model sources": (_with("model", {"builtin": "gpt", "python": "m:f"}), "model: exactly one source"),
    "no model source": (_with("model", {"args": {}}), "model: exactly one source"),
    "bad precision": (tiny_gpt_dict(search={"precisions": ["bf16"]}), "search.precisions[0]"),
    "bad data kind": (tiny_gpt_dict(data={"kind": "tokenz"}), "data.kind: must be one of synthetic, tokens, python, text, got 'tokenz'; did you mean tokens?"),
    "tokens without path": (tiny_gpt_dict(data={"kind": "tokens"}), "data.path: required"),
    "missing token file": (tiny_gpt_dict(data={"kind": "tokens", "path": "nope.bin"}), "data.path"),
    "bad builtin arg": (_with("model", {"builtin": "gpt", "args": {"n_lyer": 2}}), "n_lyer"),
    "unknown builtin": (_with("model", {"builtin": "resnet"}), "resnet"),
    "boolean as number": (tiny_gpt_dict(optimizer={"lr": True}), "optimizer.lr"),
    "bad checkpoint policy": (tiny_gpt_dict(search={"checkpoint_policies": ["selectiv"]}),
                              "search.checkpoint_policies[0]: must be one of full, selective, got 'selectiv'; "
                              "did you mean selective?"),
    "compile not a boolean": (tiny_gpt_dict(search={"compile": ["yes"]}),
                              "search.compile[0]: must be one of false, true, got 'yes'"),
    "headroom too large": (tiny_gpt_dict(search={"memory_headroom": 0.9}), "search.memory_headroom"),
    "bad name": (tiny_gpt_dict(name="my model/v2"), "name:"),
    "optimizer bits 16": (tiny_gpt_dict(search={"optimizer_bits": [32, 16]}), "search.optimizer_bits[1]"),
    "8-bit sgd": (tiny_gpt_dict(optimizer={"name": "sgd"}, search={"optimizer_bits": [32, 8]}),
                  "search.optimizer_bits: 8-bit state is for adam and adamw"),
    "schema 2": (tiny_gpt_dict(schema=2), "schema:"),
    "loss args without python": (tiny_gpt_dict(loss={"args": {"t": 1}}), "loss.args: only with loss.python"),
    "bad loss target": (tiny_gpt_dict(loss={"python": "losses"}), 'loss.python: expected "module.path:function"'),
    "unknown loss key": (tiny_gpt_dict(loss={"per_sampl": False}),
                         "loss.per_sampl: unknown key; did you mean per_sample?"),
    "per_sample not a boolean": (tiny_gpt_dict(loss={"per_sample": "no"}), "loss.per_sample: must be true or false"),
    "bad blocks path": (tiny_gpt_dict(model={"blocks": "blocks..0"}), "model.blocks: a dotted module path"),
    "negative batch_dim": (tiny_gpt_dict(model={"batch_dim": -1}), "model.batch_dim: must be an integer >= 0"),
    "bad constructor target": (_with("model", {"python": "m:GPT", "args": {"config": {"python": "GPTConfig"}}}),
                               'model.args.config.python: expected "module.path:Callable"'),
    "constructor extra key": (_with("model", {"python": "m:GPT", "args": {"config": {"python": "m:C", "argz": {}}}}),
                              "model.args.config.argz: unknown key; did you mean args?"),
    "not a mapping": ([1, 2, 3], "expected a mapping"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_spec_gives_one_line_and_exit_2(tmp_path, capsys, case):
    spec, expected = MALFORMED[case]
    path = write_spec(tmp_path, spec)
    code, _, err = run_main(capsys, "train", path, "--steps", "1", "--no-progress",
                            "--checkpoint-dir", tmp_path / "ckpt")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert expected in lines[0]


def test_malformed_spec_as_a_real_process(tmp_path):
    """The same contract end to end, once, through the installed entry point's module."""
    path = write_spec(tmp_path, MALFORMED["negative size"][0])
    result = run_cli("train", path, "--steps", "1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"autofit: error: {path}: {MALFORMED['negative size'][1]}"]


@pytest.mark.parametrize("text,expected", [
    ("name: x\nmodel: {builtin: gpt\n", "YAML syntax error at line"),
    (None, "no such file"),
    ("", "the file is empty"),
    ("- 1\n- 2\n", "the file: expected a mapping"),
])
def test_unreadable_spec_files(tmp_path, capsys, text, expected):
    path = tmp_path / "model.yaml"
    if text is not None:
        path.write_text(text)
    code, _, err = run_main(capsys, "train", path, "--steps", "1")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert expected in err


def test_bad_cli_arguments_give_exit_2(tmp_path, capsys, tiny_spec_path):
    for args in (["train", tiny_spec_path, "--steps", "0"], ["train", tiny_spec_path, "--device", "gpu7"],
                 ["train", tiny_spec_path, "--steps", "x"], ["nonsense"]):
        code, _, err = run_main(capsys, *args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def test_spec_defaults_and_round_trip(tmp_path):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    assert spec.optimizer.name == "adamw" and spec.search.max_freeze_blocks == 0
    again = parse_spec(spec.to_dict(), source_dir=spec.source_dir)
    assert again == spec
    assert spec.micro_batch_sizes() == [1, 2, 4, 8]


def test_spec_hash_is_stable_and_tracks_what_tuning_depends_on(tmp_path):
    a = load_spec(write_spec(tmp_path, tiny_gpt_dict(), "a.yaml"))
    # Same content written differently (flow style, key order): same hash.
    b_path = tmp_path / "b.yaml"
    b_path.write_text(
        "name: tiny\nschema: 1\ntrain: {seed: 0, global_batch_size: 8, steps: 10, checkpoint_every: 5, log_every: 5}\n"
        "model: {args: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 64, seq_len: 16}, builtin: gpt}\n"
        "data: {kind: synthetic}\noptimizer: {lr: 0.001, name: adamw}\n"
        "search: {trials: 12, warmup_steps: 1, measure_steps: 2, validate_steps: 3}\n")
    assert load_spec(b_path).spec_hash == a.spec_hash
    longer = load_spec(write_spec(tmp_path, tiny_gpt_dict(train={"steps": 999}), "c.yaml"))
    assert longer.spec_hash == a.spec_hash  # run length does not change the best config
    wider = load_spec(write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 16}), "d.yaml"))
    assert wider.spec_hash != a.spec_hash
    # An opt-in knob at its default leaves the hash (and the profiles tuned before it) alone.
    default = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"checkpoint_policies": ["full"]}), "e.yaml"))
    assert default.spec_hash == a.spec_hash
    both = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"checkpoint_policies": ["full", "selective"]}),
                                "f.yaml"))
    assert both.spec_hash != a.spec_hash and both.search.checkpoint_policies == ("full", "selective")
    # A knob the device decides (compile: on CUDA unless forbidden): absent, forbidden and
    # opted in are three spaces, so three hashes; `false` / `true` spell `[false]` / `[false, true]`.
    eager = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"compile": [False]}), "g.yaml"))
    compiled = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"compile": [False, True]}), "h.yaml"))
    assert a.search.compile == () and "compile" not in a.to_dict()["search"]
    assert len({a.spec_hash, eager.spec_hash, compiled.spec_hash}) == 3 and compiled.search.compile == (False, True)
    forbidden = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"compile": False}), "i.yaml"))
    opted = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"compile": True}), "j.yaml"))
    assert forbidden.search.compile == (False,) and opted.search.compile == (False, True)
    assert parse_spec(a.to_dict(), source_dir=tmp_path).search.compile == ()  # the child reads what the parent wrote


def test_example_specs_parse():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_spec(path)


def test_parse_spec_raises_spec_error_as_a_library():
    with pytest.raises(SpecError, match="train: required key is missing"):
        parse_spec({"name": "x", "model": {"builtin": "gpt"}}, source_dir=REPO)


@pytest.mark.parametrize("extra,expected", [
    (["--device", "-1"], "--device"),
    (["--device", "3"], "no GPU 3"),
    (["--checkpoint-dir", "{file}"], "--checkpoint-dir: "),
])
def test_train_rejects_bad_devices_and_folders_up_front(tmp_path, capsys, tiny_spec_path, extra, expected):
    (tmp_path / "a-file").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "a-file")) for a in extra]
    code, _, err = run_main(capsys, "train", tiny_spec_path, "--steps", "1", *args)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1


def test_seed_out_of_range_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match=r"train.seed: an integer in \[0, 2\*\*32\)"):
        load_spec(write_spec(tmp_path, tiny_gpt_dict(train={"seed": -1})))


def test_bad_storage_url_is_one_line(tmp_path, capsys, tiny_spec_path):
    code, _, err = run_main(capsys, "tune", tiny_spec_path, "--device", "cpu", "--storage", "foo://bar",
                            "--out", tmp_path / "p")
    assert code == 2 and "--storage foo://bar: cannot open" in err and len(err.strip().splitlines()) == 1


def test_a_diverged_run_exits_3_with_null_losses(tmp_path, capsys):
    path = write_spec(tmp_path, tiny_gpt_dict(optimizer={"lr": 1e30}, train={"max_grad_norm": None}))
    metrics = tmp_path / "m.json"
    code, out, err = run_main(capsys, "train", path, "--steps", "8", "--no-progress",
                              "--checkpoint-dir", tmp_path / "ck", "--metrics-out", metrics)
    assert code == 3 and "diverged" in err
    import json
    assert json.loads(metrics.read_text())["final_loss"] is None and json.loads(out)["final_loss"] is None


def test_byom_keys_join_the_hash_only_when_given():
    plain = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    assert "loss" not in plain.to_dict() and "blocks" not in plain.to_dict()["model"]
    assert parse_spec(tiny_gpt_dict(loss={"per_sample": True}), source_dir=REPO).spec_hash == plain.spec_hash
    for changed in (tiny_gpt_dict(loss={"per_sample": False}), tiny_gpt_dict(model={"blocks": ["blocks"]}),
                    tiny_gpt_dict(model={"batch_dim": 0})):
        spec = parse_spec(changed, source_dir=REPO)
        assert spec.spec_hash != plain.spec_hash and parse_spec(spec.to_dict(), source_dir=REPO) == spec


def test_opt_in_knobs_keep_the_hash_of_specs_without_them():
    plain = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    explicit = parse_spec(tiny_gpt_dict(search={"optimizer_bits": [32], "checkpoint_policies": ["full"]}),
                          source_dir=REPO)
    opted = parse_spec(tiny_gpt_dict(search={"optimizer_bits": [32, 8]}), source_dir=REPO)
    assert plain.spec_hash == explicit.spec_hash != opted.spec_hash
    assert opted.search.optimizer_bits == (32, 8)
    assert parse_spec(opted.to_dict(), source_dir=REPO) == opted
