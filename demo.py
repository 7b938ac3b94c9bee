"""The paper's recipe end to end on a CPU: the toy world (minutes), or a real pretrained model (--real).

    .venv/bin/python demo.py                # toy: prepare -> SFT -> eval -> GRPO-RoC -> eval, a table, a plot
    .venv/bin/python demo.py --arm uniform  # the ablation (or --no-roc): uniform down-sampling, a column more
    .venv/bin/python demo.py --real         # SmolLM2-135M-Instruct on MAWPS + ASDiv-A: SFT, RL
    .venv/bin/python demo.py --real gsm8k   # the same recipe on GSM8K's word problems (a GPU's set)
    .venv/bin/python demo.py --real arithmetic  # the toy world's arithmetic, half of it in words

Every stage is one of the project's own scripts, run as a subprocess with its command printed, so the
demo is also the recipe: copy a printed line to rerun a stage. A stage whose output is already there
is skipped (--fresh redoes everything): the ablation reuses the first run's SFT model and evaluation;
an interrupted RL run resumes from its last checkpoint. A recipe is data: its stages in order, the
evaluations that make the table's columns, the RL runs that make the plot's curves.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import report

# The toy world's RL arms: a name -> its column, output folder and train.py flags. An ablation is a line.
ARMS = {
    "roc": dict(column="RL (RoC)", out_dir="runs/toy_rl", flags=["--downsample", "roc"]),
    "uniform": dict(column="RL (no RoC)", out_dir="runs/toy_rl_noroc", flags=["--downsample", "uniform"]),
}
GSM8K = "../shared/data/gsm8k/train.jsonl"  # a local copy of openai/gsm8k's train split (else the hub)
LOCAL = os.path.exists(GSM8K)
MAWPS = "../shared/data/mawps_asdiv/train.csv"  # the SVAMP authors' MAWPS + ASDiv-A training file
parser = argparse.ArgumentParser(description="The paper's recipe end to end: data, SFT, RL, evaluations.")
parser.add_argument("--real", nargs="?", const="words", choices=["words", "gsm8k", "arithmetic"],
                    help="a real recipe on SmolLM2-135M-Instruct: words (MAWPS + ASDiv-A, the default), "
                         "gsm8k or arithmetic")
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
          *arm["flags"]]),
        ("evaluate the RL model on the held-out problems", columns[arm["column"]] + "/table.json",
         [*evaluate, "--model", arm["out_dir"] + "/final", "--out-dir", columns[arm["column"]]])]
    curves = [(a["column"], a["out_dir"]) for a in ARMS.values()]
    outputs = ["data/toy", "runs/toy_sft", *(a["out_dir"] for a in ARMS.values()), "runs/demo"]
    return stages, columns, curves, outputs


# The real model's recipes, scaled down from the paper's (§4): each stage is the paper's, smaller. A recipe
# is its world (data script, folder), where its runs go, each RL stage's problems, steps, budget and turns,
# the RL learning rate, problems per step and further flags, the held-out problems evaluated (None: all;
# `between`: fewer for the evaluations between stages), SFT's flags, and a benchmark the final model is
# also evaluated on (its folder, how it is made, how many of its problems).
REAL = {
    "words": dict(  # elementary word problems people wrote: a 135M model solves a share of them after SFT
        world="data/mawps", runs="runs/real_words", held_out=None, between=50, kv_cache_tokens=65536,
        prepare=["data/prepare_mawps.py", "--csv", MAWPS, "--out", "data/mawps"],
        data=("train", "train", "hard"), steps=(14, 6, 5), max_response=(320, 384, 384), max_turns=(3, 4, 6),
        # RL at 1e-5, one stage: on training problems +3.8 points (SE 1.9) in 12 steps where 5e-5 lost 5.8,
        # and +3.5, +3.2, +1.8 after stages 1, 2, 3 (docs/words.md); stages=3 runs the paper's three
        stages=1, lr=1e-5, problems=8, rl=["--dynamic-sampling", "2"], filter_min_solved=1,
        eval_flags=["--max-turns", "6"],  # one engine seed (per-turn seeds sample a request at a time)
        # a whole epoch (75 steps of 16): +7.5 points over 48 steps on training problems, two-operation
        # ones +15.3; 48 had given +15.2 over 24 (docs/words.md, "The SFT levers")
        sft=["--max-steps", "75", "--lr", "2e-4", "--max-len", "1280", "--micro-batch-tokens", "4096"],
        transfer=("data/gsm8k", ["data/prepare_gsm8k.py", "--out", "data/gsm8k",
                                 *(["--local", f"gsm8k={GSM8K}"] * LOCAL)], 100)),
    "arithmetic": dict(  # the toy world's problems, half of them in words ("A tank holds 7890 litres...")
        world="data/real_world", runs="runs/real", held_out=None, kv_cache_tokens=32768,
        prepare=["data/prepare_toy.py", "--out", "data/real_world", "--words", "0.5", "--n-train", "2000",
                 "--n-test", "100", "--n-sft", "1000"], data=("train", "train", "hard"),
        steps=(12, 6, 6), max_response=(256, 384, 384), max_turns=(4, 4, 6), lr=5e-5, problems=16,
        sft=["--max-steps", "16", "--lr", "1e-4", "--max-len", "1024", "--micro-batch-tokens", "4096"]),
    "gsm8k": dict(  # word problems people wrote; the SFT data is their worked solutions as tool calls
        world="data/gsm8k", runs="runs/real_gsm8k", held_out=100, kv_cache_tokens=131072,
        prepare=["data/prepare_gsm8k.py", "--out", "data/gsm8k", *(["--local", f"gsm8k={GSM8K}"] * LOCAL)],
        data=("easy", "train", "hard"),  # stage 1 on the problems of at most 2 steps: some groups are right
        steps=(6, 3, 3), max_response=(384, 512, 512), max_turns=(4, 4, 6), lr=5e-5, problems=8,
        sft=["--max-steps", "20", "--lr", "2e-4", "--max-len", "1280", "--micro-batch-tokens", "2048"]),
}

TRANSFER = {"SFT": "{runs}/eval_transfer_sft", "final": "{runs}/eval_transfer"}  # a table of their own


def real_recipe():
    """SmolLM2-135M-Instruct (from the package index) -> SFT on tool conversations -> the RL stages (the
    paper's three: the second with a longer budget, the third with more turns on the problems the second
    does not solve 4/4, with a fresh optimizer) -> a held-out evaluation after SFT and after each stage."""
    recipe = REAL[args.real]
    world, runs, smol = recipe["world"], recipe["runs"], "runs/real/artefacts/smollm2-135m-instruct"
    kv = ["--kv-cache-tokens", str(recipe["kv_cache_tokens"])]

    def evaluate(model, out_dir, first=recipe["held_out"], benchmark=f"{world}/test.jsonl"):
        return ["eval.py", "--model", model, "--out-dir", out_dir, "--benchmarks", benchmark,
                *(["--first", str(first)] if first else []), "--n", str(args.samples),
                "--max-response", str(recipe["max_response"][-1]), *kv,
                *recipe.get("eval_flags", ["--max-turns", "10", "--deterministic"])]
    last = recipe.get("stages", len(recipe["steps"]))  # the RL stages run: the paper's three, or the first
    columns = {"SFT": f"{runs}/eval_sft"} | {f"stage {i}": f"{runs}/eval_stage{i}" for i in range(1, last + 1)}
    stages = [("SmolLM2-135M-Instruct from the package index", f"{smol}/config.json",
               ["data/prepare_real.py", "--out", "runs/real/artefacts"]),
              (f"{args.real}: RL, held-out and SFT problems", f"{world}/sft.jsonl", recipe["prepare"]),
              ("SFT: the tool-call format", f"{runs}/sft/model.safetensors",
               ["sft.py", "--model", smol, "--data", f"{world}/sft.jsonl", "--out-dir", f"{runs}/sft",
                "--batch-size", "16", "--warmup-ratio", "0.1", "--grad-checkpointing", "0", *recipe["sft"]]),
              ("evaluate the SFT model", columns["SFT"] + "/table.json",
               evaluate(f"{runs}/sft", columns["SFT"]))]
    settings = list(zip(recipe["data"], recipe["steps"], recipe["max_response"], recipe["max_turns"]))[:last]
    for i, (name, steps, budget, turns) in enumerate(settings, 1):
        data = f"{world}/{name}.jsonl"
        handover = [] if i == 1 else ["--init-from", f"{runs}/stage{i - 1}/checkpoints"]
        if i == 3:  # the stage-3 difficulty filter: keep the problems stage 2's policy does not solve 4/4
            band = ["--min-solved", str(recipe["filter_min_solved"])] if recipe.get("filter_min_solved") else []
            stages.append(("stage-3 filter: the problems stage 2 does not solve 4/4", data,
                           ["eval.py", "--model", f"{runs}/stage2/final", "--filter-solved", "4", *band,
                            "--data", f"{world}/train.jsonl", "--first", str(6 * recipe["problems"]),
                            "--out", data, "--max-turns", "4", "--max-response", str(budget), *kv,
                            "--out-dir", f"{runs}/filter"]))
            handover += ["--reset-optimizer", "1"]
        stages.append((f"RL stage {i}: {steps} steps, {budget} tokens, T = {turns}, {name} problems",
                       f"{runs}/stage{i}/final/config.json",
                       ["train.py", "--model", f"{runs}/sft", "--data", data, "--out-dir", f"{runs}/stage{i}",
                        "--steps", str(steps), "--max-response", str(budget), "--max-turns", str(turns),
                        "--problems-per-step", str(recipe["problems"]), "--rollouts-per-problem", "8",
                        "--group-size", "4", "--max-prompt", "768", "--lr", str(recipe["lr"]),
                        "--warmup-steps", "2" if i == 1 else "0", "--micro-batch-tokens", "2048", *kv,
                        "--save-every", "0", *handover,
                        *recipe.get("rl", [])]))
        first = recipe.get("between", recipe["held_out"]) if i < last else recipe["held_out"]
        stages.append((f"evaluate stage {i}", columns[f"stage {i}"] + "/table.json",
                       evaluate(f"{runs}/stage{i}/final", columns[f"stage {i}"], first)))
    if recipe.get("transfer"):  # the SFT and final models on another benchmark's held-out problems
        folder, prepare, first = recipe["transfer"]
        stages.append((f"{folder}: its held-out problems", f"{folder}/test.jsonl", prepare))
        for name, model in (("SFT", f"{runs}/sft"), ("final", f"{runs}/stage{last}/final")):
            out = TRANSFER[name].format(runs=runs)
            stages.append((f"evaluate {name} on {folder}/test.jsonl (transfer)", out + "/table.json",
                           evaluate(model, out, first, f"{folder}/test.jsonl")))
    return stages, columns, [(f"stage {i}", f"{runs}/stage{i}") for i in range(1, last + 1)], [world, runs]


stages, columns, curves, outputs = real_recipe() if args.real else toy_recipe()
plot = args.plot or (REAL[args.real]["runs"] + "/rl_curves.png" if args.real else "runs/demo/rl_curves.png")
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
# What the stages made (report.py): the table, each gain with its paired standard error, the stage times,
# the RL curves (the real recipe's stages one after another).

report.print_table(columns, args.samples, f"{REAL[args.real]['world']}/test.jsonl" if args.real else None)
if args.real and REAL[args.real].get("transfer"):
    print(f"\ntransfer: {REAL[args.real]['transfer'][0]}")
    report.print_table({name: out.format(runs=REAL[args.real]["runs"]) for name, out in TRANSFER.items()},
                       args.samples)
for title, minutes in times:
    print(f"time: {minutes:5.1f} min  {title}")
report.plot_curves(curves, plot, "SmolLM2-135M-Instruct, the RL stages" if args.real else
                   "The toy world, per RL step", one_after_another=bool(args.real))
print(f"\nplot of the RL curves: {plot}\ndemo wall time: {(time.time() - t_start) / 60:.1f} min")
