"""The toy world end to end on a CPU, the way the paper runs the recipe at scale.

    .venv/bin/python demo.py              # prepare -> SFT -> eval -> GRPO-RoC -> eval, a table and a plot
    .venv/bin/python demo.py --arm uniform  # the ablation (or --no-roc): uniform down-sampling, a column more

Every stage is one of the project's own scripts, run as a subprocess with its command printed,
so the demo is also the recipe: copy a printed line to rerun a stage. A stage whose output is
already there is skipped (--fresh redoes everything), so the ablation reuses the first run's SFT
model and evaluation; an interrupted RL run resumes from its last checkpoint.
At the end: accuracy, tool use, tool errors and response length after SFT vs after RL (from each
evaluation's table.json), and a plot of the RL curves (from train.py's metrics.jsonl).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import matplotlib
matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

parser = argparse.ArgumentParser(description="The toy world end to end: data, SFT, eval, GRPO-RoC, eval.")

# The RL arms: a name -> its column, its output folder and its train.py flags. An ablation is a line here.
ARMS = {
    "roc": dict(column="RL (RoC)", out_dir="runs/toy_rl", flags=["--downsample", "roc"]),
    "uniform": dict(column="RL (no RoC)", out_dir="runs/toy_rl_noroc", flags=["--downsample", "uniform"]),
}
parser.add_argument("--arm", choices=list(ARMS), default="roc", help="the RL arm to run (each adds a column)")
parser.add_argument("--no-roc", dest="arm", action="store_const", const="uniform", help="as --arm uniform")
parser.add_argument("--steps", type=int, default=60,
                    help="RL steps (about 2-3 s each on a quiet 2-core machine)")
parser.add_argument("--samples", type=int, default=4, help="evaluation samples per held-out problem")
parser.add_argument("--fresh", action="store_true", help="delete earlier outputs and run every stage again")
parser.add_argument("--plot", default="runs/demo/rl_curves.png", help="where the PNG of the RL curves goes")
args = parser.parse_args()

COLUMNS = {"SFT": "runs/demo/eval_sft", **{a["column"]: f"runs/demo/eval_{name}" for name, a in ARMS.items()}}
arm = ARMS[args.arm]
if args.fresh:
    for path in ["data/toy", "runs/toy_sft", *(a["out_dir"] for a in ARMS.values()), "runs/demo"]:
        shutil.rmtree(path, ignore_errors=True)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's chatter; the stages print their own progress
t_start = time.time()


def stage(title: str, done_file: str, *cmd: str) -> None:
    """Run one stage's script unless its output already exists; stop the demo if it fails."""
    line = "python " + " ".join(cmd)
    if os.path.exists(done_file):
        print(f"\n=== {title}: already done ({done_file} exists), skipping: {line}", flush=True)
        return
    print(f"\n=== {title} [{(time.time() - t_start) / 60:.1f} min]: {line}", flush=True)
    t0 = time.time()
    if subprocess.run([sys.executable, *cmd]).returncode:
        raise SystemExit(f"demo: the stage '{title}' failed (its output is above)\n"
                         f"---> HINT: fix what it reports, then rerun the demo: finished stages are skipped")
    print(f"=== {title}: done in {(time.time() - t0) / 60:.1f} min", flush=True)


# -----------------------------------------------------------------------------
# The recipe: data -> non-reasoning SFT -> eval -> GRPO-RoC -> eval.

EVAL = ["--benchmarks", "data/toy/test.jsonl", "--n", str(args.samples), "--max-response", "512",
        "--max-turns", "10", "--deterministic"]  # (seeded turns: a rerun prints the same table)
stage("1/5 toy world: problems, SFT conversations, tokenizer, untrained model",
      "data/toy/init_model/tokenizer.json", "data/prepare_toy.py")
stage("2/5 non-reasoning SFT: the tool-call format", "runs/toy_sft/model.safetensors",
      "sft.py", "--preset", "toy")
stage("3/5 evaluate the SFT model on the held-out problems", COLUMNS["SFT"] + "/table.json",
      "eval.py", "--model", "runs/toy_sft", *EVAL, "--out-dir", COLUMNS["SFT"])
stage(f"4/5 GRPO-RoC, {args.steps} steps, {' '.join(arm['flags'])}",
      arm["out_dir"] + "/final/model.safetensors", "train.py", "--preset", "toy", "--steps", str(args.steps),
      "--out-dir", arm["out_dir"], "--resume", "1", *arm["flags"])
stage("5/5 evaluate the RL model on the held-out problems", COLUMNS[arm["column"]] + "/table.json",
      "eval.py", "--model", arm["out_dir"] + "/final", *EVAL, "--out-dir", COLUMNS[arm["column"]])

# -----------------------------------------------------------------------------
# The comparison table: every column whose evaluation exists (the ablation adds its own).

tables = {}
for name, folder in COLUMNS.items():
    if os.path.exists(folder + "/table.json"):
        with open(folder + "/table.json") as f:
            tables[name] = json.load(f)["table"][0]
ROWS = [("accuracy (avg pass@1, %)", "avg_pass@1", 100),
        (f"pass@{args.samples} (%)", f"pass@{args.samples}", 100),
        ("tool-use rate (%)", "tool_use", 100), ("tool-error ratio (%)", "tool_error_ratio", 100),
        ("mean response length (tokens)", "response_length", 1)]
print(f"\nheld-out toy problems: {tables['SFT']['problems']} x {args.samples} samples, temperature 0.6\n")
print(f"{'':32}" + "".join(f"{name:>14}" for name in tables))
for label, key, scale in ROWS:
    print(f"{label:32}" + "".join(f"{scale * t.get(key, float('nan')):14.1f}" for t in tables.values()))
for name in tables:
    if name != "SFT":
        gain = 100 * (tables[name]["avg_pass@1"] - tables["SFT"]["avg_pass@1"])
        print(f"{name}: held-out accuracy {gain:+.1f} points over the SFT model")

# -----------------------------------------------------------------------------
# The RL curves: one line per RL run, a panel per metric.


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl rows (one per step: a resumed run drops the rows after its checkpoint)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


PANELS = [("kept_reward", "reward of the kept rollouts"), ("accuracy", "accuracy of all rollouts"),
          ("tool_error_ratio_pos", "tool-error ratio, correct rollouts"),
          ("response_length", "response length (tokens)")]
fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
axes = axes.flatten()
for name, out_dir in [(a["column"], a["out_dir"]) for a in ARMS.values()]:
    if os.path.exists(out_dir + "/metrics.jsonl"):
        rows = read_metrics(out_dir + "/metrics.jsonl")
        for ax, (key, title) in zip(axes, PANELS):
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=name)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step")
        first, last = rows[:5], rows[-5:]
        mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)
        print(f"{name} during RL (mean of the first 5 steps -> the last 5): "
              f"accuracy {mean(first, 'accuracy'):.2f} -> {mean(last, 'accuracy'):.2f}, "
              f"tool use {mean(first, 'tool_use'):.2f} -> {mean(last, 'tool_use'):.2f}, "
              f"tool-error ratio of correct rollouts {mean(first, 'tool_error_ratio_pos'):.3f} -> "
              f"{mean(last, 'tool_error_ratio_pos'):.3f}")
axes[0].legend()
fig.suptitle("The toy world, per RL step (train.py --preset toy)", fontsize=11)
fig.tight_layout()
os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
fig.savefig(args.plot, dpi=100)
print(f"\nplot of the RL curves: {args.plot}\ndemo wall time: {(time.time() - t_start) / 60:.1f} min")
