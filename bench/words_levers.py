"""The words recipe's levers, one moved at a time, measured on training problems no arm trains on.

    .venv/bin/python data/prepare_real.py --out runs/real/artefacts   # SmolLM2-135M-Instruct, once
    .venv/bin/python bench/words_levers.py --arms sft   # the SFT arms (21 min each at 24 steps, here)
    .venv/bin/python bench/words_levers.py --arms rl    # the RL arms, from --rl-from's SFT model
    .venv/bin/python bench/words_levers.py --arms "stepwise,RL T 0.7"   # some, in this order
    .venv/bin/python bench/words_levers.py --recipe runs/real_words   # demo.py --real's models, the same 300

An SFT arm builds its SFT set with data/prepare_mawps.py (the same seed, so the same split: only the
conversations change; the arms of the other SFT styles are in git history at ca5a665) and runs sft.py as
demo.py --real does (batch 16, lr 2e-4, 10% warm-up). An RL arm runs train.py's stage 1 from one SFT arm's
model (--rl-from; from another arm than stepwise, in a folder of its own) with one setting moved from the
base (8 problems x 8 rollouts kept 4 by RoC, temperature 1.0, lr 5e-5, 320 tokens, T = 3, dynamic sampling
with 2 draws, 12 steps). Every model is evaluated as demo.py evaluates (temperature 0.6, 384 tokens,
T = 6), with 2 samples, on the last 300 problems of data/mawps/train.jsonl in train.py's data order (seed
0, first epoch): RL problems, never SFT ones, and not drawn by an RL run of fewer than 850 problems. So
the recipe is chosen without the held-out problems. The table gives each arm's accuracy on problems of one
operation and of two or more apart, its failing calls and lengths, how often the sums its reasoning writes
are right, and (report.py's table) its paired gain over the first arm listed. An RL arm's earlier exports
(--export-every, as "RL 24 steps" has) are evaluated too, a column each ("RL 24 steps @12"), and so are
the SFT model and each RL stage's final model of a recipe demo.py --real ran (--recipe): what its stages
bought on problems none of them drew (its RL and its stage-3 filter read from the top of the order). A
finished arm is skipped.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
from infra.batch import ProblemStream  # noqa: E402  (the order train.py draws problems in)
import report  # noqa: E402

OUT, SMOL = "runs/words_levers", "runs/real/artefacts/smollm2-135m-instruct"
MAWPS = "../shared/data/mawps_asdiv/train.csv"
SFT = ["--batch-size", "16", "--warmup-ratio", "0.1", "--grad-checkpointing", "0", "--lr", "2e-4",
       "--max-len", "1280", "--micro-batch-tokens", "4096"]
RL = ["--steps", "12", "--max-response", "320", "--max-turns", "3", "--problems-per-step", "8",
      "--rollouts-per-problem", "8", "--group-size", "4", "--max-prompt", "768", "--lr", "5e-5",
      "--warmup-steps", "2", "--temperature", "1.0", "--dynamic-sampling", "2",
      "--micro-batch-tokens", "2048", "--kv-cache-tokens", "65536", "--save-every", "0"]
# An SFT arm: its data/prepare_mawps.py flags and its sft.py flags (a later flag wins over SFT's).
SFT_ARMS = {
    "stepwise": (["--error-share", "0.1"], ["--max-steps", "24"]),
    "errors 0%": (["--error-share", "0"], ["--max-steps", "24"]),
    "48 steps": (["--error-share", "0.1"], ["--max-steps", "48"]),
    # twice the learning rate at 48 steps: compare with "48 steps"
    "lr 4e-4": (["--error-share", "0.1"], ["--max-steps", "48", "--lr", "4e-4"]),
    # a whole epoch (1,194 conversations in steps of 16): the recipe's SFT since it gained on "48 steps"
    "epoch": (["--error-share", "0.1"], ["--max-steps", "75"]),
    # the problem's numbers listed at the end of the question: a cue the policy reads but cannot rewrite
    "numbers in question": (["--error-share", "0.1", "--numbers-in-question"], ["--max-steps", "24"]),
    # a second epoch from the epoch's model, in the order a two-epoch run's second epoch draws (seed 0 + 1),
    # its learning rate warmed up and decayed again: +11.7, two or more operations +11.7 (docs/words.md)
    "second epoch": (["--error-share", "0.1"],
                     ["--max-steps", "75", "--model", f"{OUT}/epoch/sft", "--seed", "1"]),
}
# The words recipe's stage 1 (demo.py --real) over RL's; the arms from it move one setting more.
STAGE1 = ["--lr", "1e-5", "--steps", "14"]
# An RL arm: its train.py flags over RL's (a later flag wins).
RL_ARMS = {
    "RL base": [],
    "RL T 0.7": ["--temperature", "0.7"],
    "RL lr 1e-4": ["--lr", "1e-4"],
    # a fifth of the step: from the 48-step model every 12-step arm drifted its own way (docs/words.md)
    "RL lr 1e-5": ["--lr", "1e-5"],
    "RL 200 tokens": ["--max-response", "200"],
    "RL 4 draws": ["--dynamic-sampling", "4"],
    # twice the steps (the learning rate is flat after warm-up): hf_step_12 is RL base's model
    "RL 24 steps": ["--steps", "24", "--export-every", "12"],
    # held near the SFT model (k3 to it): 12 steps of RL base rewrote the sums its reasoning writes
    # (right 48% -> 9%), which no reward reads and which the code then copies
    "RL KL 0.2": ["--kl-coef", "0.2"],
    # RL problems without the evaluation's 300, two-operation ones repeated to half: the recipe's RL
    # taught the policy to stop after one operation (docs/words.md)
    "RL two ops half": ["--data", f"{OUT}/train_two_ops_half.jsonl"],
    # the same, held near the SFT model (k3 to it), whose samples write the second operation
    "RL two ops half KL": ["--data", f"{OUT}/train_two_ops_half.jsonl", "--kl-coef", "0.05"],
    # the share at which the stepwise model's pulls on its second step cancel (the table's balance)
    "RL two ops 72%": ["--data", f"{OUT}/train_two_ops_72.jsonl"],
    # no one-operation problem, so no rollout is punished for writing a second operation
    "RL two ops only": ["--data", f"{OUT}/train_two_ops_only.jsonl"],
    # the recipe's stage 1 (1e-5, 14 steps) with each problem's group twice as deep and half as many
    # problems: the same rollouts and update a step, and a two-operation problem that 8 rollouts
    # solve 0 or 8 times is more often mixed in 16, with 8 kept to weigh its operations (+2.0; two or
    # more operations +0.9, SE 3.7: docs/words.md)
    "RL 16 rollouts": [*STAGE1, "--problems-per-step", "4", "--rollouts-per-problem", "16",
                       "--group-size", "8"],
    # the recipe's stage 1 on two-operation problems alone: at 5e-5 (from 24 SFT steps) their accuracy
    # did not move; at 1e-5 neither (0.0), and one-operation samples took a second step (11% -> 64%)
    "RL two ops only 1e-5": [*STAGE1, "--data", f"{OUT}/train_two_ops_only.jsonl"],
    # between the step size that lost (5e-5) and the recipe's, which gained: +2.8, two or more operations
    # +4.1 (SE 3.3), the reasoning's sums right 34% (53% at 1e-5)
    "RL lr 2e-5": [*STAGE1, "--lr", "2e-5"],
    # the recipe's stage 1 from another SFT arm than the recipe's own: from "second epoch" +0.5 (SE 1.4),
    # where from the epoch's model it gained +3.5
    "RL stage 1": STAGE1,
}
parser = argparse.ArgumentParser(description="The words recipe's levers on training problems.")
parser.add_argument("--arms", default=None, help="comma-separated arms in the order to run, or sft, rl "
                                                 "(default: sft, or none with --recipe)")
parser.add_argument("--rl-from", default="stepwise", choices=list(SFT_ARMS),
                    help="the SFT arm whose model the RL arms start from")
parser.add_argument("--recipe", default=None, help="a demo.py --real run's folder: its SFT model and its "
                                                   "stages' final models are evaluated too, after the arms")
args = parser.parse_args()
args.arms = ("" if args.recipe else "sft") if args.arms is None else args.arms
arms = {"sft": list(SFT_ARMS), "rl": list(RL_ARMS)}.get(args.arms)
arms = arms or [arm.strip() for arm in args.arms.split(",") if arm.strip()]
if unknown := [a for a in arms if a not in SFT_ARMS and a not in RL_ARMS]:
    sys.exit(f"words_levers: no arm {unknown}\n---> HINT: the arms are {', '.join([*SFT_ARMS, *RL_ARMS])}")


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


os.makedirs(OUT, exist_ok=True)
run(["data/prepare_mawps.py", "--csv", MAWPS, "--out", "data/mawps"], "data/mawps/train.jsonl")  # (the split)
slice_file = f"{OUT}/train_last300.jsonl"
with open("data/mawps/train.jsonl") as f:
    problems = [json.loads(line) for line in f]
with open(slice_file, "w") as f:
    last300 = ProblemStream(problems, seed=0).take(len(problems) - 300, 300)
    f.writelines(json.dumps(p) + "\n" for p in last300)
held = {p["question"] for p in last300}
rest = [p for p in problems if p["question"] not in held]
multi = [p for p in rest if p.get("steps", 1) > 1]
for name, share in (("half", 0.5), ("72", 0.72)):  # two-operation problems repeated to this share
    with open(f"{OUT}/train_two_ops_{name}.jsonl", "w") as f:
        repeats = round(share * (len(rest) - len(multi)) / (1 - share)) - len(multi)
        f.writelines(json.dumps(p) + "\n" for p in rest + random.Random(0).choices(multi, k=max(0, repeats)))
with open(f"{OUT}/train_two_ops_only.jsonl", "w") as f:
    f.writelines(json.dumps(p) + "\n" for p in multi)



def folder(arm: str) -> str:
    """An arm's runs; an RL arm from another SFT arm than stepwise's is another run, named so."""
    if arm in RL_ARMS and args.rl_from != "stepwise":
        arm = f"{arm} from {args.rl_from}"
    return f"{OUT}/{arm.replace(' ', '_').replace('%', '').replace('.', '')}"


def problems_of(sft_arm: str) -> tuple[str, str]:
    """(RL problems, the 300 to evaluate on) for an SFT arm and the RL arms from it: its own files when
    its questions carry the cue, the same problems in the same order, so the gains stay paired."""
    if "--numbers-in-question" not in SFT_ARMS[sft_arm][0]:
        return "data/mawps/train.jsonl", slice_file
    data = f"{folder(sft_arm)}/data"
    with open(f"{data}/train.jsonl") as f:
        mine = [json.loads(line) for line in f]
    cut = ProblemStream(mine, seed=0).take(len(mine) - 300, 300)
    assert [(p["answer"], p["steps"]) for p in cut] == [(p["answer"], p["steps"]) for p in last300]
    with open(f"{data}/train_last300.jsonl", "w") as f:  # (the same name: report.py pairs by it)
        f.writelines(json.dumps(p) + "\n" for p in cut)
    return f"{data}/train.jsonl", f"{data}/train_last300.jsonl"


def evaluate(model: str, out_dir: str, problems: str):
    run(["eval.py", "--model", model, "--out-dir", out_dir, "--benchmarks", problems, "--n", "2",
         "--max-response", "384", "--kv-cache-tokens", "65536", "--max-turns", "6"], f"{out_dir}/table.json")


columns, runs = {}, {}  # a column's evaluation; its run's metrics and the steps it holds (None: all)
for arm in arms:
    if arm in SFT_ARMS:
        prepare, sft = SFT_ARMS[arm]
        data, model = f"{folder(arm)}/data", f"{folder(arm)}/sft"
        start = sft[sft.index("--model") + 1] if "--model" in sft else SMOL
        if start != SMOL and not os.path.exists(f"{start}/config.json"):
            sys.exit(f"words_levers: {arm} starts from {start}, which is not there\n"
                     f"---> HINT: run the SFT arm it continues first: --arms \"epoch,{arm}\"")
        run(["data/prepare_mawps.py", "--csv", MAWPS, "--out", data, *prepare], f"{data}/sft.jsonl")
        run(["sft.py", "--model", SMOL, "--data", f"{data}/sft.jsonl", "--out-dir", model, *SFT, *sft],
            f"{model}/model.safetensors")
        evaluated = problems_of(arm)[1]
    else:
        start, model = f"{folder(args.rl_from)}/sft", f"{folder(arm)}/final"
        if not os.path.exists(f"{start}/model.safetensors"):
            sys.exit(f"words_levers: the RL arms start from {start}, which is not there\n"
                     f"---> HINT: run the SFT arm first: --arms \"{args.rl_from}\"")
        rl_problems, evaluated = problems_of(args.rl_from)
        if "--data" in RL_ARMS[arm] and rl_problems != "data/mawps/train.jsonl":
            sys.exit(f"words_levers: {arm} brings its own problems, without {args.rl_from}'s cue\n"
                     f"---> HINT: from {args.rl_from}, run the RL arms that keep the problems (RL base)")
        run(["train.py", "--model", start, "--data", rl_problems, "--out-dir", folder(arm), *RL,
             *RL_ARMS[arm]], f"{model}/config.json")
        exports = sorted(int(name[len("hf_step_"):]) for name in os.listdir(folder(arm))
                         if name.startswith("hf_step_"))
        for step in exports[:-1]:  # an arm's earlier exports (--export-every): what its later steps bought
            label = f"{arm} @{step}"
            columns[label] = f"{folder(arm)}/eval_step_{step}"
            runs[label] = (f"{folder(arm)}/metrics.jsonl", step)
            evaluate(f"{folder(arm)}/hf_step_{step}", columns[label], evaluated)
    metrics = f"{folder(arm)}/{'sft/' if arm in SFT_ARMS else ''}metrics.jsonl"  # (SFT's or RL's steps)
    columns[arm], runs[arm] = f"{folder(arm)}/eval", (metrics, None)
    evaluate(model, columns[arm], evaluated)
if args.recipe:  # a recipe's models, each stage's after its last step
    name = os.path.basename(os.path.normpath(args.recipe))
    stages = sorted(d for d in os.listdir(args.recipe) if d.startswith("stage") and d[5:].isdigit())
    for stage in ["sft", *stages]:
        model = f"{args.recipe}/{stage}" + ("/final" if stage != "sft" else "")
        if not os.path.exists(f"{model}/config.json"):
            sys.exit(f"words_levers: {model} is not there\n"
                     f"---> HINT: finish the recipe first: .venv/bin/python demo.py --real")
        label = f"{name} {stage}"
        columns[label] = f"{OUT}/recipe_{name}/eval_{stage}"
        runs[label] = (f"{args.recipe}/{stage}/metrics.jsonl", None)
        evaluate(model, columns[label], slice_file)


def second_step(eval_dir: str) -> tuple[float, float, float, float]:
    """How often an arm's samples write a second operation ("Then," in the reasoning, step2 in the
    code) on one- and on two-operation problems; how often a two-operation sample that does is right;
    and the share of two-operation problems at which RL's pulls on that habit cancel. The pull of a
    choice made with probability p is p (1 - p) (right when made - right when not)."""
    with open(slice_file) as f:
        steps = [min(2, json.loads(line).get("steps", 1)) for line in f]
    samples = {1: [], 2: []}
    with open(f"{eval_dir}/samples.jsonl") as f:
        for sample in map(json.loads, f):
            text = sample["text"]
            samples[steps[sample["problem"]]].append(("Then," in text or "step2" in text, sample["correct"]))

    def right(kind, wrote):
        return statistics.mean([c for w, c in samples[kind] if w == wrote] or [float("nan")])
    written = {kind: statistics.mean(w for w, _ in samples[kind]) for kind in (1, 2)}
    pull = {kind: written[kind] * (1 - written[kind]) * (right(kind, True) - right(kind, False))
            for kind in (1, 2)}
    balance = pull[1] / (pull[1] - pull[2]) if pull[1] < 0 < pull[2] else float("nan")
    return written[1], written[2], right(2, True), balance


report.print_table(columns, 2, slice_file, problems="training")
print(f"\n{'arm':20} {'minutes':>8} {'s/step':>7} {'avg@2':>6} {'1 op':>6} {'2+ ops':>7} {'failing':>8} "
      f"{'cut off':>8} {'tokens':>7} {'2nd op, 1 op':>13} {'2+ ops':>7} {'right':>6} {'balance':>8} "
      f"{'sums right':>11}")
for label, eval_dir in columns.items():
    if not os.path.exists(f"{eval_dir}/table.json"):
        continue
    with open(f"{eval_dir}/table.json") as f:
        table = json.load(f)["table"][0]
    metrics, steps = runs[label]
    with open(metrics) as f:  # (an RL step's rollout, update and weight sync)
        seconds = [row.get("seconds") or row["rollout_seconds"] + row["train_seconds"] + row["sync_seconds"]
                   for row in map(json.loads, f)][:steps]
    with open(f"{eval_dir}/samples.jsonl") as f:
        cut = statistics.mean(s["finish_reason"] == "length" for s in map(json.loads, f))
    ops = report.accuracy_by_operations(eval_dir, slice_file)
    wrote_one, wrote_two, right_two, balance = second_step(eval_dir)
    print(f"{label:20} {sum(seconds) / 60:8.1f} {statistics.mean(seconds):7.1f} "
          f"{100 * table['avg_pass@1']:6.1f} {100 * ops[1]:6.1f} {100 * ops[2]:7.1f} "
          f"{100 * table['tool_error_ratio']:8.1f} {100 * cut:8.1f} {table['response_length']:7.0f} "
          f"{100 * wrote_one:12.0f}% {100 * wrote_two:6.0f}% {100 * right_two:5.0f}% {100 * balance:7.0f}% "
          f"{100 * report.sums_right(eval_dir):10.0f}%")
