"""GRPO-RoC: Resample-on-Correct down-sampling, group advantages, the clipped loss, and its guards.

What this file does (paper §2.2.3, Eq. 4-7) and where it departs from the paper
(docs/paper_differences.md also compares it with the official code):

1. Penalties of a correct rollout. p_err = failed tool calls / tool calls, 0.5 without a call (to
   encourage tool use), counted from the sandbox's status, not the output's text. p_format = 1 without
   an <answer> or with unmatched answer tags (the official code's rule), else min(1, (#answers - 1) /
   #turns), counting every assistant turn.
2. Groups whose rewards are all equal are dropped: zero advantages, no gradient. No refill. The reward
   decides here, as in train.py's dynamic sampling; correctness decides (3) and (4), so a correct
   rollout that a shaped reward (rollout.reward) scores <= 0 is still a positive, as in the paper.
3. Negatives (the incorrect rollouts): floor(|neg| / 2) kept uniformly at random, at least one if any:
   the paper's floor keeps none of a single negative, and the group would then be all correct.
4. Positives (the correct rollouts) fill the rest of G, drawn without replacement with probability
   proportional to 1 / (p_total + 1e-3) (POSITIVE_WEIGHTS). Short of positives, negatives fill G; a group
   of at most G is kept whole (`short_group` if < G).
5. `downsample_uniform`, the paper's "GRPO with tool" ablation at equal compute: (2), then G of 2G uniformly.
6. Advantage: (r - mean) / (std + 1e-6) over the kept G, unbiased std (as verl); 0 for a group of one.
7. Loss: PPO clip with Clip-Higher (EPS_LOW 0.2, EPS_HIGH 0.28), token-level as in DAPO: the token
   losses summed over the optimizer step's loss tokens on every rank (the denominator is policy_loss's),
   so any split into micro-batches and ranks gives one big batch's gradient. No entropy bonus, no dual
   clip, no KL unless (12) adds it. With one optimizer step per RL step (--mini-batches 1, as in the
   paper) the ratio is 1 and the clip never acts. The old log-probs are the trainer's own, so the
   sampler's mismatch never enters the ratio; (11) weighs tokens for it.
8. Loss metrics are normalised by `n_loss_tokens`, so they add up to step-level means (the policy's
   entropy among them).
9. Sandbox failures (always on): such a rollout has no outcome and leaves before its reward is read;
   its group leaves too when fewer than G would remain, since it would be judged on less evidence.
10. Void turns (SimpleTIR, arXiv 2509.02479; off by default): a rollout with a turn that ended with
   neither a tool call nor an answer leaves before (2).
11. Sampler/trainer mismatch (off by default), per loss token r = p_trainer / p_sampler: "tis" weighs by
   min(r, C); "mask" (IcePop) drops tokens with r outside [1/C, C] and weighs the others by r; "seq-mask"
   drops a rollout whose geometric-mean r is outside [1/C, C]. Dropped tokens still count (IcePop).
12. KL to a reference policy, GRPO's term (off by default, as in rStar2-Agent): beta x k3 per kept loss
   token, k3 = exp(ref - logp) - (ref - logp) - 1, over (7)'s denominator. (11)'s weights correct how
   the advantage term was sampled, so they leave the penalty alone.
"""
import math
import random

import torch

from rollout import Trajectory

PENALTY_EPS = 1e-3   # (4) keeps 1 / p_total finite for a flawless rollout
ADV_EPS = 1e-6       # (6) verl's value
EPS_LOW = 0.2        # (7) the PPO clip below (train.py's --eps-low)
EPS_HIGH = 0.28      # (7) and above, higher (Clip-Higher: --eps-high)


# -----------------------------------------------------------------------------
# (1) penalties of a correct rollout

def tool_error_penalty(traj: Trajectory) -> float:
    """Failed tool calls / tool calls; 0.5 when the rollout made no call."""
    if traj.tool_calls == 0:
        return 0.5
    return min(1.0, traj.num_tool_failures / traj.tool_calls)


def format_penalty(traj: Trajectory) -> float:
    """1 without an <answer> or with unmatched answer tags (a run of </answer> after the answer), else
    min(1, (#answers - 1) / #turns)."""
    if traj.num_answers == 0 or not traj.answer_tags_match:
        return 1.0
    return min(1.0, (traj.num_answers - 1) / max(traj.num_turns, 1))


def roc_weight(traj: Trajectory) -> float:
    """(4) A positive's weight in RoC's draw: 1 / (p_total + eps), p_total = p_err + p_format."""
    return 1.0 / (tool_error_penalty(traj) + format_penalty(traj) + PENALTY_EPS)


POSITIVE_WEIGHTS = {"roc": roc_weight}  # (4) resample_on_correct's positive_weight names one


# -----------------------------------------------------------------------------
# (2)-(5), (9)-(10): the rollouts that leave a problem's pool, then down-sampling 2G of them to G

def drop_sandbox_failures(group: list[Trajectory], group_size: int):
    """(9) The group without its sandbox-failed rollouts, or [] when fewer than G would remain.
    A group that was short before any failure is left to (4). Returns (kept, n_failed)."""
    kept = [t for t in group if not t.sandbox_failed]
    n_failed = len(group) - len(kept)
    return ([] if n_failed and len(kept) < group_size else kept), n_failed


def filter_void_turns(group: list[Trajectory]):
    """(10) The group without rollouts that have a void turn. Returns (kept, n_void)."""
    kept = [t for t in group if t.void_turns == 0]
    return kept, len(group) - len(kept)


def _stats(dropped=0, short=0, kept=()):
    n_pos = sum(1 for t in kept if t.correct)
    return {"dropped_all_equal": dropped, "short_group": short, "n_pos": n_pos, "n_neg": len(kept) - n_pos}


def _weighted_sample(items, weights, k, rng):
    """k items without replacement, each draw among those left in proportion to their weights."""
    items, weights, chosen = list(items), list(weights), []
    for _ in range(min(k, len(items))):
        i = rng.choices(range(len(items)), weights=weights)[0]
        chosen.append(items.pop(i))
        weights.pop(i)
    return chosen


def _prefilter(group, group_size):
    """(2) and the short-group rule of (4), for both down-samplers: (kept, stats) if decided, else None."""
    if not group:
        return [], _stats()  # (9) or (10) emptied it; an empty group is not an all-equal one
    if len({t.reward for t in group}) <= 1:
        return [], _stats(dropped=1)
    if len(group) <= group_size:
        return list(group), _stats(short=int(len(group) < group_size), kept=group)
    return None


def resample_on_correct(group: list[Trajectory], group_size: int, rng: random.Random,
                        positive_weight: str = "roc", **settings):
    """GRPO-RoC: one problem's rollouts down to `group_size`, positives drawn by positive_weight (4)."""
    if positive_weight not in POSITIVE_WEIGHTS:
        raise ValueError(f"unknown positive_weight {positive_weight!r}\n---> HINT: {sorted(POSITIVE_WEIGHTS)}")
    decided = _prefilter(group, group_size)
    if decided is not None:
        return decided
    pos = [t for t in group if t.correct]
    neg = [t for t in group if not t.correct]
    n_neg = min(max(1, len(neg) // 2), group_size - 1) if neg else 0  # (3) leaves room for a positive
    n_pos = min(len(pos), group_size - n_neg)               # (4)
    n_neg = min(len(neg), group_size - n_pos)               # (4) short of positives, negatives fill G
    kept_neg = rng.sample(neg, n_neg)                       # (3)
    weights = [POSITIVE_WEIGHTS[positive_weight](t) for t in pos]
    kept_pos = _weighted_sample(pos, weights, n_pos, rng)   # (4)
    kept = [t for t in group if any(t is c for c in kept_neg + kept_pos)]  # in the group's order
    return kept, _stats(kept=kept)


def downsample_uniform(group: list[Trajectory], group_size: int, rng: random.Random, **settings):
    """(5) The ablation without RoC."""
    decided = _prefilter(group, group_size)
    if decided is not None:
        return decided
    kept = [group[i] for i in sorted(rng.sample(range(len(group)), group_size))]  # (the same draw)
    return kept, _stats(kept=kept)


# A down-sampler is fn(group, group_size, rng, **settings) -> (kept in the group's order, stats summed over
# groups). DOWNSAMPLER_SETTINGS declares what --downsample-setting may set; its signature, the defaults.
DOWNSAMPLERS = {"roc": resample_on_correct, "uniform": downsample_uniform}
DOWNSAMPLER_SETTINGS = {"roc": {"positive_weight": "a name in POSITIVE_WEIGHTS (4)"}, "uniform": {}}


# -----------------------------------------------------------------------------
# (6)-(8) group advantages and the clipped token-level policy loss

def group_advantages(rewards) -> torch.Tensor:
    """(6) Advantages of one kept group; (G,)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()  # (G,)
    if r.numel() < 2:
        return torch.zeros_like(r)  # a group of one has nothing to be compared with
    return (r - r.mean()) / (r.std(unbiased=True) + ADV_EPS)  # (G,)


def policy_loss(logp, old_logp, advantages, loss_mask, n_loss_tokens, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                token_weights=None, ref_logp=None, kl_coef=0.0, entropy=None):
    """(7) PPO-clip with Clip-Higher over n_loss_tokens, the optimizer step's on every rank. Only logp
    (B, T) carries the gradient; advantages (B,) apply to all a row's tokens; token_weights (B, T) are
    (11)'s, ref_logp (B, T) adds (12); entropy (B, T) is measured. Each metric is a masked sum /
    n_loss_tokens (8): the clipped shares, ratio_mean, approx_kl (k3 to old_logp), kl_ref (k3 to ref)
    and entropy."""
    mask = loss_mask.to(torch.bool)                                        # (B, T)
    loss_mask = mask.to(logp.dtype)                                        # (B, T)
    # Padding could make inf * 0 = nan, so the log-ratio is zero off the mask.
    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    ratio = torch.exp(log_ratio)                                           # (B, T)
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)                  # (B, 1)
    unclipped = ratio * adv                                                # (B, T)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv      # (B, T)
    per_token = -torch.minimum(unclipped, clipped)                         # (B, T)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()                     # (B, T)
    ref_logp = logp.detach() if ref_logp is None else ref_logp.detach()    # (B, T)
    ref_log_ratio = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))  # (B, T)
    kl_ref = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0                # (B, T) (12) k3
    per_token = per_token + kl_coef * kl_ref                               # (B, T)
    loss = (per_token * loss_mask).sum() / n_loss_tokens                   # (7) DAPO's token-level mean

    with torch.no_grad():
        n = float(n_loss_tokens)
        low = (adv < 0) & (ratio < 1.0 - eps_low) & mask                   # (B, T)
        high = (adv > 0) & (ratio > 1.0 + eps_high) & mask                 # (B, T)
        k3 = (ratio - 1.0) - log_ratio                                     # (B, T)
        metrics = {
            "clip_frac_low": low.sum().item() / n,
            "clip_frac_high": high.sum().item() / n,
            "ratio_mean": (ratio * loss_mask).sum().item() / n,
            "approx_kl": (k3 * loss_mask).sum().item() / n,
            "kl_ref": (kl_ref * loss_mask).sum().item() / n,
            "entropy": (entropy * loss_mask).sum().item() / n if entropy is not None else 0.0,
        }
    return loss, metrics


MISMATCH_MODES = ("none", "tis", "mask", "seq-mask")  # (11) the sampler/trainer mismatch


def mismatch_correction(trainer_logp, sampler_logp, loss_mask, n_loss_tokens, mode, threshold):
    """(11) Token weights (B, T) or None, the loss mask with dropped tokens 0, and metrics that add up
    over micro-batches and ranks: the dropped share and the sums update.effective_sample_size reads."""
    if mode not in MISMATCH_MODES:
        raise ValueError(f"unknown mismatch correction {mode!r}\n---> HINT: use one of {MISMATCH_MODES}")
    if mode != "none" and not threshold > 1.0:
        raise ValueError(f"mismatch threshold {threshold} must be > 1 (the band is [1/C, C])\n"
                         "---> HINT: e.g. 2 for tis and mask, 1.001 for seq-mask")
    mask = loss_mask.to(torch.bool)                                                     # (B, T)
    diff = trainer_logp.detach().double() - sampler_logp.detach().double()              # (B, T)
    log_ratio = torch.where(mask, diff, torch.zeros_like(diff))  # r = 1 off the mask, so never inf or nan
    keep = mask                                                                         # (B, T)
    if mode == "mask":
        keep = mask & (log_ratio.abs() <= math.log(threshold))                          # (B, T)
    elif mode == "seq-mask":
        seq_log_ratio = log_ratio.sum(1) / mask.sum(1).clamp(min=1)                     # (B,) log geo-mean
        keep = mask & (seq_log_ratio.abs() <= math.log(threshold)).unsqueeze(1)         # (B, T)
    w = torch.exp(log_ratio)                                                            # (B, T)
    if mode == "tis":
        w = w.clamp(max=threshold)                                                      # (B, T)
    w = torch.where(keep, w, torch.zeros_like(w))                                       # (B, T)
    weights = w.to(trainer_logp.dtype) if mode in ("tis", "mask") else None             # (B, T)
    metrics = {
        "masked_frac": (mask & ~keep).sum().item() / float(n_loss_tokens),
        "ess_sum_w": w.sum().item(),
        "ess_sum_w2": (w * w).sum().item(),
        "ess_n": float(keep.sum().item()),
    }
    return weights, loss_mask * keep, metrics

