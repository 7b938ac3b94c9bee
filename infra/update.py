"""What the policy update needs and a reader need not see first. train.py's policy update is the loop itself:
for each mini-batch, for each micro-batch, the log-probs, grpo_roc.policy_loss, backward; then the clip
and the optimizer step. This file hands that loop its mini-batches (mini_batches) and each one's
micro-batches (iterating a MiniBatch), adds up their metrics (record) and reports them (step_metrics).

What it hides: each rank receives the tokens of the rollouts it trains (the exchange); each mini-batch
is dealt across ranks by token count and packed into micro-batches, the same number on every rank, and
a rank with none left runs an empty pass (FSDP's collectives need every rank in every pass); on CPUs the
prompts' common start runs once per mini-batch and the gradient the micro-batches leave on it goes back
through it once, after the last; the old log-probs of every mini-batch after the first are taken before
the first step; the reference policy's log-probs (--kl-coef); the loss's scaling by the world size.
World size 1 is the same code: tests/test_update.py runs train.py's policy update on a tiny model, no vLLM.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infra.logprobs import SharedPrefix, empty_pass, shared_prefix_length, token_logprobs, trajectory_tensors
from infra.lora import adapters_off
from infra.training import plan_micro_batches

# The metrics of one optimizer step. Each term is already divided by n_loss_tokens, so the micro-batches'
# values add up; the largest mismatch and the gradient's norm follow. step_metrics averages over steps.
SUMMED = ["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref", "entropy",
          "logprob_mismatch", "masked_frac", "ess_sum_w", "ess_sum_w2", "ess_n"]
METRICS = SUMMED + ["logprob_mismatch_max", "grad_norm"]


@dataclass
class Policy:
    """The model being trained, as the update's infrastructure needs it. `temperature`: the sampler's,
    so the trainer scores the distribution the rollouts came from. `probes`: prompts whose common start
    (the system prompt) runs once per micro-batch on CPUs. `reference`: train.py's, with --kl-coef."""
    model: torch.nn.Module
    pad_id: int
    device: torch.device
    temperature: float
    micro_batch_tokens: int
    rank: int = 0
    world_size: int = 1
    probes: list[list[int]] = field(default_factory=list)
    reference: torch.nn.Module | None = None

    def __post_init__(self):
        on_gpu = self.device.type == "cuda"
        self.shared = 0 if on_gpu or not self.probes else shared_prefix_length(self.probes)


@dataclass
class MicroBatch:
    """One micro-batch on this rank, as the loss reads it: B rows of T tokens, right-padded."""
    input_ids: torch.Tensor        # (B, T)
    attention_mask: torch.Tensor   # (B, T)
    loss_mask: torch.Tensor        # (B, T-1): 1 on the tokens the policy sampled, 0 on prompts and tool turns
    sampler_logp: torch.Tensor     # (B, T-1): the engine's log-probs of those tokens
    advantages: torch.Tensor       # (B,)
    old_logp: torch.Tensor | None  # (B, T-1): the policy before the RL step's first optimizer step, or None
    prefix: SharedPrefix | None    # the common start every row begins with, run once (token_logprobs)
    policy: Policy

    def reference_logprobs(self) -> torch.Tensor | None:
        """The reference policy's log-probs (B, T-1), or None without one. Called after the policy's pass:
        FSDP sets a model up at its first pass from the parameters that train then, and under LoRA the
        reference is the policy with its adapters off. The prompts run whole (no backward to share)."""
        if self.policy.reference is None:
            return None
        with adapters_off(self.policy.reference):
            return scores(self.policy, self.policy.reference, self.input_ids, self.attention_mask)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), times the world size: FSDP averages the gradients over ranks, while the loss's
        denominator already counts every rank's tokens."""
        (loss * self.policy.world_size).backward()


class MiniBatch:
    """The rollouts of one optimizer step. `n_loss_tokens` and `n_rollouts`: theirs on every rank, for
    the loss's denominator. Iterating gives this rank's micro-batches, with FSDP's empty passes between them; when
    the last is done, the shared prefix's gradient goes back through it and the reference lets go of its
    gathered weights, so the loop then clips and steps. record() adds up each micro-batch's metrics."""

    def __init__(self, policy: Policy, rows: list, advantages: list, micro_batches: list, old: list):
        self.policy, self.rows, self.advantages, self.micro_batches = policy, rows, advantages, micro_batches
        self.old = old  # per micro-batch: the log-probs the ratio is against, or None (the first step)
        self.n_loss_tokens = max(1, sum(t.num_loss_tokens for t in rows))
        self.n_rollouts = max(1, len(rows))
        self.sums = dict.fromkeys(METRICS, 0.0)

    def __iter__(self):
        policy = self.policy
        prefix = shared_prefix(policy, self.rows, self.micro_batches)
        for micro_batch, old_logp in zip(self.micro_batches, self.old):
            if not micro_batch:
                empty_pass(policy.model, policy.pad_id, policy.device)
                if policy.reference is not None:  # the reference's own empty pass
                    with adapters_off(policy.reference):
                        empty_pass(policy.reference, policy.pad_id, policy.device)
                continue
            tensors = trajectory_tensors([self.rows[i] for i in micro_batch], policy.pad_id, policy.device)
            advantages = torch.tensor([self.advantages[i] for i in micro_batch], device=policy.device)  # (B,)
            yield MicroBatch(*tensors, advantages, old_logp, prefix, policy)
        if prefix is not None:
            prefix.backward()  # the gradient every micro-batch left on the shared prefix goes through it once
        if policy.reference is not None and policy.reference is not policy.model:
            policy.reference.reshard()  # FSDP keeps a root's weights gathered for a backward that never comes

    def record(self, logp: torch.Tensor, micro: MicroBatch, metrics: dict) -> None:
        """Adds one micro-batch's metrics (each a sum / n_loss_tokens) and how far the trainer's log-probs
        are from the sampler's."""
        mismatch = (logp.detach() - micro.sampler_logp).abs() * micro.loss_mask                 # (B, T-1)
        metrics = dict(metrics, logprob_mismatch=mismatch.sum().item() / self.n_loss_tokens)
        for key in SUMMED:
            self.sums[key] += metrics.get(key, 0.0)
        self.sums["logprob_mismatch_max"] = max(self.sums["logprob_mismatch_max"], mismatch.max().item())

    def record_grad_norm(self, grad_norm) -> None:
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # Every rank holds the whole norm, and step_metrics sums the ranks' values: divide here.
        self.sums["grad_norm"] = float(grad_norm) / self.policy.world_size


def mini_batches(policy: Policy, kept: list, advantages: list, problem_queue, k: int = 1) -> list[MiniBatch]:
    """The RL step's kept rollouts as min(k, len(kept)) contiguous parts (whole groups when G divides a
    part), each planned once into micro-batches across ranks; each rank first receives the tokens of what
    it trains. With k > 1 the ratio of every part is against the policy before the first optimizer step:
    each part is scored now."""
    k = min(k, max(len(kept), 1))
    parts = []
    for j in range(k):
        part = range(j * len(kept) // k, (j + 1) * len(kept) // k)
        rows = [kept[i] for i in part]
        lengths = [t.prompt_length + t.response_length - policy.shared for t in rows]  # about what runs
        plan = plan_micro_batches(lengths, policy.micro_batch_tokens, policy.world_size, packed=True)
        rows = problem_queue.exchange(rows, plan)  # from the rank that rolled each one out
        parts.append((rows, [advantages[i] for i in part], plan[policy.rank]))
    old = [old_logprobs(policy, rows, mine) if k > 1 else [None] * len(mine) for rows, _, mine in parts]
    return [MiniBatch(policy, *part, part_old) for part, part_old in zip(parts, old)]


@torch.no_grad()
def old_logprobs(policy: Policy, kept, micro_batches) -> list[torch.Tensor | None]:
    """The current policy's log-probs of each of this rank's `micro_batches` of `kept`, (B, T-1) as the
    step will compute them; None for an empty micro-batch (after its empty pass)."""
    prefix = shared_prefix(policy, kept, micro_batches)
    old = []
    for micro_batch in micro_batches:
        if not micro_batch:
            empty_pass(policy.model, policy.pad_id, policy.device)
            old.append(None)
            continue
        input_ids, attention_mask, _, _ = trajectory_tensors([kept[i] for i in micro_batch], policy.pad_id,
                                                             policy.device)
        old.append(scores(policy, policy.model, input_ids, attention_mask, prefix))
    return old


@torch.no_grad()
def scores(policy: Policy, model, input_ids, attention_mask, prefix=None) -> torch.Tensor:
    """`model`'s log-probs of a micro-batch (B, T-1), as the step computes the policy's, without gradients."""
    return token_logprobs(model, input_ids, attention_mask, policy.temperature, prefix=prefix,
                          recompute=False, packed=True)  # (B, T-1): no backward to recompute for


def shared_prefix(policy: Policy, kept, micro_batches) -> SharedPrefix | None:
    """The probes' common start, or less if a row of this rank lacks it, run once through the policy on
    every rank, as FSDP needs; None on GPUs and without probes."""
    if not policy.shared:
        return None
    mine = [kept[i].prompt_ids for batch in micro_batches for i in batch] + policy.probes[:1]
    length = min(policy.shared, shared_prefix_length(mine))
    return SharedPrefix(policy.model, torch.tensor(policy.probes[0][:length], device=policy.device))


def step_metrics(parts: list[MiniBatch], device) -> dict:
    """The update's metrics: each summed over ranks, then averaged over the optimizer steps (a key ending
    in "_max" is the largest instead); grpo_roc's (11) effective sample size; the number of steps. In
    float64: sums of many small terms keep their digits."""
    values = torch.tensor([[p.sums[k] for k in METRICS] for p in parts], dtype=torch.float64).to(device)
    total, highest = values.clone(), values.clone()                                        # (K, metrics)
    dist.all_reduce(total)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    is_max = torch.tensor([k.endswith("_max") for k in METRICS], device=device)           # (metrics,)
    row = dict(zip(METRICS, torch.where(is_max, highest.max(0).values, total.mean(0)).tolist()))
    row["ess"] = effective_sample_size(row.pop("ess_sum_w"), row.pop("ess_sum_w2"), row.pop("ess_n"))
    row["optimizer_steps"] = len(parts)
    return row


def effective_sample_size(sum_w, sum_w2, n) -> float:
    """grpo_roc.py (11): (sum w)^2 / (n sum w^2) in (0, 1]: 1 for equal weights, 1/n when one dominates (a
    common scale cancels: sums over micro-batches and ranks, or their means over steps, give the same)."""
    if n <= 0:
        return 1.0          # no token kept: nothing to weigh
    if sum_w2 <= 0:
        return 0.0          # every weight underflowed to 0
    return sum_w * sum_w / (n * sum_w2)
