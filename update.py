"""The policy update of one RL step (train.py's step 4): GRPO-RoC's loss back-propagated through the model.

    settings = UpdateSettings.from_flags(args)
    policy = Policy(model, optimizer, pad_id, device, settings, rank, world_size, probes, reference)
    metrics = policy_update(policy, kept, advantages, problem_queue)

--mini-batches optimizer steps (one, as in the paper), each planned once into micro-batches across
ranks. optimizer_step is one step, whole: per micro-batch the log-probs, the loss, its backward; then
the clip and AdamW. The token-level loss (grpo_roc.py) has one global denominator, so any split gives
one big batch's gradient. World size 1 is the same code: tests run it on a tiny model without vLLM.
"""
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from grpo_roc import loss_denominator, mismatch_correction, policy_loss
from logprobs import SharedPrefix, empty_pass, shared_prefix_length, token_logprobs, trajectory_tensors
from lora import adapters_off
from training import plan_micro_batches

# The metrics of one optimizer step. Each term is already divided by n_loss_tokens, so the micro-batches'
# values add up; the largest mismatch and the gradient's norm follow. policy_update averages over steps.
SUMMED = ["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref", "logprob_mismatch",
          "masked_frac", "ess_sum_w", "ess_sum_w2", "ess_n"]
METRICS = SUMMED + ["logprob_mismatch_max", "grad_norm"]


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads, built once from train.py's flags of the same names, whose defaults these
    are: a new loss option is a field here and a flag there. Each (n) is an item of grpo_roc.py's list."""
    temperature: float = 1.0           # the sampler's: the trainer scores the same distribution
    eps_low: float = 0.2               # (7) the PPO clip below
    eps_high: float = 0.28             # (7) and above (Clip-Higher)
    mismatch_correction: str = "none"  # (11) none, tis, mask or seq-mask
    mismatch_threshold: float = 2.0    # (11) C, the edge of the band [1/C, C]
    kl_coef: float = 0.0               # (12) beta; 0: no reference policy, as in the paper
    mini_batches: int = 1              # optimizer steps per RL step
    grad_clip: float = 1.0             # the largest norm of the whole gradient
    micro_batch_tokens: int = 8192     # tokens per forward pass, rows packed without padding

    @classmethod
    def from_flags(cls, args) -> "UpdateSettings":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass
class Policy:
    """The model being trained and what its update reads. `probes`: prompts whose common start (the system
    prompt) runs once per micro-batch on CPUs. `reference`: train.py's, when kl_coef > 0."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_id: int
    device: torch.device
    settings: UpdateSettings
    rank: int = 0
    world_size: int = 1
    probes: list[list[int]] = field(default_factory=list)
    reference: torch.nn.Module | None = None

    def __post_init__(self):
        self.shared = 0 if self.device.type == "cuda" or not self.probes else shared_prefix_length(self.probes)


def policy_update(policy: Policy, kept, advantages, problem_queue) -> dict:
    """--mini-batches optimizer steps on contiguous parts of `kept` (whole groups when G divides a part),
    each planned once; each rank first receives the tokens of what it trains. Returns the metrics,
    summed over ranks and averaged over the steps (mismatch: the max)."""
    k = min(policy.settings.mini_batches, max(len(kept), 1))
    parts = []
    for j in range(k):
        part = range(j * len(kept) // k, (j + 1) * len(kept) // k)
        rows = [kept[i] for i in part]
        lengths = [t.prompt_length + t.response_length - policy.shared for t in rows]  # about what runs
        plan = plan_micro_batches(lengths, policy.settings.micro_batch_tokens, policy.world_size, packed=True)
        rows = problem_queue.exchange(rows, plan)  # from the rank that rolled each one out
        parts.append((rows, [advantages[i] for i in part], plan[policy.rank]))
    # From the second step on, the ratio is against the policy before the first: score every part now.
    old = [old_logprobs(policy, rows, mine) if k > 1 else None for rows, _, mine in parts]
    steps = [optimizer_step(policy, *part, part_old) for part, part_old in zip(parts, old)]
    row = mean_over_steps(steps, METRICS, policy.device)
    row["ess"] = effective_sample_size(row.pop("ess_sum_w"), row.pop("ess_sum_w2"), row.pop("ess_n"))
    row["optimizer_steps"] = k
    return row


def optimizer_step(policy: Policy, kept, advantages, micro_batches, old) -> dict:
    """One optimizer step on this rank's `micro_batches` of `kept` (lists of indices; an empty one still
    runs a pass: FSDP needs every rank in every pass). `old`: per micro-batch, the log-probs the ratio is
    against, or None in the first step (ratio 1). Returns this rank's metric sums, each / n_loss_tokens."""
    s, model, device = policy.settings, policy.model, policy.device
    n_loss_tokens = max(1, sum(t.num_loss_tokens for t in kept))  # the metrics' global denominator (8)
    denominator = loss_denominator(kept)                           # the loss's (7), the same on every rank
    prefix = shared_prefix(policy, kept, micro_batches)
    sums = dict.fromkeys(METRICS, 0.0)
    for micro_batch, old_logp in zip(micro_batches, old or [None] * len(micro_batches)):
        if not micro_batch:
            empty_pass(model, policy.pad_id, device)
            reference_logprobs(policy, kept, micro_batch)  # the reference's own empty pass
            continue
        input_ids, attention_mask, loss_mask, sampler_logp = trajectory_tensors(
            [kept[i] for i in micro_batch], policy.pad_id, device)
        # Packed rows; on GPUs each chunk's head is recomputed in the backward, on CPUs its logits are kept.
        logp = token_logprobs(model, input_ids, attention_mask, s.temperature, prefix=prefix,
                              recompute=device.type == "cuda", packed=True)                  # (B, T-1)
        # The reference runs after the policy: FSDP sets a model up at its first pass from the parameters
        # that train then, and under LoRA the reference is the policy with none training.
        ref_logp = reference_logprobs(policy, kept, micro_batch)  # (B, T-1), or None without --kl-coef
        if old_logp is None:  # the first step: the policy before it is this one, the ratio 1
            old_logp = logp.detach()                                                        # (B, T-1)
        adv = torch.tensor([advantages[i] for i in micro_batch], device=device)            # (B,)
        # The sampler drew these tokens, not the trainer: an optional correction (grpo_roc.py (11)).
        weights, kept_mask, stats = mismatch_correction(old_logp, sampler_logp, loss_mask, n_loss_tokens,
                                                        s.mismatch_correction, s.mismatch_threshold)
        loss, metrics = policy_loss(logp, old_logp, adv, kept_mask, n_loss_tokens, s.eps_low, s.eps_high,
                                    token_weights=weights, denominator=denominator, ref_logp=ref_logp,
                                    kl_coef=s.kl_coef)
        # FSDP averages the gradients over ranks, while the denominator already counts every rank's tokens.
        (loss * policy.world_size).backward()
        mismatch = (logp.detach() - sampler_logp).abs() * loss_mask                        # (B, T-1)
        metrics.update(stats, loss=loss.item(), logprob_mismatch=mismatch.sum().item() / n_loss_tokens)
        for key in SUMMED:
            sums[key] += metrics[key]
        sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], mismatch.max().item())
    if prefix is not None:
        prefix.backward()  # the gradient every micro-batch left on the shared prefix goes through it once
    if policy.reference is not None and policy.reference is not model:
        policy.reference.reshard()  # FSDP keeps a root's weights gathered for a backward that never comes
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    if kept:  # a step where every group was dropped changes nothing
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    # Every rank holds the whole norm, and mean_over_steps sums the ranks' values: divide here.
    return dict(sums, grad_norm=grad_norm.item() / policy.world_size)


@torch.no_grad()
def old_logprobs(policy: Policy, kept, micro_batches) -> list[torch.Tensor | None]:
    """The current policy's log-probs of each of this rank's `micro_batches` of `kept`, (B, T-1) as the
    step will compute them; None for an empty micro-batch."""
    prefix = shared_prefix(policy, kept, micro_batches)
    return [scores(policy, policy.model, kept, micro_batch, prefix) for micro_batch in micro_batches]


def reference_logprobs(policy: Policy, kept, micro_batch) -> torch.Tensor | None:
    """The reference policy's log-probs of one micro-batch (B, T-1); None without a reference. The prompts
    run whole: with no backward to share, running their common start once saves little."""
    if policy.reference is None:
        return None
    with adapters_off(policy.reference):  # under LoRA the reference is the policy without its adapters
        return scores(policy, policy.reference, kept, micro_batch)


@torch.no_grad()
def scores(policy: Policy, model, kept, micro_batch, prefix=None) -> torch.Tensor | None:
    """`model`'s log-probs of one micro-batch of `kept` (B, T-1), by the function that scores the policy
    in the step, without gradients; for an empty micro-batch an empty pass, and None."""
    if not micro_batch:
        empty_pass(model, policy.pad_id, policy.device)
        return None
    input_ids, attention_mask, _, _ = trajectory_tensors([kept[i] for i in micro_batch], policy.pad_id,
                                                         policy.device)
    return token_logprobs(model, input_ids, attention_mask, policy.settings.temperature, prefix=prefix,
                          recompute=False, packed=True)  # (B, T-1): no backward to recompute for


def shared_prefix(policy: Policy, kept, micro_batches) -> SharedPrefix | None:
    """The probes' common start, or less if a row of this rank lacks it, run once through the policy on
    every rank, as FSDP needs; None on GPUs and without probes."""
    if not policy.shared:
        return None
    mine = [kept[i].prompt_ids for batch in micro_batches for i in batch] + policy.probes[:1]
    length = min(policy.shared, shared_prefix_length(mine))
    return SharedPrefix(policy.model, torch.tensor(policy.probes[0][:length], device=policy.device))


def mean_over_steps(steps: list[dict], keys: list[str], device) -> dict:
    """Each key of one dict per optimizer step: summed over ranks, then averaged over the steps; a key
    ending in "_max" is the largest instead. In float64: sums of many small terms keep their digits."""
    values = torch.tensor([[s[k] for k in keys] for s in steps], dtype=torch.float64).to(device)  # (K, keys)
    total, highest = values.clone(), values.clone()
    dist.all_reduce(total)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)                   # (keys,)
    return dict(zip(keys, torch.where(is_max, highest.max(0).values, total.mean(0)).tolist()))


def effective_sample_size(sum_w, sum_w2, n) -> float:
    """grpo_roc.py (11): (sum w)^2 / (n sum w^2) in (0, 1]: 1 for equal weights, 1/n when one dominates (a
    common scale cancels: sums over micro-batches and ranks, or their means over steps, give the same)."""
    if n <= 0:
        return 1.0          # no token kept: nothing to weigh
    if sum_w2 <= 0:
        return 0.0          # every weight underflowed to 0
    return sum_w * sum_w / (n * sum_w2)
