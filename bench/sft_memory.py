"""SFT's resident memory on a CPU, step by step: does it keep growing?

    python bench/sft_memory.py --model runs/real/artefacts/smollm2-135m-instruct --data data/mawps/sft.jsonl

Runs sft.py three times with the same flags (a subprocess each, as users run it) and reads the
resident memory that it logs after every step (metrics.jsonl, `resident_gib`):
1. glibc as it is (`--trim-memory 0`): it keeps the pages of freed tensors for reuse, so the
   resident memory after a step is about the largest peak a step has reached so far, and it climbs
   with every longer batch;
2. with MALLOC_MMAP_THRESHOLD_=131072 (and `--trim-memory 0`): every allocation over 128 KiB gets a
   mapping of its own, unmapped when it is freed;
3. sft.py as it is: glibc's reuse within a step, and the freed pages handed back after each step
   (sft.return_freed_pages), so what stays resident between steps is what the run really holds
   (the weights, the gradients, AdamW's moments, the data).
If the last two runs' memory is low and flat, nothing leaks. The last lines are the ratios of the
runs' resident memory at their last step and of their wall times (what handing pages back costs).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = argparse.ArgumentParser(description="SFT's resident memory per step: glibc as it is, "
                                             "an mmap threshold, and sft.py's trim after each step.")
parser.add_argument("--model", required=True, help="the model sft.py trains")
parser.add_argument("--data", required=True, help="its SFT conversations (JSONL)")
parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
parser.add_argument("--sft-args", default="--batch-size 16 --micro-batch-tokens 4096 --max-len 1280 "
                                          "--grad-checkpointing 0 --lr 2e-4",
                    help="sft.py's other flags (the words recipe's by default)")
args = parser.parse_args()
seconds = []  # each run's wall time


def resident(flags: list, env: dict | None = None) -> list[float]:
    """One sft.py run: the resident memory (GiB) after each step; its wall time goes in `seconds`."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "sft.py", "--model", args.model, "--data", args.data, "--out-dir", out,
               "--max-steps", str(args.steps), *args.sft_args.split(), *flags]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                              text=True)
        seconds.append(time.time() - start)
        if proc.returncode:
            sys.exit(f"sft.py failed:\n{proc.stderr[-3000:]}\n---> HINT: run the command above by hand: {cmd}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["resident_gib"] for line in f]


runs = {"glibc as it is": resident(["--trim-memory", "0"]),
        "mmap threshold": resident(["--trim-memory", "0"], {"MALLOC_MMAP_THRESHOLD_": "131072"}),
        "sft.py as it is": resident([])}
print(f"{'step':>6}" + "".join(f"{name:>24}" for name in runs))
for step in range(args.steps):
    if step < 5 or (step + 1) % 5 == 0:
        print(f"{step + 1:6d}" + "".join(f"{rss[step]:24.2f}" for rss in runs.values()))
for name, rss in runs.items():
    later = rss[len(rss) // 4:]  # after the first quarter of the steps
    print(f"{name}: {rss[0]:.2f} GiB after step 1, {max(rss):.2f} at most, "
          f"{later[0]:.2f} -> {later[-1]:.2f} over steps {len(rss) - len(later) + 1}-{len(rss)}")
glibc = runs["glibc as it is"][-1]
for (name, rss), took in list(zip(runs.items(), seconds))[1:]:
    print(f"{name}: resident memory at the last step {glibc / rss[-1]:.2f}x lower than glibc's as it is, "
          f"wall time {took / seconds[0]:.2f}x its ({took:.0f} s / {seconds[0]:.0f} s)")
