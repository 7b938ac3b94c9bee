"""SFT's resident memory on a CPU, step by step: does it keep growing?

    python bench/sft_memory.py --model runs/real/artefacts/smollm2-135m-instruct --data data/mawps/sft.jsonl

Runs sft.py twice with the same flags (a subprocess each, as users run it) and reads the resident
memory that it logs after every step (metrics.jsonl, `resident_gib`):
1. glibc's own allocator (`--mmap-threshold 0`): it keeps the pages of freed tensors mapped for
   reuse, so the resident memory after a step is about the largest peak a step has reached so far,
   and it climbs with every longer batch;
2. sft.py as it is: every allocation over 128 KiB gets its own mapping, returned to the system when
   it is freed (sft.return_freed_pages), so what stays resident between steps is what the run really
   holds (the weights, the gradients, AdamW's moments, the data).
If the second run's memory is low and flat, nothing leaks. The last lines are the ratio of the two
runs' resident memory at their last step and of their wall times (the cost of the fresh mappings).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = argparse.ArgumentParser(description="SFT's resident memory per step, with and without the allocator's "
                                             "cache of freed pages.")
parser.add_argument("--model", required=True, help="the model sft.py trains")
parser.add_argument("--data", required=True, help="its SFT conversations (JSONL)")
parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
parser.add_argument("--sft-args", default="--batch-size 16 --micro-batch-tokens 4096 --max-len 1280 "
                                          "--grad-checkpointing 0 --lr 2e-4",
                    help="sft.py's other flags (the words recipe's by default)")
args = parser.parse_args()
seconds = []  # each run's wall time


def resident(flags: list) -> list[float]:
    """One sft.py run: the resident memory (GiB) after each step; its wall time goes in `seconds`."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "sft.py", "--model", args.model, "--data", args.data, "--out-dir", out,
               "--max-steps", str(args.steps), *args.sft_args.split(), *flags]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds.append(time.time() - start)
        if proc.returncode:
            sys.exit(f"sft.py failed:\n{proc.stderr[-3000:]}\n---> HINT: run the command above by hand: {cmd}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["resident_gib"] for line in f]


runs = {"glibc's allocator": resident(["--mmap-threshold", "0"]), "sft.py as it is": resident([])}
print(f"{'step':>6}" + "".join(f"{name:>24}" for name in runs))
for step in range(args.steps):
    if step < 5 or (step + 1) % 5 == 0:
        print(f"{step + 1:6d}" + "".join(f"{rss[step]:24.2f}" for rss in runs.values()))
for name, rss in runs.items():
    later = rss[len(rss) // 4:]  # after the first quarter of the steps
    print(f"{name}: {rss[0]:.2f} GiB after step 1, {max(rss):.2f} at most, "
          f"{later[0]:.2f} -> {later[-1]:.2f} over steps {len(rss) - len(later) + 1}-{len(rss)}")
kept, returned = (rss[-1] for rss in runs.values())
print(f"resident memory at the last step, glibc's / sft.py's: {kept / returned:.2f}x")
print(f"wall time, sft.py's / glibc's: {seconds[1] / seconds[0]:.2f}x "
      f"({seconds[1]:.0f} s / {seconds[0]:.0f} s)")
