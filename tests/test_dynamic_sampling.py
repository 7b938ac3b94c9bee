"""Dynamic sampling (train.py --dynamic-sampling) and the pass-rate band of the difficulty filter
(eval.py --filter-solved K --min-solved M): what they keep, checked by hand and on the toy world."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval import select_unsolved  # noqa: E402
from infra.batch import ProblemStream, mixed_groups  # noqa: E402
from rollout import Trajectory  # noqa: E402

SMALL = ["--problems-per-step", "8", "--rollouts-per-problem", "4", "--group-size", "2",
         "--max-response", "256", "--save-every", "1", "--steps", "2"]


def group(index, rewards, failed=()):
    return [Trajectory(index, sample=i, reward=r, correct=r == 1.0, sandbox_failed=i in failed)
            for i, r in enumerate(rewards)]


def test_the_stream_gives_the_same_problems_at_a_position_however_it_is_cut():
    """Dynamic sampling draws again from where the last draw stopped, and every rank takes its own
    cut: a position must name one problem, each epoch every problem once, each epoch its own shuffle."""
    problems = [{"question": f"q{i}", "answer": "1"} for i in range(5)]
    stream = ProblemStream(problems, seed=7)
    whole = stream.take(0, 15)
    assert whole == stream.take(0, 3) + stream.take(3, 6) + ProblemStream(problems, seed=7).take(9, 6)
    for epoch in range(3):
        assert sorted(p["question"] for p in whole[5 * epoch:5 * epoch + 5]) == [f"q{i}" for i in range(5)]
    assert len({tuple(stream.order(epoch)) for epoch in range(3)}) > 1, "every epoch the same order"
    assert ProblemStream(problems, seed=8).take(0, 5) != whole[:5], "the seed does not reach the shuffle"


def test_a_group_is_mixed_when_its_graded_rollouts_disagree():
    trajs = group(0, [1, 0, 0]) + group(1, [1, 1, 1]) + group(2, [0, 0]) + group(3, [1, 0], failed=(1,))
    assert mixed_groups(trajs) == {0}, "all right, all wrong, or right once the sandbox's failures are left out"
    assert mixed_groups(group(5, [0.0, 0.5])) == {5}, "a shaped reward that differs is mixed too"


def test_the_band_keeps_problems_solved_at_least_m_and_fewer_than_k_times():
    counts = [4, 0, 3, 1, 2, 4, 0]
    problems = [{"question": f"q{i}", "answer": str(i)} for i in range(len(counts))]
    trajs = [t for i, c in enumerate(counts) for t in group(i, [1.0] * c + [0.0] * (4 - c))]
    def band(*kept):
        return [dict(problems[i], pass_rate=counts[i] / 4) for i in kept]
    assert select_unsolved(problems, trajs, 4) == band(1, 2, 3, 4, 6)
    assert select_unsolved(problems, trajs, 4, min_solved=1) == band(2, 3, 4)
    assert select_unsolved(problems, trajs, 4, min_solved=3) == band(2)


def train(out, model, data, *flags):
    cmd = [sys.executable, "train.py", "--preset", "toy", "--model", str(model), "--data", str(data),
           "--out-dir", str(out), *SMALL, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dynamic_sampling_draws_until_the_step_holds_its_mixed_groups_and_trains_only_those(
        tmp_path, toy_sft_model, toy_world):
    data = toy_world / "train.jsonl"
    plain = train(tmp_path / "plain", toy_sft_model, data)
    dynamic = train(tmp_path / "dynamic", toy_sft_model, data, "--dynamic-sampling", "3")
    for row in plain:  # without the flag: one draw, and the all-equal groups are dropped by RoC
        assert row["drawn_problems"] == 8 and row["mixed_share"] == row["mixed_groups"] / 8
        assert row["dropped_groups"] == 8 - row["mixed_groups"]
    assert any(row["mixed_groups"] < 8 for row in plain), "the toy SFT model should leave some groups all-equal"
    # Its first draw samples exactly what the run without the flag samples (the same seeds).
    assert dynamic[0]["mixed_first_draw"] == plain[0]["mixed_groups"], "the first draw must be the plain step's"
    assert all(row["mixed_first_draw"] == row["mixed_groups"] for row in plain)
    for row in dynamic:
        assert row["drawn_problems"] in (8, 16, 24), "a step draws 8 problems at a time, at most 3 times"
        full = row["mixed_groups"] >= 8
        assert full or row["drawn_problems"] == 24, "it draws again while it holds fewer than 8 mixed groups"
        assert row["dropped_groups"] == 0, "every group it trains is mixed"
        assert row["kept"] == 2 * min(8, row["mixed_groups"]), "G = 2 rollouts kept of each trained group"
        assert row["mixed_share"] == min(8, row["mixed_groups"]) / 8
    meta = json.loads((tmp_path / "dynamic" / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["position"] == sum(row["drawn_problems"] for row in dynamic), "the stream must go on after them"


@pytest.mark.slow
def test_the_filter_with_a_band_keeps_exactly_the_problems_solved_some_of_the_time(tmp_path, toy_sft_model,
                                                                                     toy_world):
    lines = (toy_world / "train.jsonl").read_text().splitlines()[:16]
    (tmp_path / "pool.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "eval.py", "--model", str(toy_sft_model), "--filter-solved", "2",
                           "--min-solved", "1", "--data", str(tmp_path / "pool.jsonl"), "--out",
                           str(tmp_path / "band.jsonl"), "--max-response", "256", "--deterministic",
                           "--out-dir", str(tmp_path / "verdicts")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = [json.loads(x) for x in (tmp_path / "verdicts" / "samples.jsonl").read_text().splitlines()]
    solved = [sum(s["correct"] for s in verdicts if s["problem"] == i) for i in range(16)]
    band = [json.loads(x) for x in (tmp_path / "band.jsonl").read_text().splitlines()]
    assert band == [dict(json.loads(x), pass_rate=0.5) for x, c in zip(lines, solved) if c == 1], \
        "the band keeps the problems solved once in 2, each with its pass rate"
    assert 0 < len(band) < 16, "the toy model should solve some problems once in two"
    assert "solved 2/2 or fewer than 1/2" in proc.stdout
