"""GRPO-RoC: penalties, down-sampling, advantages and the clipped loss."""
import math
import random

import pytest
import torch

from grpo_roc import (DOWNSAMPLER_SETTINGS, DOWNSAMPLERS, PENALTY_EPS, POSITIVE_WEIGHTS, downsample_uniform, drop_sandbox_failures,
                      filter_void_turns, format_penalty, group_advantages, mismatch_correction,
                      policy_loss, resample_on_correct, roc_weight, tool_error_penalty)
from rollout import Trajectory
from infra.update import MiniBatch, effective_sample_size


def traj(reward, calls=1, failures=None, answers=1, turns=2, index=0, void_turns=0, sandbox_failed=False,
         correct=None):
    """A graded rollout; correct unless said otherwise when its reward is positive (the paper's reward)."""
    t = Trajectory(index=index, prompt_ids=[1], reward=float(reward), tool_calls=calls,
                   tool_failures=dict(failures or {}), num_answers=answers, num_turns=turns,
                   correct=reward > 0 if correct is None else correct)
    t.void_turns = void_turns            # set on the instance: the fields grading and the turn logic fill
    t.sandbox_failed = sandbox_failed
    return t


def ids(trajs):
    """Identities: Trajectory is a dataclass, so == compares field values, not rollouts."""
    return [id(t) for t in trajs]


def group_of(n_pos, n_neg):
    return [traj(1) for _ in range(n_pos)] + [traj(0) for _ in range(n_neg)]


# ----------------------------------------------------------------------------- penalties

def test_tool_error_penalty_golden_values():
    assert tool_error_penalty(traj(1, calls=0)) == 0.5, "no tool call must cost 0.5, not 0"
    assert tool_error_penalty(traj(1, calls=4)) == 0.0
    assert tool_error_penalty(traj(1, calls=4, failures={"error": 1})) == 0.25
    t = traj(1, calls=4, failures={"timeout": 1, "oom": 1, "parse": 1})
    assert tool_error_penalty(t) == 0.75, "timeouts, OOMs and parse failures must count as failures"


def test_tool_error_penalty_ignores_the_text():
    t = traj(1, calls=2)
    t.text = "<tool_response>\nerror: none found\n</tool_response>" * 2
    assert tool_error_penalty(t) == 0.0, "penalty searched the text for 'error' (official-code bug)"


def test_format_penalty_golden_values():
    assert format_penalty(traj(1, answers=0, turns=3)) == 1.0, "missing <answer> must cost 1"
    assert format_penalty(traj(1, answers=1, turns=3)) == 0.0
    assert format_penalty(traj(1, answers=2, turns=4)) == 0.25
    assert format_penalty(traj(1, answers=3, turns=2)) == 1.0, "format penalty not capped at 1"
    assert format_penalty(traj(1, answers=1, turns=1)) == 0.0, \
        "a one-turn answer was penalised (official code's uncounted first turn)"
    closed_twice = traj(1, answers=1, turns=2)
    closed_twice.answer_tags_match = False  # "<answer>\boxed{3}</answer></answer>": the official code's 1
    assert format_penalty(closed_twice) == 1.0, "a run of </answer> after the answer went unpenalised"


# ----------------------------------------------------------------------------- down-sampling

@pytest.mark.parametrize("sampler", DOWNSAMPLERS.values())
@pytest.mark.parametrize("reward", [0, 1])
def test_all_equal_groups_are_dropped(sampler, reward):
    kept, stats = sampler([traj(reward) for _ in range(8)], 4, random.Random(0))
    assert kept == [] and stats["dropped_all_equal"] == 1, "all-equal group kept (zero advantage)"


def test_roc_exact_counts_from_2g():
    for n_pos in range(1, 16):
        group = group_of(n_pos, 16 - n_pos)
        kept, stats = resample_on_correct(group, 8, random.Random(n_pos))
        want_neg = max(1, (16 - n_pos) // 2)
        assert len(kept) == 8, f"kept {len(kept)} != G for {n_pos} positives"
        assert stats["n_neg"] == want_neg, f"negatives not floor(|neg|/2) (min 1) for {n_pos} pos"
        assert stats["n_pos"] == 8 - want_neg and stats["short_group"] == 0
        assert len({id(t) for t in kept}) == 8, "a rollout was kept twice"
        kept_ids = {id(t) for t in kept}
        assert [id(t) for t in group if id(t) in kept_ids] == [id(t) for t in kept], \
            "kept rollouts lost their rollout order"


def test_one_negative_and_one_positive_groups_keep_one_of_each():
    kept, stats = resample_on_correct(group_of(7, 1), 4, random.Random(0))
    assert (stats["n_pos"], stats["n_neg"]) == (3, 1), "the single negative was dropped (floor(1/2)=0)"
    kept, stats = resample_on_correct(group_of(1, 7), 4, random.Random(0))
    assert (stats["n_pos"], stats["n_neg"]) == (1, 3), "the single positive was dropped"


def test_roc_splits_by_correctness_while_the_reward_decides_which_groups_train():
    # A shaped reward (a format penalty, say) can score a correct rollout with malformed calls <= 0.
    shaped = [traj(1.0), traj(1.0), traj(-0.5, correct=True), traj(-0.5, correct=True)]
    wrong = [traj(-1.0) for _ in range(4)]
    kept, stats = resample_on_correct(shaped + wrong, 4, random.Random(0))
    assert (stats["n_pos"], stats["n_neg"]) == (2, 2), "RoC took a correct rollout for a negative by its reward"
    assert sum(not t.correct for t in kept) == 2, "the kept negatives are the incorrect rollouts"
    all_correct = [traj(1.0) for _ in range(4)] + [traj(-0.5, correct=True) for _ in range(4)]
    kept, stats = resample_on_correct(all_correct, 4, random.Random(0))
    assert len(kept) == 4 and stats["n_neg"] == 0 and stats["dropped_all_equal"] == 0, \
        "a group whose rewards differ trains even when every rollout is correct"
    same_reward = [traj(0.0, correct=True)] + [traj(0.0) for _ in range(7)]
    assert resample_on_correct(same_reward, 4, random.Random(0))[1]["dropped_all_equal"] == 1, \
        "equal rewards give zero advantages, whatever the correctness"


def test_short_group_is_kept_whole_and_flagged():
    group = group_of(1, 2)
    for sampler in DOWNSAMPLERS.values():
        kept, stats = sampler(group, 4, random.Random(0))
        assert kept == group and stats["short_group"] == 1, "short group not kept whole / flagged"


def test_negatives_uniform_positives_inverse_to_penalty():
    a = traj(1, calls=2, failures={"error": 1}, answers=1)   # p_total 0.5 + 0.0
    b = traj(1, calls=0, answers=2, turns=2)                 # p_total 0.5 + 0.5
    c = traj(1, calls=1, failures={"timeout": 1}, answers=0)  # p_total 1.0 + 1.0
    negs = [traj(0), traj(0)]
    group = [a, b, c] + negs
    w = [1 / (p + PENALTY_EPS) for p in (0.5, 1.0, 2.0)]
    W = sum(w)
    # exact inclusion probability of 2 successive weighted draws out of 3
    expect = [w[i] / W + sum(w[j] / W * w[i] / (W - w[j]) for j in range(3) if j != i)
              for i in range(3)]
    rng, n = random.Random(1234), 20000
    pos_hits, neg_hits = [0, 0, 0], [0, 0]
    for _ in range(n):
        kept, stats = resample_on_correct(group, 3, rng)
        assert (stats["n_pos"], stats["n_neg"]) == (2, 1), "wrong positive/negative counts"
        for i, t in enumerate((a, b, c)):
            pos_hits[i] += any(k is t for k in kept)
        for i, t in enumerate(negs):
            neg_hits[i] += any(k is t for k in kept)
    for i in range(3):
        tol = 5 * math.sqrt(expect[i] * (1 - expect[i]) / n)
        assert abs(pos_hits[i] / n - expect[i]) < tol, \
            f"positive {i} chosen {pos_hits[i] / n:.3f}, want {expect[i]:.3f} (not prob ~ 1/p_total)"
    assert abs(neg_hits[0] / n - 0.5) < 5 * math.sqrt(0.25 / n), "negatives not uniform"


def test_negative_inclusion_is_uniform_in_a_big_group():
    group = group_of(2, 6)                          # G=4: 3 of 6 negatives, 1 of 2 positives
    rng, n = random.Random(7), 6000
    hits = {id(t): 0 for t in group}
    for _ in range(n):
        for t in resample_on_correct(group, 4, rng)[0]:
            hits[id(t)] += 1
    for t in group[2:]:
        assert abs(hits[id(t)] / n - 0.5) < 5 * math.sqrt(0.25 / n), "negatives not uniform"


def test_downsample_uniform_keeps_g_uniformly():
    group = group_of(3, 5)
    rng, n = random.Random(3), 6000
    hits = {id(t): 0 for t in group}
    for _ in range(n):
        kept, stats = downsample_uniform(group, 4, rng)
        assert len(kept) == 4 and stats["n_pos"] + stats["n_neg"] == 4
        assert set(stats) == {"dropped_all_equal", "short_group", "n_pos", "n_neg"}, \
            "ablation stats differ from RoC's; train.py cannot switch with --downsample"
        for t in kept:
            hits[id(t)] += 1
    for t in group:
        assert abs(hits[id(t)] / n - 0.5) < 5 * math.sqrt(0.25 / n), "uniform ablation is biased"


@pytest.mark.parametrize("name", sorted(DOWNSAMPLERS))
def test_every_downsampler_takes_the_registry_signature(name):
    group = group_of(3, 5)
    for n_pos, n_neg in [(3, 5), (0, 8), (1, 1)]:   # a mixed 2G, an all-equal group, a short group
        group = group_of(n_pos, n_neg)
        kept, stats = DOWNSAMPLERS[name](group, 4, random.Random(0), setting_of_another_arm=1)
        assert set(stats) == {"dropped_all_equal", "short_group", "n_pos", "n_neg"}, name
        assert len(kept) == (0 if n_pos == 0 else min(4, len(group))), f"{name} did not keep G with extra settings"
        assert ids(kept) == [id(t) for t in group if id(t) in set(ids(kept))], f"{name} broke the group's order"
        assert stats["n_pos"] + stats["n_neg"] == len(kept) and stats["dropped_all_equal"] == (n_pos == 0)


@pytest.mark.parametrize("name", sorted(DOWNSAMPLERS))
def test_every_downsampler_declares_its_settings_and_takes_each_by_name(name):
    """train.py checks --downsample-setting against DOWNSAMPLER_SETTINGS: a declared setting that the
    function swallowed into **settings would be accepted and silently do nothing."""
    import inspect
    assert set(DOWNSAMPLER_SETTINGS) == set(DOWNSAMPLERS), "each down-sampler declares its settings"
    parameters = inspect.signature(DOWNSAMPLERS[name]).parameters
    for setting in DOWNSAMPLER_SETTINGS[name]:
        assert setting in parameters and parameters[setting].default is not inspect.Parameter.empty, \
            f"{name} declares {setting} but does not take it by name with a default"


@pytest.mark.parametrize("name", sorted(POSITIVE_WEIGHTS))
def test_every_positive_weight_is_a_positive_number_roc_can_draw_by(name):
    rollouts = [traj(1, calls=2), traj(1, calls=0, answers=0), traj(1, calls=3, failures={"error": 3}, answers=4)]
    assert all(0 < POSITIVE_WEIGHTS[name](t) < math.inf for t in rollouts), f"{name}: weights must be > 0, finite"
    kept, _ = resample_on_correct(rollouts + [traj(0), traj(0)], 3, random.Random(0), positive_weight=name)
    assert len(kept) == 3


def test_a_variant_of_roc_is_one_setting_uniform_positives_for_example(monkeypatch):
    flawless, sloppy = traj(1, calls=2), traj(1, calls=0, answers=0)   # p_total 0 and 1.5
    group = [flawless, sloppy, traj(0), traj(0)]
    assert roc_weight(flawless) == 1 / PENALTY_EPS and roc_weight(sloppy) == 1 / (1.5 + PENALTY_EPS)
    monkeypatch.setitem(POSITIVE_WEIGHTS, "flat", lambda t: 1.0)
    n = 400
    for weight, lo, hi in [("roc", 0.99, 1.0), ("flat", 0.35, 0.65)]:
        hits = sum(id(flawless) in ids(resample_on_correct(group, 2, random.Random(i), positive_weight=weight)[0])
                   for i in range(n))
        assert lo <= hits / n <= hi, f"flawless kept {hits / n:.2f}: the positives' weight was not used"
    with pytest.raises(ValueError, match="HINT"):
        resample_on_correct(group, 2, random.Random(0), positive_weight="no such weight")


def test_the_loss_is_a_mean_over_the_steps_loss_tokens_and_so_are_its_metrics():
    kept = [Trajectory(index=0, loss_mask=[0, 1, 1]), Trajectory(index=1, loss_mask=[1, 1, 0, 1])]
    assert MiniBatch(None, kept, [0.0, 0.0], [], []).n_loss_tokens == 5, "DAPO's token-level mean: 5 tokens"
    assert MiniBatch(None, [], [], [], []).n_loss_tokens == 1, "a step with nothing kept divides by 1"
    logp = torch.tensor([[-1.0, -2.0]])
    args = (logp, logp, torch.tensor([1.0]), torch.ones(1, 2))
    loss, metrics = policy_loss(*args, 4, entropy=torch.tensor([[0.5, 1.5]]))
    halved, same = policy_loss(*args, 8, entropy=torch.tensor([[0.5, 1.5]]))
    assert math.isclose(loss.item(), -2 / 4) and math.isclose(halved.item(), loss.item() / 2), \
        "the summed token losses (-1 each at ratio 1, advantage 1) over n_loss_tokens"
    assert metrics["entropy"] == 2.0 / 4 and same["entropy"] == 2.0 / 8, "the entropy's masked sum / n"


def test_seeded_rng_is_reproducible():
    group = group_of(5, 11)
    a = resample_on_correct(group, 8, random.Random(42))[0]
    b = resample_on_correct(group, 8, random.Random(42))[0]
    assert [id(t) for t in a] == [id(t) for t in b], "down-sampling uses a hidden global RNG"


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_golden_values():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])    # mean 0.25, unbiased std 0.5
    want = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6)
    assert torch.allclose(adv, want, atol=1e-6), f"{adv} != {want}: biased std or wrong mean"
    assert torch.equal(group_advantages([1.0]), torch.zeros(1)), "a group of one must get 0"
    assert torch.equal(group_advantages(torch.ones(4)), torch.zeros(4)), "equal rewards gave nonzero"


# ----------------------------------------------------------------------------- loss

def test_policy_loss_golden_value_and_metrics():
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.1, 1.0]], dtype=torch.float64)
    loss_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    loss, m = policy_loss(logp, torch.zeros_like(ratios), adv, loss_mask, n_loss_tokens=5)
    # row 0 (A=+1): -1, -1.28 (clipped high), masked; row 1 (A=-2): +1.6 (clipped low), +2.2, +2
    assert loss.item() == pytest.approx((-1 - 1.28 + 1.6 + 2.2 + 2) / 5), "loss formula wrong"
    assert m["clip_frac_high"] == pytest.approx(0.2) and m["clip_frac_low"] == pytest.approx(0.2)
    assert m["ratio_mean"] == pytest.approx(5.1 / 5), "ratio mean counted masked-out tokens"
    k3 = sum(r - 1 - math.log(r) for r in (1.0, 1.5, 0.5, 1.1, 1.0)) / 5
    assert m["approx_kl"] == pytest.approx(k3)
    assert all(isinstance(v, float) for v in m.values()), "metrics must be plain floats"


@pytest.mark.parametrize("adv, ratio, clipped", [
    (+1.0, 1.28 + 1e-3, True), (+1.0, 1.28 - 1e-3, False), (+1.0, 0.7, False),
    (-1.0, 0.8 - 1e-3, True), (-1.0, 0.8 + 1e-3, False), (-1.0, 1.5, False)])
def test_clipping_boundaries(adv, ratio, clipped):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64),
                          torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), 1)
    loss.backward()
    bound = min(max(ratio, 0.8), 1.28)
    want = -min(ratio * adv, bound * adv)
    assert loss.item() == pytest.approx(want), "clip bounds wrong (eps_low 0.2 / eps_high 0.28)"
    want_grad = 0.0 if clipped else -ratio * adv     # d(-ratio * A)/d logp = -ratio * A
    assert logp.grad.item() == pytest.approx(want_grad), \
        "gradient through a clipped token (or a dual clip / missing min)" if clipped \
        else "no gradient through an unclipped token"


def test_on_policy_is_the_plain_policy_gradient():
    torch.manual_seed(0)
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    n_loss_tokens = int(loss_mask.sum())
    loss, m = policy_loss(logp, logp.detach(), adv, loss_mask, n_loss_tokens)
    loss.backward()
    want = -adv[:, None] * loss_mask / n_loss_tokens
    assert torch.allclose(logp.grad, want), "ratio = 1 does not give -A * grad logp / n_loss_tokens"
    assert m["ratio_mean"] == pytest.approx(1.0) and m["approx_kl"] == pytest.approx(0.0)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0


def test_gradient_is_invariant_to_micro_batch_split():
    torch.manual_seed(1)
    B, T = 6, 5
    base = torch.randn(B, T, dtype=torch.float64)
    old_logp = base + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    loss_mask = (torch.rand(B, T) < 0.7).long()
    n_loss_tokens = int(loss_mask.sum())

    full = base.clone().requires_grad_()
    policy_loss(full, old_logp, adv, loss_mask, n_loss_tokens)[0].backward()

    split = base.clone().requires_grad_()
    local = base.clone().requires_grad_()
    for lo, hi in [(0, 2), (2, 3), (3, 6)]:
        sl = slice(lo, hi)
        policy_loss(split[sl], old_logp[sl], adv[sl], loss_mask[sl], n_loss_tokens)[0].backward()
        n_local = int(loss_mask[sl].sum())
        policy_loss(local[sl], old_logp[sl], adv[sl], loss_mask[sl], n_local)[0].backward()
    assert torch.allclose(full.grad, split.grad), "micro-batch split changes the gradient"
    assert not torch.allclose(full.grad, local.grad), \
        "test is blind: per-micro-batch normalisation should differ from the global one"


def test_masked_padding_cannot_poison_the_loss():
    logp = torch.tensor([[0.0, -1e9]], requires_grad=True)   # a padded token with a huge log-ratio
    old_logp = torch.tensor([[0.0, 1e9]])
    loss, m = policy_loss(logp, old_logp, torch.tensor([1.0]), torch.tensor([[1, 0]]), 1)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all(), "inf * 0 = nan leaked"
    assert math.isfinite(m["approx_kl"])


# ----------------------------------------------------------------------------- sandbox failures, void turns

def test_sandbox_failed_rollouts_leave_and_are_never_negatives():
    failed = traj(0, sandbox_failed=True)          # grading never completed: reward left at 0
    group = [traj(1) for _ in range(7)] + [failed]
    kept, n_failed = drop_sandbox_failures(group, 4)
    assert n_failed == 1 and ids(kept) == ids(group[:7])
    kept, stats = resample_on_correct(kept, 4, random.Random(0))
    assert kept == [] and stats["dropped_all_equal"] == 1, \
        "the failed rollout's reward 0 counted as the model's mistake"


def test_sandbox_failures_drop_the_group_only_below_g():
    group = group_of(3, 3) + [traj(1, sandbox_failed=True), traj(0, sandbox_failed=True)]
    kept, n_failed = drop_sandbox_failures(group, 6)
    assert ids(kept) == ids(group[:6]) and n_failed == 2, "a group with G survivors must keep them all"
    kept, n_failed = drop_sandbox_failures(group, 7)
    assert kept == [] and n_failed == 2, "a group left with fewer than G survivors was kept"
    short = group_of(1, 2)
    kept, n_failed = drop_sandbox_failures(short, 4)
    assert ids(kept) == ids(short) and n_failed == 0, "a short group without failures was dropped"


def test_void_turn_filter_runs_before_downsampling():
    clean = [traj(1), traj(1), traj(1), traj(0), traj(0)]
    void = [traj(0, void_turns=1), traj(0, void_turns=2), traj(1, void_turns=1)]
    group = [void[0], clean[0], void[1], clean[1], clean[2], void[2], clean[3], clean[4]]
    kept, n_void = filter_void_turns(group)
    assert n_void == 3 and ids(kept) == ids(clean), "void rollouts kept or clean ones lost / reordered"
    for sampler in DOWNSAMPLERS.values():
        final, stats = sampler(kept, 4, random.Random(0))
        assert len(final) == 4 and not set(ids(final)) & set(ids(void)), "G not filled from clean rollouts"
    only_pos, _ = filter_void_turns([traj(1), traj(1), traj(0, void_turns=1)])
    kept, stats = resample_on_correct(only_pos, 2, random.Random(0))
    assert kept == [] and stats["dropped_all_equal"] == 1, "clean rollouts all equal: no gradient"


def test_emptied_group_is_not_counted_as_all_equal():
    kept, n_void = filter_void_turns([traj(0, void_turns=1), traj(1, void_turns=1)])
    assert kept == [] and n_void == 2
    for sampler in DOWNSAMPLERS.values():
        assert sampler(kept, 4, random.Random(0)) == ([], {"dropped_all_equal": 0, "short_group": 0,
                                                           "n_pos": 0, "n_neg": 0})


# ----------------------------------------------------------------------------- mismatch corrections

def logps(rows, pad_trainer=1e4, base=-1.0):
    """(trainer_logp, sampler_logp, loss_mask), float64 (B, 4): row b holds the log-ratios log r of its
    loss tokens, then padding. The sampler's log-prob is `base` (0 where a test needs exact band edges),
    the trainer's base + log r, and pad_trainer on padding."""
    T = 4
    trainer = torch.full((len(rows), T), pad_trainer, dtype=torch.float64)
    sampler = torch.full((len(rows), T), base, dtype=torch.float64)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        for t, log_r in enumerate(row):
            trainer[b, t], mask[b, t] = base + log_r, 1
    return trainer, sampler, mask


L2 = math.log(2.0)


def test_tis_truncates_above_the_cap():
    trainer, sampler, mask = logps([[-L2, 0.0, math.log(3.0)], [2 * L2, -2 * L2]])   # r: .5 1 3 | 4 .25
    w, new_mask, m = mismatch_correction(trainer, sampler, mask, 5, "tis", 2.0)
    want = torch.tensor([[0.5, 1, 2, 0], [2, 0.25, 0, 0]], dtype=torch.float64)
    assert torch.allclose(w, want), f"{w} != min(r, 2) on loss tokens"
    assert torch.equal(new_mask, mask) and m["masked_frac"] == 0.0, "tis must not mask tokens"
    assert m["ess_sum_w"] == pytest.approx(5.75) and m["ess_sum_w2"] == pytest.approx(9.3125)
    assert m["ess_n"] == 5.0
    assert effective_sample_size(m["ess_sum_w"], m["ess_sum_w2"], m["ess_n"]) == \
        pytest.approx(5.75 ** 2 / (5 * 9.3125))


def test_mask_drops_tokens_outside_the_band_keeps_the_edge():
    trainer, sampler, mask = logps([[-L2, 0.0, math.log(3.0)], [L2, -2 * L2]], base=0.0)  # r: .5 1 3 | 2 .25
    w, new_mask, m = mismatch_correction(trainer, sampler, mask, 10, "mask", 2.0)
    assert torch.equal(new_mask, torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])), \
        "band [1/2, 2]: r = 3 and 1/4 must go, r = 1/2 and 2 (the edges) stay"
    want = torch.tensor([[0.5, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.float64)
    assert torch.allclose(w, want), "kept tokens must be weighted by r (masked importance sampling)"
    assert m["masked_frac"] == pytest.approx(2 / 10), "masked_frac not normalised by n_loss_tokens"
    assert (m["ess_sum_w"], m["ess_sum_w2"], m["ess_n"]) == pytest.approx((3.5, 5.25, 3.0))


@pytest.mark.parametrize("mode", ["mask", "seq-mask"])
@pytest.mark.parametrize("log_r, kept", [(L2, True), (-L2, True), (L2 + 1e-9, False), (-L2 - 1e-9, False)])
def test_band_edges(mode, log_r, kept):
    trainer, sampler, mask = logps([[log_r, log_r]], base=0.0)
    _, new_mask, m = mismatch_correction(trainer, sampler, mask, 2, mode, 2.0)
    assert torch.equal(new_mask, mask * kept), f"r = exp({log_r}) with C = 2: kept should be {kept}"
    assert m["masked_frac"] == (0.0 if kept else 1.0)


def test_seq_mask_judges_the_geometric_mean_over_loss_tokens_only():
    rows = [[2 * L2, -2 * L2, 0.0],     # r 4, 1/4, 1: geometric mean 1 -> kept
            [2 * L2],                   # geometric mean 4 -> out (a mean over padding too would keep it)
            [L2, L2]]                   # geometric mean 2: the edge -> kept
    trainer, sampler, mask = logps(rows, base=0.0)
    w, new_mask, m = mismatch_correction(trainer, sampler, mask, 6, "seq-mask", 2.0)
    assert w is None, "seq-mask rejects; it must not weight the rollouts it keeps"
    assert torch.equal(new_mask, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]))
    assert m["masked_frac"] == pytest.approx(1 / 6)
    assert (m["ess_sum_w"], m["ess_sum_w2"], m["ess_n"]) == pytest.approx((9.25, 25.0625, 5.0))


def test_none_changes_nothing_and_reports_the_raw_ratios():
    trainer, sampler, mask = logps([[-L2, L2, 0.0]])
    w, new_mask, m = mismatch_correction(trainer, sampler, mask, 3, "none", 0.0)
    assert w is None and torch.equal(new_mask, mask) and m["masked_frac"] == 0.0
    assert (m["ess_sum_w"], m["ess_sum_w2"], m["ess_n"]) == pytest.approx((3.5, 5.25, 3.0))


@pytest.mark.parametrize("mode", ["none", "tis", "mask", "seq-mask"])
def test_padding_never_affects_the_correction(mode):
    rows = [[-L2, 0.0, math.log(3.0)], [2 * L2]]
    tame = mismatch_correction(*logps(rows, pad_trainer=0.0), 4, mode, 2.0)
    wild = mismatch_correction(*logps(rows, pad_trainer=1e4), 4, mode, 2.0)   # exp(1e4) = inf
    assert tame[2] == wild[2] and torch.equal(tame[1], wild[1]), "padding changed the mask or metrics"
    if tame[0] is not None:
        assert torch.equal(tame[0], wild[0]) and torch.isfinite(wild[0]).all(), "padding leaked into weights"


def test_masked_tokens_get_no_gradient_but_stay_in_the_denominator():
    trainer, sampler, mask = logps([[-L2, 0.0, math.log(3.0)]], base=0.0)               # r: .5 1 3
    w, new_mask, _ = mismatch_correction(trainer, sampler, mask, 3, "mask", 2.0)
    logp = trainer.clone().requires_grad_()
    loss, _ = policy_loss(logp, trainer, torch.tensor([1.0], dtype=torch.float64), new_mask, 3,
                          token_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 1.0) / 3), "denominator must stay n_loss_tokens = 3"
    assert logp.grad[0, 2] == 0.0 and logp.grad[0, 0] != 0.0, "a masked token got gradient"


@pytest.mark.parametrize("mode, threshold", [("icepop", 2.0), ("mask", 1.0), ("tis", 0.5)])
def test_bad_settings_say_what_to_do(mode, threshold):
    with pytest.raises(ValueError, match="HINT"):
        mismatch_correction(*logps([[0.0]]), 1, mode, threshold)


def test_effective_sample_size_bounds():
    assert effective_sample_size(4.0, 4.0, 4) == 1.0, "equal weights must give ESS 1"
    assert effective_sample_size(1.0, 1.0, 4) == 0.25, "one nonzero weight of 4 must give 1/4"
    assert effective_sample_size(0.0, 0.0, 0) == 1.0


@pytest.mark.parametrize("setting, says", [("typo=1", "not a setting of --downsample roc"),
                                           ("positive_weight=nope", "unknown positive_weight 'nope'")])
def test_train_py_checks_the_downsamplers_settings_before_anything_slow(setting, says, tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "train.py", "--downsample-setting", setting, "--data", str(tmp_path / "x")],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and says in out.stderr and "HINT" in out.stderr, out.stderr[-1000:]
    assert "no such file" not in out.stderr, "the setting must be checked before the data is read"
