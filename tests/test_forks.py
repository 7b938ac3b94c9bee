"""The forks of the README and docs/forks.md, exactly as written there: each applied to a copy of the
repository, whose fast tests that the fork touches then run in a subprocess, with a check that the fork
does what its paragraph says.

A fork is a ```diff block right after a `<!-- fork: NAME -->` line; the paragraph above it says the lines
it takes ("+a/-b"). FORKS below names, for each, the tests to run in the copy and its check (a test
module written into the copy). A fork without an entry here fails, and so does an entry without its
fork."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORK_FILES = ("README.md", "docs/forks.md")
FORK_RE = re.compile(r"((?:[^\n]+\n)+)\n<!-- fork: ([\w-]+) -->\n```diff\n([\s\S]*?)```\n")

# name -> (the tests it touches, run in the copy; the check that it took effect, a test module)
FORKS = {
    "uniform-positives": (["tests/test_grpo_roc.py::test_every_downsampler_takes_the_registry_signature",
                           "tests/test_grpo_roc.py::test_every_positive_weight_is_a_positive_number_roc_can_draw_by"
                           ],
                          """
        import subprocess, sys
        from grpo_roc import POSITIVE_WEIGHTS
        from rollout import Trajectory

        def test_uniform_positives_weigh_alike_and_train_py_takes_the_setting(tmp_path):
            sloppy, clean = Trajectory(0, tool_calls=0, num_answers=0), Trajectory(0, tool_calls=1)
            assert POSITIVE_WEIGHTS["uniform"](sloppy) == POSITIVE_WEIGHTS["uniform"](clean) == 1.0
            out = subprocess.run([sys.executable, "train.py", "--downsample-setting", "positive_weight=uniform",
                                  "--data", str(tmp_path / "none.jsonl")], capture_output=True, text=True)
            assert "no such file" in out.stderr, "train.py refused the setting: " + out.stderr[-500:]
        """),
    "roc-sums": (["tests/test_grpo_roc.py::test_every_positive_weight_is_a_positive_number_roc_can_draw_by",
                  "tests/test_rollout.py"], """
        import random
        from conversation import IM_END, render_tool_call
        from grpo_roc import resample_on_correct
        from rollout import RolloutConfig, Trajectory, end_turn, start_trajectories, trajectory_metrics
        from test_rollout import tok  # noqa: F401 (the fixture)

        def test_the_first_reasonings_sums_are_counted_and_roc_keeps_the_positive_that_writes_them_right(tok):
            traj = start_trajectories(tok, [{"question": "15 - 6", "answer": "9"}], 1)[0]
            first = "First, 15 - 6 = 9. Then, 9 * 7 = 64.</reason>" + render_tool_call("print(63)") + IM_END
            for text in (first, "<reason>So 1 + 1 = 3.</reason><answer>\\boxed{63}</answer>" + IM_END):
                ids = tok.encode(text, add_special_tokens=False)
                end_turn(traj, ids, [-0.5] * len(ids), tok, RolloutConfig())
            assert traj.sums == (1, 2), "the first turn's two sums, one wrong; the second turn's unread"
            assert trajectory_metrics([traj, Trajectory(0, sums=(0, 3))])["sums_wrong"] == 1 / 5
            right, wrong = (Trajectory(0, correct=True, reward=1.0, tool_calls=1, num_answers=1, sums=s)
                            for s in ((0, 2), (1, 2)))
            group = [right, wrong, Trajectory(0), Trajectory(0)]
            draws = [resample_on_correct(group, 2, random.Random(i), positive_weight=w)[0]
                     for w in ("roc_sums", "roc") for i in range(200)]
            hits = [any(t is right for t in kept) for kept in draws]
            assert sum(hits[:200]) >= 198, "roc_sums keeps the positive whose sums are right"
            assert 60 <= sum(hits[200:]) <= 140, "the paper's RoC does not read them"
        """),
    "format-penalty": (["tests/test_eval.py", "tests/test_rollout.py"], """
        from rollout import RolloutConfig, Trajectory, reward

        def test_a_second_answer_costs_a_tenth():
            once, twice = (Trajectory(0, correct=True, num_answers=n, finish_reason="answer") for n in (1, 2))
            assert (reward(once, RolloutConfig()), reward(twice, RolloutConfig())) == (1.0, 0.9)
        """),
    "three-tool-calls": (["tests/test_rollout.py"], """
        from conversation import IM_END, render_tool_call
        from rollout import RolloutConfig, end_turn, start_trajectories
        from test_rollout import tok  # noqa: F401 (the fixture)

        def test_the_fourth_call_is_not_run(tok):
            traj = start_trajectories(tok, [{"question": "1 + 1", "answer": "2"}], 1)[0]
            text = "Compute.</reason>" + render_tool_call("print(1 + 1)") + IM_END
            ids = tok.encode(text, add_special_tokens=False)
            calls = [end_turn(traj, ids, [-0.5] * len(ids), tok, RolloutConfig()) for _ in range(4)]
            assert [c is not None for c in calls] == [True, True, True, False] and traj.tool_calls == 3
            assert traj.finish_reason == "max_turns"
        """),
    "dr-grpo": (["tests/test_update.py::test_the_step_does_not_depend_on_how_it_is_cut_into_micro_batches"], """
        import torch
        from grpo_roc import group_advantages, policy_loss

        def test_advantages_are_centred_not_scaled_and_the_loss_is_per_sequence():
            want = torch.tensor([0.75, -0.25, -0.25, -0.25])
            assert torch.allclose(group_advantages([1.0, 0.0, 0.0, 0.0]), want)
            logp, mask = torch.zeros(2, 30), torch.ones(2, 30)
            mask[0, 10:] = 0  # rollouts of 10 and 30 loss tokens, advantage 1: -1 a token at ratio 1
            loss, _ = policy_loss(logp, logp, torch.ones(2), mask, 40, n_rollouts=2)
            assert loss.item() == -40 / 2, "each rollout's token sum, averaged over the 2 rollouts"
        """),
    "rloo": (["tests/test_grpo_roc.py::test_roc_exact_counts_from_2g"], """
        import torch
        from grpo_roc import group_advantages

        def test_each_reward_minus_the_mean_of_the_others():
            want = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])
            assert torch.allclose(group_advantages([1.0, 0.0, 0.0, 0.0]), want)
        """),
    "gspo": (["tests/test_update.py::test_several_mini_batches_step_from_the_policy_before_the_first",
              "tests/test_update.py::test_the_step_does_not_depend_on_how_it_is_cut_into_micro_batches"], """
        import math
        import torch
        from grpo_roc import policy_loss

        def test_a_rollouts_tokens_share_its_geometric_mean_ratio_and_the_loss_averages_rollouts():
            old = torch.zeros(2, 3)
            logp = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.0, -0.3]]).requires_grad_()
            mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # (the second's last token: padding)
            loss, metrics = policy_loss(logp, old, torch.ones(2), mask, 5, 1.0, 1.0, n_rollouts=2)
            assert math.isclose(metrics["ratio_mean"], (3 * math.exp(0.2) + 2 * 1.0) / 5, rel_tol=1e-6)
            assert math.isclose(loss.item(), -(math.exp(0.2) + 1.0) / 2, rel_tol=1e-6)
            loss.backward()
            want = -torch.tensor([[math.exp(0.2) / 3] * 3, [0.5, 0.5, 0.0]]) / 2
            torch.testing.assert_close(logp.grad, want)
        """),
    "entropy-bonus": (["tests/test_update.py::test_one_update_on_a_tiny_model_moves_the_weights_on_policy_and_"
                       "reports_every_metric",
                       "tests/test_grpo_roc.py::test_policy_loss_golden_value_and_metrics"], """
        import torch
        from grpo_roc import policy_loss
        from infra.logprobs import token_logprobs
        from test_update import tiny_model

        def test_the_loss_pays_for_entropy_and_its_gradient_reaches_the_model():
            model, ids = tiny_model(), torch.tensor([[11, 12, 13, 14, 15]])
            logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), entropy=True)
            assert entropy.requires_grad, "the entropy must keep its graph for a bonus"
            mask = torch.ones_like(logp)
            loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), mask, 4, entropy=entropy)
            assert torch.isclose(loss, -1e-3 * entropy.sum() / 4), "no advantage: the loss is the bonus"
            loss.backward()
            assert model.lm_head.weight.grad.abs().sum() > 0, "the bonus must move the head"
        """),
    "dapo-overlong": (["tests/test_eval.py"], """
        import pytest
        from rollout import RolloutConfig, Trajectory, reward

        @pytest.mark.parametrize("length, correct, want",
                                 [(300, True, 1.0), (350, True, 0.5), (400, True, -1.0), (350, False, -0.5)])
        def test_the_penalty_grows_over_the_budgets_last_quarter(length, correct, want):
            t = Trajectory(0, response_ids=[0] * length, correct=correct,
                           finish_reason="length" if length == 400 else "answer")
            assert reward(t, RolloutConfig(max_response=400)) == pytest.approx(want)
        """),
    "sympy-tool": (["tests/test_format.py::test_a_second_tool_is_offered_and_parsed_only_where_a_run_names_it",
                    "tests/test_format.py::test_every_tool_is_offered_and_its_required_arguments_make_a_program"],
                   """
        from conversation import parse_tool_call, system_prompt
        from test_format import call_text

        def test_the_model_can_call_sympy_where_the_run_offers_it(sandbox):
            assert "simplify_with_sympy" in system_prompt(("python", "sympy"))
            call = parse_tool_call(call_text({"expression": "(x**2 - 1)/(x - 1)"}, "simplify_with_sympy"),
                                   ("python", "sympy"))
            assert call.error is None and sandbox.run(call.code, call.stdin).stdout.strip() == "x + 1"
        """),
    "kl-k2": (["tests/test_grpo_roc.py::test_policy_loss_golden_value_and_metrics",
               "tests/test_kl.py::test_the_penalty_is_zero_at_the_first_step_and_grows_as_the_policy_moves"],
              """
        import pytest
        import torch
        from grpo_roc import policy_loss

        def test_the_penalty_and_its_gradient_are_k2s():
            logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.5]], dtype=torch.float64)
            ref_logp = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -2.0, -2.5]], dtype=torch.float64)
            loss_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
            ours = logp.clone().requires_grad_()
            no_advantage = torch.zeros(2, dtype=torch.float64)  # the loss is then the penalty alone
            loss, metrics = policy_loss(ours, logp, no_advantage, loss_mask, 5, ref_logp=ref_logp,
                                        kl_coef=0.3)
            k2 = 0.5 * (ref_logp - logp) ** 2 * loss_mask                       # (B, T)
            assert loss.item() == pytest.approx(0.3 * k2.sum().item() / 5), "the loss is not beta x k2"
            assert metrics["kl_ref"] == pytest.approx(k2.sum().item() / 5), "kl_ref is not k2 per token"
            loss.backward()
            torch.testing.assert_close(ours.grad, 0.3 * (logp - ref_logp) * loss_mask / 5)
        """),
    "calculator-sft": (["tests/test_tools.py::test_a_tool_call_must_give_the_arguments_its_spec_lists",
                        "tests/test_mawps.py::test_the_call_parses_back_and_runs_to_the_answer"], """
        import os, sys
        from conversation import parse_tool_call, render_messages
        from test_rollout import tok  # noqa: F401 (the fixture)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data"))
        from chains import calculator_conversation

        def test_sft_data_calls_the_calculator_and_the_call_parses_back_and_runs(tok, sandbox):
            messages = calculator_conversation("What is 12 * 34 + 5?", "12 * 34 + 5", "413", "413")
            ids, loss_mask = render_messages(tok, messages)
            start = loss_mask.index(1)
            first_turn = tok.decode(ids[start:loss_mask.index(0, start)])
            assert '"name": "calculate"' in first_turn, f"the call is not the calculator's: {first_turn!r}"
            call = parse_tool_call(first_turn, ("python", "calculator"))
            assert call is not None and call.error is None, f"the call did not parse back: {call}"
            assert sandbox.run(call.code, call.stdin).stdout == "413\\n"
        """),
    "pass-rate-curriculum": ([
        "tests/test_dynamic_sampling.py::test_the_band_keeps_problems_solved_at_least_m_and_fewer_than_k_times",
        "tests/test_dynamic_sampling.py::test_the_stream_gives_the_same_problems_at_a_position_however_it_is_cut"], """
        from infra.batch import ProblemStream

        def test_each_epoch_takes_the_easiest_first_and_the_rest_in_the_shuffles_order():
            rates = [0.25, None, 0.75, 0.5, None, 0.75]
            problems = [{"question": f"q{i}"} if r is None else {"question": f"q{i}", "pass_rate": r}
                        for i, r in enumerate(rates)]
            stream, plain = ProblemStream(problems, seed=3), ProblemStream([{"question": "x"}] * 6, seed=3)
            for epoch in (0, 1):
                order = stream.order(epoch)
                assert [rates[i] or 0.0 for i in order] == [0.75, 0.75, 0.5, 0.25, 0.0, 0.0]
                for rate in (0.75, None):  # problems of one pass rate keep the shuffle's order
                    shuffled = [i for i in plain.order(epoch) if rates[i] == rate]
                    assert [i for i in order if rates[i] == rate] == shuffled
            assert stream.take(4, 4) == [problems[i] for i in stream.order(0)[4:] + stream.order(1)[:2]]
        """),
}


def readme_forks() -> dict[str, tuple[str, str]]:
    """name -> (the paragraph above the fork, its patch), as the README and docs/forks.md have them."""
    found = [fork for doc in FORK_FILES for fork in FORK_RE.findall((ROOT / doc).read_text())]
    assert len({name for _, name, _ in found}) == len(found), "two forks have one name"
    return {name: (text, patch) for text, name, patch in found}


def test_every_readme_fork_is_checked_here_and_says_the_lines_it_takes():
    forks = readme_forks()
    assert set(forks) == set(FORKS), "each fork needs its entry in FORKS, and each entry its fork"
    for name, (text, patch) in forks.items():
        lines = patch.splitlines()
        files = {line[len("+++ b/"):] for line in lines if line.startswith("+++ b/")}
        added = sum(line.startswith("+") and not line.startswith("+++") for line in lines)
        removed = sum(line.startswith("-") and not line.startswith("---") for line in lines)
        assert 1 <= len(files) <= 2, f"{name}: a fork takes at most two files, this one {sorted(files)}"
        assert f"+{added}/-{removed}" in text, f"{name}: the README must say it takes +{added}/-{removed}"


def repository_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) under dest; .venv linked."""
    git = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(git, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    if (ROOT / ".venv").exists():
        os.symlink(ROOT / ".venv", dest / ".venv")
    return dest


@pytest.mark.parametrize("name", sorted(FORKS))
def test_the_readme_fork_applies_and_passes_the_tests_it_touches(name, tmp_path):
    text, patch = readme_forks()[name]
    copy = repository_copy(tmp_path / "repo")
    (tmp_path / "fork.diff").write_text(patch)
    applied = subprocess.run(["git", "apply", "--verbose", str(tmp_path / "fork.diff")], cwd=copy,
                             capture_output=True, text=True)
    assert applied.returncode == 0, f"the {name} fork no longer applies:\n{applied.stderr}\n" \
                                    "---> HINT: update its patch (README.md or docs/forks.md) to today's code"
    assert "offset" not in applied.stderr, f"the {name} fork's hunk headers name other lines than it " \
                                           f"changes:\n{applied.stderr}---> HINT: correct its @@ lines"
    tests, check = FORKS[name]
    (copy / "tests" / "test_fork_check.py").write_text(textwrap.dedent(check))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                  "-n", "0"]  # (one process: the copy's few tests do not need pytest.ini's two workers)
    run = subprocess.run([*pytest_cmd, *tests, "tests/test_fork_check.py"], cwd=copy, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, \
        f"with the {name} fork applied, its tests fail:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
