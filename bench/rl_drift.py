"""Is what RL does to the SFT model the size of its update, or its direction?

    .venv/bin/python bench/rl_drift.py   # after bench/words_levers.py's "48 steps" and "RL 24 steps"

Twelve RL steps from the 48-step stepwise SFT model rewrite the sums its reasoning writes (right 48% ->
9%; docs/words.md). AdamW moves every weight by about the learning rate a step however noisy the
gradient is, so the change could be noise of that size. This builds the SFT model plus Gaussian noise
as large as RL's change, tensor by tensor (the same root mean square, a random direction), evaluates it
as words_levers evaluates (temperature 0.6, 384 tokens, T = 6, 2 samples) on the first --first of its
training problems, and prints accuracy and the sums beside the SFT and RL models' evaluations of the
same problems (and any other arm's, --also): how many are right, how many ten times too big, and the
digits of the values written against the right ones. Noise that leaves the sums right says it is the
direction RL moves in; the columns say which way each run's values went.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import report  # noqa: E402

LEVERS = "runs/words_levers"
parser = argparse.ArgumentParser(description="RL's change to the SFT model against noise of its size.")
parser.add_argument("--sft", default=f"{LEVERS}/48_steps/sft", help="the SFT model RL started from")
parser.add_argument("--rl", default=f"{LEVERS}/RL_24_steps_from_48_steps/hf_step_12", help="RL's model")
parser.add_argument("--problems", default=f"{LEVERS}/train_last300.jsonl", help="what both were evaluated on")
parser.add_argument("--first", type=int, default=100, help="evaluate the noisy model on the first N problems")
parser.add_argument("--seed", type=int, default=0, help="the noise's seed")
parser.add_argument("--out", default="runs/rl_drift",
                    help="the noisy model and its evaluations (kept: another --rl or --seed, another --out)")
parser.add_argument("--also", nargs="*", default=[], help="other evaluations of the same problems to list")
args = parser.parse_args()
export = os.path.basename(args.rl)  # (words_levers evaluates an earlier export hf_step_N in eval_step_N)
rl_eval = f"eval_step_{export[len('hf_step_'):]}" if export.startswith("hf_step_") else "eval"
evals = {"SFT": f"{os.path.dirname(args.sft)}/eval", "RL": f"{os.path.dirname(args.rl)}/{rl_eval}"}
for name, folder in [("--sft", args.sft), ("--rl", args.rl), *evals.items()]:
    if not os.path.exists(folder):
        sys.exit(f"rl_drift: {folder} ({name}) is not there\n---> HINT: run bench/words_levers.py --rl-from "
                 f"\"48 steps\" --arms \"48 steps,RL 24 steps\" first, or point --sft and --rl at yours")


def digits(value: float) -> int:
    return len(str(round(abs(value))))


def mean(values) -> float:
    """A mean that is nan for an evaluation whose reasoning writes no sums (the symbolic style's)."""
    values = list(values)
    return statistics.mean(values) if values else float("nan")


noisy = f"{args.out}/model"
if not os.path.exists(f"{noisy}/model.safetensors"):
    shutil.copytree(args.sft, noisy, ignore=shutil.ignore_patterns("model.safetensors"), dirs_exist_ok=True)
    sft, rl = load_file(f"{args.sft}/model.safetensors"), load_file(f"{args.rl}/model.safetensors")
    generator = torch.Generator().manual_seed(args.seed)
    moved = {}
    for key, weight in sft.items():
        scale = (rl[key].float() - weight.float()).pow(2).mean().sqrt()  # RL's change to this tensor, its RMS
        noise = torch.randn(weight.shape, generator=generator) * scale
        moved[key] = (weight.float() + noise).to(weight.dtype).contiguous()
    save_file(moved, f"{noisy}/model.safetensors", metadata={"format": "pt"})
noisy_eval = evals["SFT + noise of RL's size"] = f"{args.out}/eval_first_{args.first}"
if not os.path.exists(f"{noisy_eval}/table.json"):
    cmd = ["eval.py", "--model", noisy, "--out-dir", noisy_eval, "--benchmarks", args.problems,
           "--first", str(args.first), "--n", "2", "--max-response", "384", "--kv-cache-tokens", "65536",
           "--max-turns", "6"]
    print("=== python " + " ".join(cmd), flush=True)
    if subprocess.run([sys.executable, *cmd]).returncode:
        sys.exit("rl_drift: the evaluation failed\n---> HINT: fix what eval.py reports and rerun")

print(f"\nthe first {args.first} of {args.problems}, 2 samples each; the sums the reasoning writes: how many")
print("are right, how many 10 times too big, the digits of the values written and of the right ones")
print(f"{'':28} {'avg@2':>6} {'gain (SE)':>12} {'right':>6} {'x10':>5} {'digits':>7} {'right':>6}")
for name, folder in [*evals.items(), *((os.path.basename(os.path.dirname(f)), f) for f in args.also)]:
    gain, se, _ = report.paired_gain(evals["SFT"], folder, only=set(range(args.first)))
    accuracy = 100 * mean(a for (_, problem), a in report.per_problem(folder).items()
                                     if problem < args.first)
    sums = report.written_sums(folder, args.first)
    too_big = mean(abs(written) >= 10 * max(abs(right), 1) for written, right in sums)
    print(f"{name:28} {accuracy:6.1f} {100 * gain:+6.1f} ({100 * se:.1f}) "
          f"{100 * report.sums_right(folder, args.first):5.0f}% {100 * too_big:4.0f}% "
          f"{mean(digits(w) for w, _ in sums):7.2f} {mean(digits(r) for _, r in sums):6.2f}")
