"""GRPO-RoC: penalties, down-sampling, advantages and the clipped loss."""
import math
import random

import pytest
import torch

from grpo_roc import (PENALTY_EPS, downsample_uniform, format_penalty, group_advantages,
                      policy_loss, resample_on_correct, tool_error_penalty)
from rollout import Trajectory


def traj(reward, calls=1, failures=None, answers=1, turns=2, index=0):
    return Trajectory(index=index, prompt_ids=[1], reward=float(reward), tool_calls=calls,
                      tool_failures=dict(failures or {}), num_answers=answers, num_turns=turns)


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


# ----------------------------------------------------------------------------- down-sampling

@pytest.mark.parametrize("sampler", [resample_on_correct, downsample_uniform])
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


def test_short_group_is_kept_whole_and_flagged():
    group = group_of(1, 2)
    for sampler in (resample_on_correct, downsample_uniform):
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
            "ablation stats differ from RoC's; train.py cannot switch with --no-roc"
        for t in kept:
            hits[id(t)] += 1
    for t in group:
        assert abs(hits[id(t)] / n - 0.5) < 5 * math.sqrt(0.25 / n), "uniform ablation is biased"


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
