"""The words recipe's levers, one moved at a time, measured on training problems that no arm trains on.

    .venv/bin/python demo.py --real            # first: the SFT model and stage 1 this bench starts from
    .venv/bin/python bench/words_levers.py     # then the arms (2.5 hours on 2 cores), and a table

Each RL arm is stage 1 of the words recipe (demo.py: 6 steps from the SFT model, 320 tokens, T = 3,
lr 5e-5, 8 problems a step, 8 rollouts a problem down-sampled to 4 by RoC, dynamic sampling with up to
4 draws) with one lever moved: dynamic sampling off, and from that arm 16 problems a step or 16
rollouts a problem (kept 8, RoC's ratio of 2). The SFT arm is demo.py's SFT with twice the steps,
and the last arm is stage 1 from it; demo.py's stages 2 and 3 are columns too.

Every model is evaluated as demo.py evaluates (2 samples, temperature 0.6, 384 tokens, T = 6) on 150
problems of data/mawps/train.jsonl that no RL arm draws: positions 600-749 of the data order's first
epoch (train.py's seed 0; an arm draws from position 0 and takes at most 192 problems, and stage 2
goes on from stage 1's position). Stage 3's problems come from the file's first 48 lines (the
stage-3 filter), so a few of them may be among the 150. So the levers are chosen without the
held-out problems. Arms run in the order listed, a finished one is skipped, and the table gives each
arm's gain over the SFT model with its paired standard error.
"""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
from batch import ProblemStream  # noqa: E402  (the order train.py draws problems in)
import report  # noqa: E402

RUNS, OUT, DATA = "runs/real_words", "runs/words_levers", "data/mawps/train.jsonl"
KV = ["--kv-cache-tokens", "65536"]
SFT = ["sft.py", "--model", "runs/real/artefacts/smollm2-135m-instruct", "--data", "data/mawps/sft.jsonl",
       "--batch-size", "16", "--warmup-ratio", "0.1", "--grad-checkpointing", "0", "--lr", "2e-4",
       "--max-len", "1280", "--micro-batch-tokens", "4096"]


def stage1(out_dir: str, problems=8, rollouts=8, group=4, model=f"{RUNS}/sft", dynamic=False) -> list:
    """demo.py's words stage 1 with the given problems, rollouts, starting model and dynamic sampling."""
    return ["train.py", "--model", model, "--data", DATA, "--out-dir", out_dir, "--steps", "6",
            "--max-response", "320", "--max-turns", "3", "--problems-per-step", str(problems),
            "--rollouts-per-problem", str(rollouts), "--group-size", str(group), "--max-prompt", "768",
            "--lr", "5e-5", "--warmup-steps", "2", "--micro-batch-tokens", "2048", *KV, "--save-every", "0",
            "--sample-every", "5", "--resume", "1", *(["--dynamic-sampling", "--max-draws", "4"] * dynamic)]


# A column -> the model it evaluates and the command that makes it (None: demo.py --real makes it).
ARMS = {
    "SFT 24": (f"{RUNS}/sft", None),
    "stage 1": (f"{RUNS}/stage1/final", None),
    "stage 2": (f"{RUNS}/stage2/final", None),
    "stage 3": (f"{RUNS}/stage3/final", None),
    "no dyn. samp.": (f"{OUT}/no_dynamic/final", stage1(f"{OUT}/no_dynamic")),
    "16 problems": (f"{OUT}/problems16/final", stage1(f"{OUT}/problems16", problems=16)),
    "SFT 48": (f"{OUT}/sft48", [*SFT, "--max-steps", "48", "--out-dir", f"{OUT}/sft48"]),
    "16 rollouts": (f"{OUT}/rollouts16/final", stage1(f"{OUT}/rollouts16", rollouts=16, group=8)),
    "SFT 48 + st. 1": (f"{OUT}/sft48_stage1/final",
                       stage1(f"{OUT}/sft48_stage1", model=f"{OUT}/sft48", dynamic=True)),
}

os.makedirs(OUT, exist_ok=True)
slice_file = f"{OUT}/train_600_750.jsonl"
with open(DATA) as f:
    problems = [json.loads(line) for line in f]
with open(slice_file, "w") as f:
    f.writelines(json.dumps(p) + "\n" for p in ProblemStream(problems, seed=0).take(600, 150))


def run(cmd: list, done_file: str):
    """One stage as a subprocess, as a user runs it; skipped when its output is there."""
    line = "python " + " ".join(cmd)
    if os.path.exists(done_file):
        print(f"=== already done ({done_file}): {line}", flush=True)
        return
    print(f"\n=== {line}", flush=True)
    t0 = time.time()
    if subprocess.run([sys.executable, *cmd]).returncode:
        raise SystemExit(f"words_levers: this stage failed: {line}\n"
                         f"---> HINT: fix what it reports and rerun: finished arms are skipped")
    print(f"=== done in {(time.time() - t0) / 60:.1f} min", flush=True)


columns = {}
for column, (model, make) in ARMS.items():
    name = model.split("/")[-2 if model.endswith("final") else -1]
    columns[column] = f"{OUT}/eval_{name}"
    if make:
        run(make, f"{model}/config.json")
    elif not os.path.exists(f"{model}/config.json"):
        raise SystemExit(f"words_levers: {model} is missing\n"
                         f"---> HINT: run `.venv/bin/python demo.py --real` first: this bench starts from it")
    run(["eval.py", "--model", model, "--out-dir", columns[column], "--benchmarks", slice_file, "--n", "2",
         "--max-response", "384", *KV, "--max-turns", "6"], f"{columns[column]}/table.json")
report.print_table(columns, 2)
gain, se, n = report.paired_gain(columns["SFT 48"], columns["SFT 48 + st. 1"])
print(f"SFT 48 + st. 1: {100 * gain:+.1f} points over the 48-step SFT model (paired standard error "
      f"{100 * se:.1f} over {n} problems)")
