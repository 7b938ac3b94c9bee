"""Benchmark: does the toy RL learn as well with LoRA as with full fine-tuning? (docs/benchmarks.md)

    python bench/lora_toy.py                                  # after `python demo.py` (runs/toy_sft, data/toy)
    python bench/lora_toy.py --seeds 0 1 2 --rank 32 --steps 20
    python bench/lora_toy.py --lora-args "--lora-setting train="    # LoRA with the head frozen

Each arm and seed is one `train.py --preset toy` run (the same steps, data and seed for both arms; LoRA
adds --lora-rank and nothing else: the adapters train at the preset's lr x --lora-lr-scale, and the
preset's --lora-setting train=lm_head trains the head in full at its lr), then one
`eval.py` of its final/ on the toy held-out set. The arms alternate so that the machine's load falls on
both. The gap's standard error is over seeds (the spread of whole runs), not over samples. Last line:
`lora toy: full <a>% LoRA r=<r> <b>% held-out avg@2: <b - a> points (SE <s>, <n> seeds)`.
"""
import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

parser = argparse.ArgumentParser(description="The toy RL with LoRA against full fine-tuning.")
parser.add_argument("--model", default="runs/toy_sft", help="the toy SFT model (python sft.py --preset toy)")
parser.add_argument("--world", default="data/toy", help="the toy world: train.jsonl and test.jsonl")
parser.add_argument("--rank", type=int, default=32, help="the LoRA arm's --lora-rank")
parser.add_argument("--steps", type=int, default=20, help="RL steps of each run (the toy preset's)")
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per arm and seed")
parser.add_argument("--out-dir", default="runs/bench_lora_toy", help="the runs and their evaluations")
parser.add_argument("--lora-args", default="",
                    help="more train.py flags for the LoRA arm, e.g. \"--lora-setting train=\" (the head frozen)")
args = parser.parse_args()

ARMS = {"full": [], "lora": ["--lora-rank", str(args.rank), *shlex.split(args.lora_args)]}


def run(cmd: list[str], log: str) -> float:
    """Run a script of the repository, its output to `log`; the wall seconds it took."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}): see {log}")
    return time.perf_counter() - t0


def one_run(arm: str, seed: int) -> dict:
    out = os.path.join(args.out_dir, f"{arm}_seed{seed}")
    os.makedirs(out, exist_ok=True)
    train_s = run(["train.py", "--preset", "toy", "--model", args.model, "--data", f"{args.world}/train.jsonl",
                   "--steps", str(args.steps), "--seed", str(seed), "--out-dir", f"{out}/rl", *ARMS[arm]],
                  f"{out}/train.log")
    run(["eval.py", "--benchmarks", f"{args.world}/test.jsonl", "--n", "2", "--max-response", "512",
         "--max-turns", "10", "--deterministic", "--model", f"{out}/rl/final", "--out-dir", f"{out}/eval"],
        f"{out}/eval.log")
    with open(f"{out}/eval/table.json") as f:
        row = json.load(f)["table"][0]
    with open(f"{out}/rl/metrics.jsonl") as f:
        train_rows = [json.loads(line) for line in f]
    with open(f"{out}/train.log") as f:
        lr = float(re.search(r"learning rate ([0-9.e+-]+)", f.read()).group(1))  # (train.py logs the peak)
    return dict(arm=arm, seed=seed, lr=lr, held_out=100 * row["avg_pass@1"],
                tool_errors=100 * row["tool_error_ratio"],
                train_acc_last5=100 * statistics.mean(r["accuracy"] for r in train_rows[-5:]),
                train_seconds=train_s)


results = []
for seed in args.seeds:
    for arm in ARMS:
        results.append(one_run(arm, seed))
        r = results[-1]
        print(f"{arm:4s} seed {seed} (lr {r['lr']:.0e}): held-out avg@2 {r['held_out']:5.1f}%  "
              f"tool errors {r['tool_errors']:4.1f}%  train acc (last 5 steps) {r['train_acc_last5']:5.1f}%  "
              f"train {r['train_seconds']:5.0f} s", flush=True)
with open(os.path.join(args.out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)

held = {arm: [r["held_out"] for r in results if r["arm"] == arm] for arm in ARMS}
mean = {arm: statistics.mean(v) for arm, v in held.items()}
n = len(args.seeds)
se = math.sqrt(sum(statistics.variance(v) / n for v in held.values())) if n > 1 else float("nan")
print(f"lora toy: full {mean['full']:.1f}% LoRA r={args.rank} {mean['lora']:.1f}% held-out avg@2: "
      f"{mean['lora'] - mean['full']:+.1f} points (SE {se:.1f}, {n} seeds)")
