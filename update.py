"""The policy update of one RL step (train.py's step 4): GRPO-RoC's loss back-propagated through the model.

    policy = Policy(model, optimizer, pad_id, device, args, rank, world_size, probes)
    metrics = policy_update(policy, kept, advantages, problem_queue)

--mini-batches optimizer steps (one, as in the paper), each dealt across ranks by token count and
packed into micro-batches (training.plan_micro_batches); the token-level clipped loss (grpo_roc.py)
divided by one global denominator, so any split gives the gradient of one big batch; AdamW. With one
process (world size 1) it is the same code, which is how tests run it on a tiny model without vLLM.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo_roc import loss_denominator, mismatch_correction, policy_loss
from logprobs import (SharedPrefix, empty_pass, right_pad, shared_prefix_length, token_logprobs,
                      trajectory_tensors)
from training import plan_micro_batches

# The metrics of one optimizer step: sums over its micro-batches (each term already / n_loss_tokens),
# then the largest mismatch of a token and the gradient's norm; policy_update averages them over steps.
SUMMED = ["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "logprob_mismatch",
          "masked_frac", "ess_sum_w", "ess_sum_w2", "ess_n"]
METRICS = SUMMED + ["logprob_mismatch_max", "grad_norm"]


@dataclass
class Policy:
    """The model being trained and what its update reads. `args`: the update's flags (temperature,
    micro_batch_tokens, mini_batches, eps_low, eps_high, grad_clip, mismatch_correction,
    mismatch_threshold); `probes`: prompts whose common start (the system prompt) runs once per
    micro-batch on CPUs, where there is no activation checkpointing to drop its cache."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_id: int
    device: torch.device
    args: object
    rank: int = 0
    world_size: int = 1
    probes: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.shared = 0 if self.device.type == "cuda" or not self.probes else shared_prefix_length(self.probes)


def shared_prefix(policy: Policy, kept):
    """The probes' common start, or less if a row of this rank lacks it, run once (on every rank: FSDP)."""
    if not policy.shared:
        return None
    mine = [kept[i].prompt_ids for batch in micro_batches(policy, kept)[policy.rank] for i in batch]
    mine += policy.probes[:1]
    prefix_ids = torch.tensor(policy.probes[0][:min(policy.shared, shared_prefix_length(mine))],
                              device=policy.device)
    return SharedPrefix(policy.model, prefix_ids)


def micro_batches(policy: Policy, kept) -> list[list[list[int]]]:
    """Every rank's micro-batches of `kept`, as lists of indices (empty ones keep FSDP in step)."""
    lengths = [t.prompt_length + t.response_length - policy.shared for t in kept]  # about the tokens that run
    return plan_micro_batches(lengths, policy.args.micro_batch_tokens, policy.world_size, packed=True)


def forward(policy: Policy, kept, prefix):
    """This rank's micro-batches of `kept`: (indices, logprobs.trajectory_tensors, log-probs (B, T-1)); an
    empty pass in place of an empty one (FSDP needs every rank in every pass)."""
    model, device = policy.model, policy.device
    for micro_batch in micro_batches(policy, kept)[policy.rank]:
        if not micro_batch:
            empty_pass(model, policy.pad_id, device)
            continue
        tensors = trajectory_tensors([kept[i] for i in micro_batch], policy.pad_id, device)
        # (rows packed without padding; on GPUs each chunk's head is recomputed in the backward, on
        # CPUs its logits are kept)
        yield micro_batch, tensors, token_logprobs(model, *tensors[:2], policy.args.temperature, prefix=prefix,
                                                   recompute=device.type == "cuda", packed=True)


@torch.no_grad()
def old_logprobs(policy: Policy, kept) -> list[torch.Tensor | None]:
    """The current policy's log-probs of this rank's trajectories of `kept` (the same micro-batches
    optimizer_step will run), per trajectory; None for the trajectories other ranks train."""
    out = [None] * len(kept)
    for micro_batch, _, logp in forward(policy, kept, shared_prefix(policy, kept)):
        for row, i in enumerate(micro_batch):  # each trajectory's own positions, without padding
            out[i] = logp[row, :kept[i].prompt_length + kept[i].response_length - 1].cpu()
    return out


def optimizer_step(policy: Policy, kept, advantages, old) -> dict:
    """One optimizer step on `kept`; this rank's metric sums (each already / n_loss_tokens)."""
    args, device, world_size = policy.args, policy.device, policy.world_size
    n_loss_tokens = max(1, sum(t.num_loss_tokens for t in kept))  # the metrics' global denominator (8)
    denominator = loss_denominator(kept)                           # the loss's (7), the same on every rank
    sums, prefix = dict.fromkeys(METRICS, 0.0), shared_prefix(policy, kept)
    for micro_batch, (_, _, loss_mask, sampler_logp), logp in forward(policy, kept, prefix):
        adv = torch.tensor([advantages[i] for i in micro_batch], device=device)                # (B,)
        if old is None:  # one step per RL step: the policy before the step is this one (ratio 1)
            old_logp = logp.detach()
        else:
            old_logp = right_pad([old[i].tolist() for i in micro_batch], 0.0).to(device)       # (B, T-1)
        # the sampler drew these tokens, not the trainer: an optional correction (grpo_roc.py)
        weights, kept_mask, stats = mismatch_correction(old_logp, sampler_logp, loss_mask, n_loss_tokens,
                                                        args.mismatch_correction, args.mismatch_threshold)
        loss, metrics = policy_loss(logp, old_logp, adv, kept_mask, n_loss_tokens, args.eps_low,
                                    args.eps_high, token_weights=weights, denominator=denominator)
        (loss * world_size).backward()  # FSDP averages gradients over ranks: undo it
        mismatch = (logp.detach() - sampler_logp).abs() * loss_mask                            # (B, T-1)
        metrics.update(stats, loss=loss.item(), logprob_mismatch=mismatch.sum().item() / n_loss_tokens)
        for k in SUMMED:
            sums[k] += metrics[k]
        sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], mismatch.max().item())
    if prefix is not None:
        prefix.backward()  # (the gradient the micro-batches left on the shared prefix, through it once)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), args.grad_clip)
    if kept:  # a step where every group was dropped changes nothing
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return dict(sums, grad_norm=grad_norm.item() / world_size)  # (every rank has it: their sum is it)


def mean_over_steps(steps: list[dict], keys: list[str], device) -> dict:
    """Each key of one dict per optimizer step: summed over ranks, then averaged over the steps; a key
    ending in "_max" is the largest instead. In float64: sums of many small terms keep their digits."""
    values = torch.tensor([[s[k] for k in keys] for s in steps], dtype=torch.float64).to(device)  # (K, keys)
    total, highest = values.clone(), values.clone()
    dist.all_reduce(total)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)                   # (keys,)
    return dict(zip(keys, torch.where(is_max, highest.max(0).values, total.mean(0)).tolist()))


def policy_update(policy: Policy, kept, advantages, problem_queue) -> dict:
    """--mini-batches optimizer steps on the kept trajectories, contiguous parts of them (whole groups
    stay together when G divides a part). Each rank first receives the tokens of the ones it trains.
    Returns the metrics, summed over ranks and averaged over the steps (mismatch: the max)."""
    k = min(policy.args.mini_batches, max(len(kept), 1))
    parts = []
    for j in range(k):  # every rank receives the tokens of what it trains, from the rank that rolled it out
        part = range(j * len(kept) // k, (j + 1) * len(kept) // k)
        rows = [kept[i] for i in part]
        rows = problem_queue.exchange(rows, micro_batches(policy, rows))
        parts.append((rows, [advantages[i] for i in part]))
    old = [old_logprobs(policy, rows) if k > 1 else None for rows, _ in parts]  # all before the first step
    steps = []
    for (rows, part_advantages), part_old in zip(parts, old):
        steps.append(optimizer_step(policy, rows, part_advantages, part_old))
    row = mean_over_steps(steps, METRICS, policy.device)
    row["ess"] = effective_sample_size(row.pop("ess_sum_w"), row.pop("ess_sum_w2"), row.pop("ess_n"))
    row["optimizer_steps"] = k
    return row


def effective_sample_size(sum_w, sum_w2, n) -> float:
    """grpo_roc.py (11): (sum w)^2 / (n sum w^2) in (0, 1]: 1 for equal weights, 1/n when one dominates (a
    common scale cancels: sums over micro-batches and ranks, or their means over steps, give the same)."""
    if n <= 0:
        return 1.0          # no token kept: nothing to weigh
    if sum_w2 <= 0:
        return 0.0          # every weight underflowed to 0
    return sum_w * sum_w / (n * sum_w2)
