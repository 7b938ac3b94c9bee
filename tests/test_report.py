"""report.py: the paired gain and its standard error, computed from evaluations' samples.jsonl files."""
import json

import pytest

from report import accuracy_by_operations, paired_gain, per_problem, sums_right, written_sums


def write_samples(folder, correct_by_problem):
    folder.mkdir()
    with open(folder / "samples.jsonl", "w") as f:
        for problem, verdicts in correct_by_problem.items():
            for sample, correct in enumerate(verdicts):
                f.write(json.dumps(dict(benchmark="test", problem=problem, sample=sample, correct=correct)) + "\n")
    return str(folder)


def test_the_gain_is_the_mean_of_per_problem_differences_and_its_error_their_spread(tmp_path):
    base = write_samples(tmp_path / "sft", {0: [0, 0, 0, 0], 1: [1, 1, 0, 0], 2: [1, 1, 1, 1]})
    after = write_samples(tmp_path / "rl", {0: [1, 0, 0, 0], 1: [1, 1, 1, 1], 2: [1, 1, 1, 0]})
    assert per_problem(base) == {("test", 0): 0.0, ("test", 1): 0.5, ("test", 2): 1.0}
    gain, se, n = paired_gain(base, after)
    # per problem: +0.25, +0.5, -0.25 -> mean 1/6; sample SD 0.3819 (n - 1), / sqrt(3) = 0.2205
    assert n == 3
    assert gain == pytest.approx(1 / 6)
    assert se == pytest.approx(0.38188130791298663 / 3 ** 0.5)


def test_the_same_problems_with_the_same_verdicts_gain_nothing_and_other_problems_are_refused(tmp_path):
    base = write_samples(tmp_path / "a", {0: [1, 0], 1: [0, 0]})
    assert paired_gain(base, base) == (0.0, 0.0, 2)
    other = write_samples(tmp_path / "b", {0: [1, 0], 5: [0, 0]})
    with pytest.raises(ValueError, match="different problems"):
        paired_gain(base, other)


def test_accuracy_by_operations_groups_problems_by_their_steps_two_or_more_together(tmp_path):
    folder = write_samples(tmp_path / "eval", {0: [1, 1], 1: [0, 1], 2: [0, 0], 3: [1, 0]})
    benchmark = tmp_path / "test.jsonl"
    benchmark.write_text("".join(json.dumps({"question": "q", "answer": "1", "steps": s}) + "\n"
                                 for s in (1, 2, 3, 1)))
    # one operation: problems 0 and 3 (1.0, 0.5); two or more: problems 1 and 2 (0.5, 0.0)
    assert accuracy_by_operations(folder, str(benchmark)) == {1: 0.75, 2: 0.25}


def test_a_paired_gain_over_some_problems_pairs_those_alone(tmp_path, capsys):
    from report import print_table
    base = write_samples(tmp_path / "sft", {0: [0, 0], 1: [0, 0], 2: [1, 1]})
    after = write_samples(tmp_path / "rl", {0: [1, 1], 1: [1, 0], 2: [0, 0]})
    assert paired_gain(base, after, only={0, 1}) == (0.75, pytest.approx(0.25), 2), "+1 and +0.5"
    four = write_samples(tmp_path / "four", {0: [0, 0], 1: [0, 0], 2: [1, 1], 3: [0, 0]})
    first_three = write_samples(tmp_path / "between", {0: [1, 1], 1: [1, 0], 2: [1, 1]})  # (--first 3)
    assert paired_gain(four, first_three, only={1, 2, 3}) == (0.25, pytest.approx(0.25), 2), \
        "problems 1 and 2: those of the subset that both evaluated"
    for folder in (base, after):
        table = {"config": {"temperature": 0.7}, "table": [{"problems": 3}]}
        (tmp_path / folder / "table.json").write_text(json.dumps(table))
    benchmark = tmp_path / "test.jsonl"
    benchmark.write_text("".join(json.dumps({"question": "q", "answer": "1", "steps": s}) + "\n"
                                 for s in (2, 3, 1)))
    print_table({"SFT": base, "RL": after}, 2, str(benchmark))
    printed = capsys.readouterr().out
    assert "RL: two or more operations +75.0 points over the SFT model (paired standard error 25.0 over 2" \
        in printed, printed
    assert printed.startswith("\nheld-out problems: 3 x 2 samples, temperature 0.7\n"), "the evaluations' own"
    assert "RL: held-out accuracy +16.7" in printed
    print_table({"SFT": base, "RL": after}, 2, str(benchmark), problems="training")  # (bench/words_levers.py)
    printed = capsys.readouterr().out
    assert printed.startswith("\ntraining problems: 3 x 2") and "RL: training accuracy +16.7" in printed, \
        "problems chosen on are not called held out"


def test_the_curves_plot_a_run_whose_metrics_lack_a_panels_key(tmp_path, capsys):
    from report import PANELS, plot_curves
    run = tmp_path / "stage1"
    run.mkdir()
    row = {key: 0.5 for key, _ in PANELS if key != "entropy"}  # (a run from before entropy was logged)
    (run / "metrics.jsonl").write_text("".join(json.dumps(dict(row, step=s)) + "\n" for s in (1, 2)))
    plot_curves([("stage 1", str(run))], str(tmp_path / "curves.png"), "title", one_after_another=True)
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_the_sums_written_are_read_from_the_reasoning_only_and_a_division_by_zero_skipped(tmp_path):
    texts = {0: "First, 15 - 6 = 9. Then, 9 * 7 = 64.</reason><tool_call>print(2 + 2 = 5)</tool_call>",
             1: "First, 10 / 4 = 2.5. Then, 3 / 0 = 0.</reason>",
             2: "First, 1 + 1 = 3.</reason>"}
    (tmp_path / "eval").mkdir()
    with open(tmp_path / "eval" / "samples.jsonl", "w") as f:
        for problem, text in texts.items():
            sample = dict(benchmark="test", problem=problem, sample=0, correct=True, text=text)
            f.write(json.dumps(sample) + "\n")
    # right: 15 - 6 = 9 and 10 / 4 = 2.5; wrong: 9 * 7 = 64 and 1 + 1 = 3; the code's sum and 3 / 0 unread
    assert written_sums(str(tmp_path / "eval")) == [(9, 9), (64, 63), (2.5, 2.5), (3, 2)]
    assert sums_right(str(tmp_path / "eval")) == 0.5
    assert sums_right(str(tmp_path / "eval"), first=2) == pytest.approx(2 / 3)
