"""SFT's resident memory on a CPU, step by step: does it keep growing?

    python bench/sft_memory.py --model runs/real/artefacts/smollm2-135m-instruct --data data/mawps/sft.jsonl

Runs sft.py twice with the same flags (a subprocess each, as users run it) and reads the resident
memory that it logs after every step (metrics.jsonl, `resident_gib`):
1. as it is: glibc keeps the pages of freed tensors mapped for reuse, so the resident memory after a
   step is about the largest peak a step has reached so far;
2. with MALLOC_MMAP_THRESHOLD_ set low: every large tensor gets its own mapping, returned to the system
   when it is freed, so what stays resident between steps is what the run really holds (the weights,
   the gradients, AdamW's moments, the data).
If the first run's memory is flat after its first steps while the second's is low and flat, nothing
leaks: the growth seen early is the allocator keeping the peak of the longest batch met so far. The
last line is the ratio of the two runs' resident memory at their last step.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

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


def resident(env_extra: dict) -> list[float]:
    """One sft.py run: the resident memory (GiB) after each step."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "sft.py", "--model", args.model, "--data", args.data, "--out-dir", out,
               "--max-steps", str(args.steps), *args.sft_args.split()]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env_extra}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"sft.py failed:\n{proc.stderr[-3000:]}\n---> HINT: run the command above by hand: {cmd}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["resident_gib"] for line in f]


runs = {"as it is": resident({}), "freed pages returned": resident({"MALLOC_MMAP_THRESHOLD_": "131072"})}
print(f"{'step':>6}" + "".join(f"{name:>24}" for name in runs))
for step in range(args.steps):
    if step < 5 or (step + 1) % 5 == 0:
        print(f"{step + 1:6d}" + "".join(f"{rss[step]:24.2f}" for rss in runs.values()))
for name, rss in runs.items():
    later = rss[len(rss) // 4:]  # after the first quarter of the steps
    print(f"{name}: {rss[0]:.2f} GiB after step 1, {max(rss):.2f} at most, "
          f"{later[0]:.2f} -> {later[-1]:.2f} over steps {len(rss) - len(later) + 1}-{len(rss)}")
kept, returned = (rss[-1] for rss in runs.values())
print(f"resident memory at the last step, as it is / with freed pages returned: {kept / returned:.2f}x")
