"""The words recipe's SFT levers, one moved at a time, measured on training problems no SFT arm sees.

    .venv/bin/python data/prepare_real.py --out runs/real/artefacts   # SmolLM2-135M-Instruct, once
    .venv/bin/python bench/words_sft.py                                # every arm (about 20 min each)
    .venv/bin/python bench/words_sft.py --arms "errors 10%,two ops half"   # some, in this order

Each arm builds its SFT set with data/prepare_mawps.py (the same seed, so the same split: only the
conversations change), runs sft.py as demo.py --real does (batch 16, lr 2e-4, 10% warm-up), and
evaluates the SFT model as demo.py evaluates (2 samples, temperature 0.6, 384 tokens, T = 6) on the
last 300 problems of data/mawps/train.jsonl in train.py's data order (seed 0, first epoch): RL
problems, never SFT ones, and the last an RL run reaches. So the SFT recipe is chosen without the
held-out problems. The table gives each arm's accuracy on problems of one operation and of two or
more apart, its failing calls and lengths, and its paired gain over the first arm listed.
A finished arm is skipped.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
from batch import ProblemStream  # noqa: E402  (the order train.py draws problems in)
import report  # noqa: E402

OUT, SMOL = "runs/words_sft", "runs/real/artefacts/smollm2-135m-instruct"
MAWPS = "../shared/data/mawps_asdiv/train.csv"
SFT = ["--batch-size", "16", "--warmup-ratio", "0.1", "--grad-checkpointing", "0", "--lr", "2e-4",
       "--max-len", "1280", "--micro-batch-tokens", "4096"]
# An arm: its data/prepare_mawps.py flags and its sft.py flags (a later flag wins over SFT's).
ARMS = {
    "named 24": (["--style", "named"], ["--max-steps", "24"]),
    "errors 25%": (["--error-share", "0.25"], ["--max-steps", "24"]),
    "errors 10%": (["--error-share", "0.1"], ["--max-steps", "24"]),
    "errors 0%": (["--error-share", "0"], ["--max-steps", "24"]),
    "two ops half": (["--error-share", "0.1", "--multi-share", "0.5"], ["--max-steps", "24"]),
    "48 steps": (["--error-share", "0.1"], ["--max-steps", "48"]),
    "lr 4e-4": (["--error-share", "0.1"], ["--max-steps", "24", "--lr", "4e-4"]),
    "epoch": (["--error-share", "0.1"], ["--max-steps", "75"]),
}
parser = argparse.ArgumentParser(description="The words recipe's SFT levers on training problems.")
parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms, in the order to run")
args = parser.parse_args()
arms = [a.strip() for a in args.arms.split(",")]
if unknown := [a for a in arms if a not in ARMS]:
    sys.exit(f"words_sft: no arm {unknown}\n---> HINT: the arms are {', '.join(ARMS)}")


def run(cmd: list, done_file: str) -> float:
    """One stage as a subprocess, as a user runs it; skipped when its output is there. Minutes taken."""
    line = "python " + " ".join(cmd)
    if os.path.exists(done_file):
        print(f"=== already done ({done_file}): {line}", flush=True)
        return float("nan")
    print(f"\n=== {line}", flush=True)
    t0 = time.time()
    if subprocess.run([sys.executable, *cmd]).returncode:
        raise SystemExit(f"words_sft: this stage failed: {line}\n"
                         f"---> HINT: fix what it reports and rerun: finished arms are skipped")
    print(f"=== done in {(time.time() - t0) / 60:.1f} min", flush=True)
    return (time.time() - t0) / 60


os.makedirs(OUT, exist_ok=True)
run(["data/prepare_mawps.py", "--csv", MAWPS, "--out", "data/mawps"], "data/mawps/train.jsonl")
slice_file = f"{OUT}/train_last300.jsonl"
with open("data/mawps/train.jsonl") as f:
    problems = [json.loads(line) for line in f]
with open(slice_file, "w") as f:
    last300 = ProblemStream(problems, seed=0).take(len(problems) - 300, 300)
    f.writelines(json.dumps(p) + "\n" for p in last300)

columns = {}
for arm in arms:
    prepare, sft = ARMS[arm]
    name = arm.replace(" ", "_").replace("%", "")
    data, model, columns[arm] = f"{OUT}/{name}/data", f"{OUT}/{name}/sft", f"{OUT}/{name}/eval"
    run(["data/prepare_mawps.py", "--csv", MAWPS, "--out", data, *prepare], f"{data}/sft.jsonl")
    run(["sft.py", "--model", SMOL, "--data", f"{data}/sft.jsonl", "--out-dir", model, *SFT, *sft],
        f"{model}/model.safetensors")
    run(["eval.py", "--model", model, "--out-dir", columns[arm], "--benchmarks", slice_file, "--n", "2",
         "--max-response", "384", "--kv-cache-tokens", "65536", "--max-turns", "6"],
        f"{columns[arm]}/table.json")

report.print_table(columns, 2)
print(f"\n{'arm':14} {'SFT min':>8} {'s/step':>7} {'avg@2':>6} {'1 op':>6} {'2+ ops':>7} {'failing':>8} "
      f"{'cut off':>8} {'tokens':>7}")
for arm, folder in columns.items():
    if not os.path.exists(f"{folder}/table.json"):
        continue
    with open(f"{folder}/table.json") as f:
        table = json.load(f)["table"][0]
    with open(f"{os.path.dirname(folder)}/sft/metrics.jsonl") as f:
        seconds = [json.loads(line)["seconds"] for line in f]
    with open(f"{folder}/samples.jsonl") as f:
        cut = statistics.mean(s["finish_reason"] == "length" for s in map(json.loads, f))
    ops = report.accuracy_by_operations(folder, slice_file)
    print(f"{arm:14} {sum(seconds) / 60:8.1f} {statistics.mean(seconds):7.1f} "
          f"{100 * table['avg_pass@1']:6.1f} {100 * ops[1]:6.1f} {100 * ops[2]:7.1f} "
          f"{100 * table['tool_error_ratio']:8.1f} {100 * cut:8.1f} {table['response_length']:7.0f}")
