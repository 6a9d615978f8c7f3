"""Third-party model code, unchanged, trained and tuned by autofit from specs that name it.

    python benchmarks/byom_thirdparty.py /work/notes/thirdparty --out benchmarks/results/DATE-byom-thirdparty.md

THIRDPARTY is a folder holding, fetched unchanged (they are never copied into this
repository): `nanogpt/model.py` (karpathy/nanoGPT), `mingpt/` (karpathy/minGPT) and
`word_language_model/model.py` (pytorch/examples). For each case this writes a spec (and,
for the LSTM, a loss of our own) into a temp folder, puts the code's folder on PYTHONPATH
and runs the real CLI: `autofit train` for 10 steps and `autofit tune` under a CPU budget.
It prints, and with --out writes, a Markdown report: each command, its exit code, its
stdout (which must hold only autofit's answer) and the tail of its stderr.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TOKENS = REPO / "examples" / "data" / "train.bin"  # byte-level Shakespeare: vocabulary 256
SEARCH = {"trials": 6, "warmup_steps": 1, "measure_steps": 2, "validate_steps": 3, "frontier_points": 1}

# Our own code: the LSTM's forward(input, hidden) needs its hidden state and sequence-first
# inputs, which is a training step's business: a loss of the user's own.
WLM_LOSS = '''
import torch.nn.functional as F


def lstm_loss(model, batch):
    """(x, y) batch-first from autofit; the RNN wants [T, B] and a fresh hidden state."""
    x, y = (t.t().contiguous() for t in batch)
    log_probs, _ = model(x, model.init_hidden(x.size(1)))
    return F.nll_loss(log_probs, y.reshape(-1))
'''


def cases(thirdparty: Path) -> list[dict]:
    tokens = {"kind": "tokens", "path": str(TOKENS), "seq_len": 64}
    return [
        {"name": "nanogpt", "path": thirdparty / "nanogpt", "expect": 0,
         "model": {"python": "model:GPT", "args": {"config": {"python": "model:GPTConfig", "args": {
             "n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 64, "vocab_size": 256, "dropout": 0.0}}}},
         "data": tokens},
        {"name": "mingpt", "path": thirdparty, "expect": 0,
         "model": {"python": "mingpt.model:GPT", "args": {"config": {"python": "mingpt.utils:CfgNode", "args": {
             "model_type": None, "n_layer": 4, "n_head": 4, "n_embd": 64, "vocab_size": 256, "block_size": 64,
             "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}}}},
         "data": tokens},
        {"name": "wlm-transformer-undeclared", "path": thirdparty / "word_language_model", "expect": 2,
         "why": "sequence-first nn.Transformer given batch-first data: the probe refuses it",
         "model": {"python": "model:TransformerModel",
                   "args": {"ntoken": 256, "ninp": 64, "nhead": 4, "nhid": 128, "nlayers": 2, "dropout": 0.0}},
         "data": tokens},
        {"name": "wlm-transformer", "path": thirdparty / "word_language_model", "expect": 0,
         "why": "model.batch_dim: 1; model.blocks: encoder.layers (its nn.Transformer also builds a decoder of "
                "6 layers that forward never runs, which block discovery would pick)",
         "model": {"python": "model:TransformerModel", "batch_dim": 1, "blocks": "encoder.layers",
                   "args": {"ntoken": 256, "ninp": 64, "nhead": 4, "nhid": 128, "nlayers": 2, "dropout": 0.0}},
         "data": tokens},
        {"name": "wlm-lstm", "path": thirdparty / "word_language_model", "expect": 0,
         "why": "forward(input, hidden), sequence-first: loss.python of our own (lstm_loss). 16-mixed is left "
                "out: the CPU's oneDNN has no fp16 LSTM (\"could not create a primitive descriptor\"), and an "
                "error in the user's code stops a tune with exit 2 whatever config met it",
         "search": {"precisions": ["32-true", "bf16-mixed", "bf16-true"]},
         "model": {"python": "model:RNNModel",
                   "args": {"rnn_type": "LSTM", "ntoken": 256, "ninp": 64, "nhid": 64, "nlayers": 2, "dropout": 0.0}},
         "loss": {"python": "wlm_loss:lstm_loss"}, "data": tokens},
    ]


def run(command: list[str], env: dict, cwd: Path) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autofit", *command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800)
    return {"command": "autofit " + " ".join(command), "rc": proc.returncode, "stdout": proc.stdout,
            "stderr": proc.stderr, "wall_s": time.perf_counter() - started}


def try_case(case: dict, folder: Path, budget: str) -> list[dict]:
    spec = {"schema": 1, "name": case["name"], "model": case["model"], "data": case["data"],
            "optimizer": {"name": "adamw", "lr": 3e-3}, "train": {"global_batch_size": 16, "steps": 10, "seed": 0},
            "search": SEARCH | case.get("search", {})}
    if "loss" in case:
        spec["loss"] = case["loss"]
        (folder / "wlm_loss.py").write_text(WLM_LOSS)
    path = folder / f"{case['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(case["path"]), str(folder)])}
    out = [run(["train", str(path), "--steps", "10", "--no-progress", "--overwrite",
                "--checkpoint-dir", str(folder / "runs" / case["name"])], env, folder)]
    if out[0]["rc"] == 0:
        out.append(run(["tune", str(path), "--memory-budget", budget, "--out", str(folder / "profiles"),
                        "--state-dir", str(folder / "state"), "--no-report"], env, folder))
    return out


def report(case: dict, runs: list[dict]) -> str:
    lines = [f"## {case['name']}", ""]
    if case.get("why"):
        lines += [case["why"], ""]
    lines += ["spec `model:` " + json.dumps(case["model"]) + (f", `loss:` {json.dumps(case['loss'])}"
                                                               if "loss" in case else ""), ""]
    for r in runs:
        ok = "as expected" if r["rc"] == (case["expect"] if r is runs[0] else 0) else "NOT as expected"
        tail = "\n".join(line for line in r["stderr"].strip().splitlines()[-14:])
        lines += [f"`{r['command']}`: exit {r['rc']} ({ok}), {r['wall_s']:.0f} s", "", "stdout:", "```",
                  r["stdout"].rstrip() or "(empty)", "```", "stderr (tail):", "```", tail, "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("thirdparty", type=Path, help="folder with nanogpt/, mingpt/, word_language_model/")
    parser.add_argument("--budget", default="64MiB", help="tune's --memory-budget (default: 64MiB)")
    parser.add_argument("--only", action="append", help="run only this case (repeatable)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    chosen = [c for c in cases(args.thirdparty.resolve()) if not args.only or c["name"] in args.only]
    sections = []
    with tempfile.TemporaryDirectory(prefix="autofit-byom-") as tmp:
        for case in chosen:
            print(f"== {case['name']}", file=sys.stderr, flush=True)
            sections.append(report(case, try_case(case, Path(tmp), args.budget)))
    text = textwrap.dedent(f"""\
        # Third-party models, unchanged, through autofit train and tune

        Command: `python benchmarks/byom_thirdparty.py {args.thirdparty}{' --budget ' + args.budget}`

        """) + "\n".join(sections)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
