"""eval.py: the unbiased pass@k, the table, the stage-3 filter (fast), and a real toy evaluation (slow)."""
import itertools
import json
import math

import pytest

import rollout
from eval import benchmark_path, benchmark_row, format_table, main, pass_at_k, select_unsolved, short_names, table_ks
from rollout import RolloutConfig, Trajectory, score


def pass_at_k_by_enumeration(n, c, k):
    """The definition: the share of k-subsets of the n samples that hold at least one correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_direct_enumeration_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got, want = pass_at_k(n, c, k), pass_at_k_by_enumeration(n, c, k)
                assert math.isclose(got, want, abs_tol=1e-12), f"pass@{k} with n={n}, c={c}: {got} != {want}"


def test_pass_at_k_edge_cases():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0, "no correct sample: pass@k must be 0"
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 8, 8) == 1.0, "all correct: pass@k must be 1"
    assert pass_at_k(8, 1, 8) == 1.0, "k = n with one correct sample: the only subset holds it"
    assert math.isclose(pass_at_k(16, 5, 1), 5 / 16), "pass@1 must be the fraction correct"
    assert 0.0 < pass_at_k(1000, 1, 10) < 1.0, "large n must not overflow or round to 0/1"
    assert math.isclose(pass_at_k(1000, 1, 10), 10 / 1000, rel_tol=1e-12)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_table_ks_are_powers_of_two_up_to_n_and_n():
    assert table_ks(1) == [] and table_ks(4) == [2, 4] and table_ks(16) == [2, 4, 8, 16] and table_ks(6) == [2, 4, 6]


def graded(pass_counts, k):
    """Problem i has k graded samples of which pass_counts[i] are correct (correct ones last)."""
    trajs = [Trajectory(index=i, sample=s, answer="1" if s >= k - c else "2", gold="1", tool_calls=s % 3,
                        tool_failures={"error": s % 2}, response_ids=[0] * 10 * (s + 1),
                        finish_reason="max_turns" if s == 0 else "answer")
             for i, c in enumerate(pass_counts) for s in range(k)]
    score(trajs, sandbox=None, cfg=RolloutConfig())
    return trajs


def test_filter_keeps_exactly_the_problems_below_k_of_k():
    counts = [8, 0, 7, 8, 1, 8, 4]
    problems = [{"question": f"q{i}", "answer": str(i), "source": "dapo", "id": 100 + i} for i in range(len(counts))]
    kept = select_unsolved(problems, graded(counts, 8), 8)
    assert kept == [dict(problems[i], pass_rate=counts[i] / 8) for i in (1, 2, 4, 6)], \
        "kept must be the problems solved fewer than 8/8, fields intact, each with its pass rate"
    assert select_unsolved(problems, graded([8] * 7, 8), 8) == [], "problems solved 8/8 must all be removed"
    with pytest.raises(ValueError):
        select_unsolved(problems, graded(counts, 8)[:-1], 8)  # a problem with 7 samples: not a K/K verdict


def test_table_row_numbers_follow_from_the_samples():
    samples = graded([4, 0, 2], 4)
    row = benchmark_row("toy", samples, 4)
    assert (row["problems"], row["samples"]) == (3, 12)
    assert math.isclose(row["avg_pass@1"], 6 / 12)
    assert math.isclose(row["pass@2"], (1 + 0 + pass_at_k(4, 2, 2)) / 3) and math.isclose(row["pass@4"], 2 / 3)
    assert math.isclose(row["response_length"], 25.0)            # 10, 20, 30, 40 per problem
    assert math.isclose(row["tool_calls"], (0 + 1 + 2 + 0) / 4)
    assert math.isclose(row["tool_error_ratio"], 2 / 3), "failed calls / calls (s=1,3 fail; calls 0+1+2+0)"
    assert row["truncated"] == 0 and math.isclose(row["tool_use"], 2 / 4)
    assert "pass@4" in format_table([row]).splitlines()[0]


def test_a_shaped_reward_leaves_accuracy_pass_at_k_and_the_filter_unchanged(monkeypatch):
    counts = [4, 0, 2, 3]
    problems = [{"question": f"q{i}", "answer": "1"} for i in range(len(counts))]
    paper = graded(counts, 4)
    # a fork's reward shaping: a penalty for each tool call, edited in the one place the reward is made
    monkeypatch.setattr(rollout, "reward", lambda t, cfg: float(t.correct) - 0.1 * t.tool_calls)
    shaped = graded(counts, 4)
    assert [t.reward for t in shaped] != [t.reward for t in paper], "the shaping did not reach the reward"
    assert benchmark_row("toy", shaped, 4) == benchmark_row("toy", paper, 4), "shaping changed the table"
    assert select_unsolved(problems, shaped, 4) == select_unsolved(problems, paper, 4) \
        == [dict(p, pass_rate=c / 4) for p, c in zip(problems[1:], counts[1:])]


def test_samples_the_sandbox_failed_are_counted_apart_and_never_scored():
    trajs = graded([2, 1], 2)
    trajs[3].sandbox_failed = True                  # problem 1's correct sample: the check did not finish
    row = benchmark_row("toy", trajs, 2)
    assert row["sandbox_failures"] == 1 and row["samples"] == 4
    assert math.isclose(row["avg_pass@1"], 2 / 3), "a failed sample must be left out, not scored 0"
    assert math.isclose(row["pass@2"], (1 + 0) / 2), "pass@k over the problem's scored samples only"
    problems = [{"question": "a", "answer": "1"}, {"question": "b", "answer": "1"}]
    assert select_unsolved(problems, trajs, 2) == [dict(problems[1], pass_rate=0.0)], \
        "an unfinished check is not a k/k solve, nor a solve in the pass rate"


def test_benchmarks_are_named_files_or_paths_and_a_missing_one_says_what_to_do(tmp_path):
    (tmp_path / "aime24.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    assert benchmark_path("aime24", str(tmp_path)) == str(tmp_path / "aime24.jsonl")
    assert benchmark_path(str(tmp_path / "aime24.jsonl"), "elsewhere") == str(tmp_path / "aime24.jsonl")
    with pytest.raises(FileNotFoundError, match=r"hmmt25\.jsonl(.|\n)*HINT: `python data/prepare_eval.py"):
        benchmark_path("hmmt25", str(tmp_path))
    assert short_names(["data/eval/aime24.jsonl", "x/b.jsonl"]) == ["aime24", "b"]
    assert short_names(["x/a.jsonl", "y/a.jsonl"]) == ["x/a.jsonl", "y/a.jsonl"], "colliding names keep their paths"


@pytest.mark.slow
def test_toy_evaluation_table_matches_its_samples_and_files_are_written(toy_engine, toy_sft_model, toy_world, tmp_path, capsys):
    lines = (toy_world / "test.jsonl").read_text().splitlines()[:16]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:10]) + "\n")
    too_long = json.dumps({"question": "What is " + "1" * 5000 + " + 1?", "answer": "2"})  # 5000+ tokens
    (tmp_path / "b.jsonl").write_text("\n".join(lines[10:] + [too_long]) + "\n")
    out = tmp_path / "results"
    rows, samples, _ = main(["--model", str(toy_sft_model), "--benchmarks", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                          "--n", "4", "--max-response", "512", "--max-turns", "10", "--out-dir", str(out)], llm=toy_engine)
    printed = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + format_table(rows))
    assert format_table(rows) in printed and "tool-use rate" in printed, "the table must be printed"
    assert "b: dropped 1 problems with a prompt over 4096 tokens" in printed, "overlong prompts are dropped, counted"
    assert [r["problems"] for r in rows] == [10, 6] and len(samples) == 64
    assert all(s["finish_reason"] and s["text"] and s["question"] for s in samples)
    for r, first in zip(rows, (0, 10)):
        mine = [s for s in samples if s["benchmark"] == r["benchmark"]]
        assert r["samples"] == len(mine) == 4 * r["problems"]
        assert all(s["gold"] == json.loads(lines[first + s["problem"]])["answer"] for s in mine), \
            "samples must map back to their own problem"
        assert math.isclose(r["avg_pass@1"], sum(s["correct"] for s in mine) / len(mine)), "avg pass@1: share correct"
        assert r["avg_pass@1"] <= r["pass@2"] <= r["pass@4"] <= 1.0, "pass@k must grow with k"
        solved_any = len({s["problem"] for s in mine if s["correct"]})
        assert math.isclose(r["pass@4"], solved_any / r["problems"]), "pass@n must be the share solved at least once"
        assert math.isclose(r["response_length"], sum(s["response_tokens"] for s in mine) / len(mine))
        assert math.isclose(r["truncated"], sum(s["finish_reason"] == "length" for s in mine) / len(mine))
        assert math.isclose(r["tool_use"], sum(s["tool_calls"] > 0 for s in mine) / len(mine))
    assert sum(s["correct"] for s in samples) > 0, "the SFT'd toy model should solve some problems"
    assert sum(s["tool_calls"] for s in samples) > 0, "the SFT'd toy model should call the tool"
    saved = json.loads((out / "table.json").read_text())
    assert saved["table"] == rows and saved["config"]["n"] == 4
    assert [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()] == samples
    assert json.loads((out / "eval_config.json").read_text())["max_turns"] == 10

    # the stage-3 filter through the CLI: original fields kept, exactly the problems below K/K
    train = [{**json.loads(x), "id": f"p{i}"} for i, x in enumerate(lines[:8])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in train))
    _, graded_samples, trajs = main(["--model", str(toy_sft_model), "--filter-solved", "2", "--data", str(tmp_path / "train.jsonl"),
                              "--out", str(tmp_path / "hard.jsonl"), "--max-response", "512"], llm=toy_engine)
    hard = [json.loads(x) for x in (tmp_path / "hard.jsonl").read_text().splitlines()]
    assert len(graded_samples) == 16 and hard == select_unsolved(train, trajs, 2)
    assert f"removed {8 - len(hard)} of 8" in capsys.readouterr().out
