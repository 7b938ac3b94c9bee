"""What demo.py shows after its stages: the held-out table, each gain with its paired standard error,
and the RL curves as a PNG. A library: it reads the files the stages wrote (an evaluation's table.json
and samples.jsonl, an RL run's metrics.jsonl) and computes nothing that they did not.
"""
import json
import math
import operator
import os
import re
import statistics
from collections import defaultdict

ROWS = [("accuracy (avg@{n}, %)", "avg_pass@1", 100), ("pass@{n} (%)", "pass@{n}", 100),
        ("tool-use rate (%)", "tool_use", 100), ("tool-error ratio (%)", "tool_error_ratio", 100),
        ("mean response length (tokens)", "response_length", 1), ("tool calls per sample", "tool_calls", 1)]
PANELS = [("kept_reward", "reward of the kept rollouts"), ("accuracy", "accuracy of all rollouts"),
          ("tool_error_ratio_pos", "tool-error ratio, correct rollouts"), ("tool_use", "tool-use rate"),
          ("entropy", "policy entropy, nats a loss token"), ("response_length", "response tokens")]


def per_problem(folder: str) -> dict:
    """Each problem of an evaluation -> the share of its samples that are correct (its avg@n)."""
    correct = defaultdict(list)
    with open(os.path.join(folder, "samples.jsonl")) as f:
        for sample in map(json.loads, f):
            correct[sample["benchmark"], sample["problem"]].append(bool(sample["correct"]))
    return {problem: statistics.mean(c) for problem, c in correct.items()}


def accuracy_by_operations(folder: str, benchmark_file: str) -> dict:
    """avg@n of an evaluation per number of operations ("steps") of its problems, in benchmark_file's
    order: {1: accuracy, 2: ...}, problems of two or more operations counted as 2."""
    with open(benchmark_file) as f:
        steps = [min(2, json.loads(line).get("steps", 1)) for line in f]
    by_steps = defaultdict(list)
    for (_, problem), accuracy in per_problem(folder).items():
        by_steps[steps[problem]].append(accuracy)
    return {k: statistics.mean(v) for k, v in sorted(by_steps.items())}


SUM = re.compile(r"(\d+(?:\.\d+)?) ([-+*/]) (\d+(?:\.\d+)?) = (-?\d+(?:\.\d+)?)")  # "15 - 6 = 9"
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def reasoning_sums(text: str) -> list[tuple[float, float]]:
    """(the value written, the right value) of each sum a response's reasoning writes ("First, 15 - 6 =
    9."), read before its first </reason>; a division by zero is skipped. The reward reads the code's
    output, never these values, so RL is free to change them."""
    sums = []
    for a, op, b, value in SUM.findall(text.split("</reason>")[0]):
        if op != "/" or float(b):
            sums.append((float(value), OPERATORS[op](float(a), float(b))))
    return sums


def written_sums(folder: str, first: int | None = None) -> list[tuple[float, float]]:
    """reasoning_sums of every sample of an evaluation (`first`: of its first N problems only)."""
    sums = []
    with open(os.path.join(folder, "samples.jsonl")) as f:
        for sample in map(json.loads, f):
            if first is None or sample["problem"] < first:
                sums += reasoning_sums(sample["text"])
    return sums


def sums_right(folder: str, first: int | None = None) -> float:
    """The share of the sums in an evaluation's reasoning whose value is right (written_sums)."""
    return statistics.mean([abs(written - right) < 1e-6 for written, right in written_sums(folder, first)]
                           or [float("nan")])


def paired_gain(base_folder: str, folder: str, only=None) -> tuple[float, float, int]:
    """(mean gain in avg@n, its standard error, problems) of one evaluation over another of the same
    problems (`only`: those whose index it holds). Paired: the gain of each problem is taken first, so
    that how hard a problem is (most of the spread between problems) cancels; the standard error is
    their standard deviation / sqrt(n)."""
    base, other = per_problem(base_folder), per_problem(folder)
    if only is not None:
        base = {key: value for key, value in base.items() if key[1] in only}
        other = {key: value for key, value in other.items() if key[1] in only}
    if not (set(base) <= set(other) or set(other) <= set(base)):
        raise ValueError(f"{base_folder} and {folder} evaluated different problems: a paired gain needs the "
                         f"same ones (or the first N of them)\n---> HINT: evaluate both with the same "
                         f"--benchmarks, and --first")
    gains = [other[p] - base[p] for p in base if p in other]  # (the problems both evaluated)
    return statistics.mean(gains), statistics.stdev(gains) / len(gains) ** 0.5, len(gains)


def print_table(columns: dict, n: int, benchmark_file: str | None = None, problems: str = "held-out"):
    """The table, a column per evaluation that exists, then each one's gain over the first; with the
    benchmark's file (its problems' "steps"), a row per number of operations too. `problems` names what
    was evaluated: held-out problems, or training problems where levers are chosen."""
    tables, temperatures = {}, {}
    for name, folder in columns.items():
        if os.path.exists(os.path.join(folder, "table.json")):
            with open(os.path.join(folder, "table.json")) as f:
                written = json.load(f)
            tables[name], temperatures[name] = written["table"][0], written["config"]["temperature"]
    if not tables:
        return
    first = next(iter(tables))
    sampled = ", ".join(f"temperature {t}" for t in sorted(set(temperatures.values())))  # (each evaluation's)
    print(f"\n{problems} problems: {tables[first]['problems']} x {n} samples, {sampled}\n")
    print(f"{'':32}" + "".join(f" {name:>13}" for name in tables))  # (a long name stays apart)
    print(f"{'problems':32}" + "".join(f"{t['problems']:14d}" for t in tables.values()))
    for label, key, scale in ROWS:
        cells = [scale * t.get(key.format(n=n), float("nan")) for t in tables.values()]
        print(f"{label.format(n=n):32}" + "".join(f"{cell:14.1f}" for cell in cells))
    if benchmark_file:
        by_operations = [accuracy_by_operations(columns[name], benchmark_file) for name in tables]
        for k, label in ((1, "one operation (avg@{n}, %)"), (2, "two or more (avg@{n}, %)")):
            cells = [100 * ops.get(k, float("nan")) for ops in by_operations]
            print(f"{label.format(n=n):32}" + "".join(f"{cell:14.1f}" for cell in cells))
    subsets = [(None, f"{problems} accuracy")]
    if benchmark_file:
        with open(benchmark_file) as f:
            multi = {i for i, line in enumerate(f) if json.loads(line).get("steps", 1) > 1}
        subsets.append((multi, "two or more operations"))
    for name in list(tables)[1:]:
        for only, label in subsets:
            gain, se, problems = paired_gain(columns[first], columns[name], only)
            print(f"{name}: {label} {100 * gain:+.1f} points over the {first} model (paired standard error "
                  f"{100 * se:.1f} over {problems} problems; gain / SE = {gain / se if se else 0:.1f})")


def mean_of(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def plot_curves(curves: list, path: str, title: str, one_after_another: bool):
    """A line per RL run, a panel per metric; with one_after_another the runs (the real recipe's stages)
    share one step axis. Prints, per run and for all of them, the first 5 steps' means -> the last 5's."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    axes, offset, during = axes.flatten(), 0, []
    for name, out_dir in curves:
        if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
            continue
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        for ax, (key, panel) in zip(axes, PANELS):
            ax.plot([offset + r["step"] for r in rows], [r.get(key, math.nan) for r in rows], label=name)
            ax.set_title(panel, fontsize=10)
            ax.set_xlabel("RL step")
        offset += len(rows) if one_after_another else 0
        during.append((f"{name} during RL", rows))
    if one_after_another and len(during) > 1:  # the recipe as a whole: the first stage's start -> the last's end
        during.append(("all stages", [r for _, rows in during for r in rows]))
    for name, rows in during:
        head, tail = rows[:5], rows[-5:]
        print(f"{name} (mean of the first 5 steps -> the last 5): accuracy {mean_of(head, 'accuracy'):.2f} -> "
              f"{mean_of(tail, 'accuracy'):.2f}, tool use {mean_of(head, 'tool_use'):.2f} -> "
              f"{mean_of(tail, 'tool_use'):.2f}, tool-error ratio of correct rollouts "
              f"{mean_of(head, 'tool_error_ratio_pos'):.3f} -> {mean_of(tail, 'tool_error_ratio_pos'):.3f}")
    for ax, (key, _) in zip(axes, PANELS):
        if not ax.lines or all(math.isnan(y) for line in ax.lines for y in line.get_ydata()):
            ax.text(0.5, 0.5, f"no {key} in these runs' metrics.jsonl", ha="center", transform=ax.transAxes)
    axes[0].legend()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
