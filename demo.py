"""The paper's recipe end to end on a CPU: the toy world (minutes), or a real pretrained model (--real).

    .venv/bin/python demo.py                # toy: prepare -> SFT -> eval -> GRPO-RoC -> eval, a table, a plot
    .venv/bin/python demo.py --arm uniform  # the ablation (or --no-roc): uniform down-sampling, a column more
    .venv/bin/python demo.py --real         # SmolLM2-135M-Instruct: SFT, three RL stages, the stage-3 filter

Every stage is one of the project's own scripts, run as a subprocess with its command printed, so the
demo is also the recipe: copy a printed line to rerun a stage. A stage whose output is already there
is skipped (--fresh redoes everything): the ablation reuses the first run's SFT model and evaluation;
an interrupted RL run resumes from its last checkpoint. A recipe is data: its stages in order, the
evaluations that make the table's columns, the RL runs that make the plot's curves.
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

# The toy world's RL arms: a name -> its column, output folder and train.py flags. An ablation is a line.
ARMS = {
    "roc": dict(column="RL (RoC)", out_dir="runs/toy_rl", flags=["--downsample", "roc"]),
    "uniform": dict(column="RL (no RoC)", out_dir="runs/toy_rl_noroc", flags=["--downsample", "uniform"]),
}
parser = argparse.ArgumentParser(description="The paper's recipe end to end: data, SFT, RL, evaluations.")
parser.add_argument("--real", action="store_true", help="the real model's recipe (SmolLM2-135M-Instruct)")
parser.add_argument("--arm", choices=list(ARMS), default="roc", help="the toy RL arm to run (a column each)")
parser.add_argument("--no-roc", dest="arm", action="store_const", const="uniform", help="as --arm uniform")
parser.add_argument("--steps", type=int, default=60, help="toy RL steps (about 2-3 s each on 2 cores)")
parser.add_argument("--samples", type=int, default=4, help="evaluation samples per held-out problem")
parser.add_argument("--fresh", action="store_true", help="delete earlier outputs and run every stage again")
parser.add_argument("--plot", default=None, help="where the PNG of the RL curves goes")
args = parser.parse_args()


def toy_recipe():
    """Data -> non-reasoning SFT -> eval -> GRPO-RoC (the chosen arm) -> eval, on the toy world."""
    arm = ARMS[args.arm]
    columns = {"SFT": "runs/demo/eval_sft", **{a["column"]: f"runs/demo/eval_{n}" for n, a in ARMS.items()}}
    evaluate = ["eval.py", "--benchmarks", "data/toy/test.jsonl", "--n", str(args.samples),  # (seeded turns:
                "--max-response", "512", "--max-turns", "10", "--deterministic"]    # a rerun prints the same)
    stages = [
        ("toy world: problems, SFT conversations, tokenizer, untrained model",
         "data/toy/init_model/tokenizer.json", ["data/prepare_toy.py"]),
        ("non-reasoning SFT: the tool-call format", "runs/toy_sft/model.safetensors",
         ["sft.py", "--preset", "toy"]),
        ("evaluate the SFT model on the held-out problems", columns["SFT"] + "/table.json",
         [*evaluate, "--model", "runs/toy_sft", "--out-dir", columns["SFT"]]),
        (f"GRPO-RoC, {args.steps} steps, {' '.join(arm['flags'])}", arm["out_dir"] + "/final/config.json",
         ["train.py", "--preset", "toy", "--steps", str(args.steps), "--out-dir", arm["out_dir"],
          "--resume", "1", *arm["flags"]]),
        ("evaluate the RL model on the held-out problems", columns[arm["column"]] + "/table.json",
         [*evaluate, "--model", arm["out_dir"] + "/final", "--out-dir", columns[arm["column"]]])]
    curves = [(a["column"], a["out_dir"]) for a in ARMS.values()]
    outputs = ["data/toy", "runs/toy_sft", *(a["out_dir"] for a in ARMS.values()), "runs/demo"]
    return stages, columns, curves, outputs


# The real model's recipe, scaled down from the paper's (§4): each stage is the paper's, smaller.
REAL = dict(steps=(12, 6, 6), max_response=(256, 384, 384), max_turns=(4, 4, 6), lr=5e-5,
            sft=["--max-steps", "16", "--batch-size", "16", "--lr", "1e-4", "--warmup-ratio", "0.1"])


def real_recipe():
    """SmolLM2-135M-Instruct (from the package index) -> SFT on tool conversations -> three RL stages
    (the second with a longer budget, the third with more turns on the problems the second does not
    solve 4/4, with a fresh optimizer) -> a held-out evaluation after SFT and after each stage. The
    problems are the toy world's arithmetic, half of them in words, so that reading them matters."""
    world, smol, runs = "data/real_world", "runs/real/artefacts/smollm2-135m-instruct", "runs/real"
    evaluate = ["eval.py", "--benchmarks", f"{world}/test.jsonl", "--n", str(args.samples), "--deterministic",
                "--max-response", "384", "--max-turns", "10", "--kv-cache-tokens", "32768"]
    columns = {"SFT": f"{runs}/eval_sft", **{f"stage {i}": f"{runs}/eval_stage{i}" for i in (1, 2, 3)}}
    stages = [("SmolLM2-135M-Instruct from the package index", f"{smol}/config.json",
               ["data/prepare_real.py", "--out", f"{runs}/artefacts"]),
              ("problems (half in words) and SFT conversations", f"{world}/sft.jsonl",
               ["data/prepare_toy.py", "--out", world, "--words", "0.5", "--n-train", "2000",
                "--n-test", "100", "--n-sft", "1000"]),
              ("non-reasoning SFT: the tool-call format", f"{runs}/sft/model.safetensors",
               ["sft.py", "--model", smol, "--data", f"{world}/sft.jsonl", "--out-dir", f"{runs}/sft",
                "--max-len", "1024", "--micro-batch-tokens", "4096", "--grad-checkpointing", "0",
                *REAL["sft"]]),
              ("evaluate the SFT model", columns["SFT"] + "/table.json",
               [*evaluate, "--model", f"{runs}/sft", "--out-dir", columns["SFT"]])]
    settings = zip(REAL["steps"], REAL["max_response"], REAL["max_turns"])
    for i, (steps, budget, turns) in enumerate(settings, 1):
        data = f"{world}/hard.jsonl" if i == 3 else f"{world}/train.jsonl"
        handover = [] if i == 1 else ["--init-from", f"{runs}/stage{i - 1}/checkpoints"]
        if i == 3:  # the stage-3 difficulty filter: keep the problems stage 2's policy does not solve 4/4
            stages.append(("stage-3 filter: the problems stage 2 does not solve 4/4", data,
                           ["eval.py", "--model", f"{runs}/stage2/final", "--filter-solved", "4", "--data",
                            f"{world}/train.jsonl", "--first", "96", "--out", data, "--max-turns", "4",
                            "--max-response", str(budget), "--kv-cache-tokens", "32768",
                            "--out-dir", f"{runs}/filter"]))
            handover += ["--reset-optimizer", "1"]
        stages.append((f"RL stage {i}: {steps} steps, {budget} tokens, T = {turns}",
                       f"{runs}/stage{i}/final/config.json",
                       ["train.py", "--model", f"{runs}/sft", "--data", data, "--out-dir", f"{runs}/stage{i}",
                        "--steps", str(steps), "--max-response", str(budget), "--max-turns", str(turns),
                        "--problems-per-step", "16", "--rollouts-per-problem", "8", "--group-size", "4",
                        "--max-prompt", "512", "--lr", str(REAL["lr"]),
                        "--warmup-steps", "2" if i == 1 else "0",
                        "--micro-batch-tokens", "2048", "--kv-cache-tokens", "32768", "--save-every", "0",
                        "--sample-every", "5", "--resume", "1", *handover]))
        stages.append((f"evaluate stage {i}", columns[f"stage {i}"] + "/table.json",
                       [*evaluate, "--model", f"{runs}/stage{i}/final", "--out-dir", columns[f"stage {i}"]]))
    return stages, columns, [(f"stage {i}", f"{runs}/stage{i}") for i in (1, 2, 3)], [world, runs]


stages, columns, curves, outputs = real_recipe() if args.real else toy_recipe()
plot = args.plot or ("runs/real/rl_curves.png" if args.real else "runs/demo/rl_curves.png")
if args.fresh:
    for path in outputs:
        shutil.rmtree(path, ignore_errors=True)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's chatter; the stages print their own progress
t_start, times = time.time(), []

# -----------------------------------------------------------------------------
# The stages, in order: each runs unless its output already exists; the demo stops at a failure.

for number, (title, done_file, cmd) in enumerate(stages, 1):
    title, line = f"{number}/{len(stages)} {title}", "python " + " ".join(cmd)
    if os.path.exists(done_file):
        print(f"\n=== {title}: already done ({done_file} exists), skipping: {line}", flush=True)
        continue
    print(f"\n=== {title} [{(time.time() - t_start) / 60:.1f} min]: {line}", flush=True)
    t0 = time.time()
    if subprocess.run([sys.executable, *cmd]).returncode:
        raise SystemExit(f"demo: the stage '{title}' failed (its output is above)\n"
                         f"---> HINT: fix what it reports, then rerun the demo: finished stages are skipped")
    times.append((title, (time.time() - t0) / 60))
    print(f"=== {title}: done in {times[-1][1]:.1f} min", flush=True)

# -----------------------------------------------------------------------------
# The table: every column whose evaluation exists; then the time each stage took.

tables = {}
for name, folder in columns.items():
    if os.path.exists(folder + "/table.json"):
        with open(folder + "/table.json") as f:
            tables[name] = json.load(f)["table"][0]
ROWS = [(f"accuracy (avg@{args.samples}, %)", "avg_pass@1", 100),
        (f"pass@{args.samples} (%)", f"pass@{args.samples}", 100),
        ("tool-use rate (%)", "tool_use", 100), ("tool-error ratio (%)", "tool_error_ratio", 100),
        ("mean response length (tokens)", "response_length", 1)]
first = next(iter(tables))
print(f"\nheld-out problems: {tables[first]['problems']} x {args.samples} samples, temperature 0.6\n")
print(f"{'':32}" + "".join(f"{name:>14}" for name in tables))
for label, key, scale in ROWS:
    print(f"{label:32}" + "".join(f"{scale * t.get(key, float('nan')):14.1f}" for t in tables.values()))
for name in list(tables)[1:]:
    gain = 100 * (tables[name]["avg_pass@1"] - tables[first]["avg_pass@1"])
    print(f"{name}: held-out accuracy {gain:+.1f} points over the {first} model")
for title, minutes in times:
    print(f"time: {minutes:5.1f} min  {title}")

# -----------------------------------------------------------------------------
# The RL curves: a line per RL run (the real recipe's stages one after another), a panel per metric.

PANELS = [("kept_reward", "reward of the kept rollouts"), ("accuracy", "accuracy of all rollouts"),
          ("tool_error_ratio_pos", "tool-error ratio, correct rollouts"), ("tool_use", "tool-use rate")]
fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
axes, offset, during = axes.flatten(), 0, []
for name, out_dir in curves:
    if os.path.exists(out_dir + "/metrics.jsonl"):
        with open(out_dir + "/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        for ax, (key, title) in zip(axes, PANELS):
            ax.plot([offset + r["step"] for r in rows], [r[key] for r in rows], label=name)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step")
        offset += len(rows) if args.real else 0  # (the real stages follow one another)
        during.append((f"{name} during RL", rows))
if args.real and len(during) > 1:  # the recipe as a whole: stage 1's start -> the last stage's end
    during.append(("the three stages", [r for _, rows in during for r in rows]))
for name, rows in during:
    head, tail = rows[:5], rows[-5:]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    print(f"{name} (mean of the first 5 steps -> the last 5): "
          f"accuracy {mean(head, 'accuracy'):.2f} -> {mean(tail, 'accuracy'):.2f}, "
          f"tool use {mean(head, 'tool_use'):.2f} -> {mean(tail, 'tool_use'):.2f}, "
          f"tool-error ratio of correct rollouts {mean(head, 'tool_error_ratio_pos'):.3f} -> "
          f"{mean(tail, 'tool_error_ratio_pos'):.3f}")
axes[0].legend()
fig.suptitle("SmolLM2-135M-Instruct, three RL stages" if args.real else "The toy world, per RL step",
             fontsize=11)
fig.tight_layout()
os.makedirs(os.path.dirname(plot) or ".", exist_ok=True)
fig.savefig(plot, dpi=100)
print(f"\nplot of the RL curves: {plot}\ndemo wall time: {(time.time() - t_start) / 60:.1f} min")
