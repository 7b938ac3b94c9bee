"""What train.py's policy update needs and a reader need not see first: its mini-batches (mini_batches),
each one's micro-batches (iterating a MiniBatch), their metrics (record, step_metrics). What it hides:
each rank receives the tokens of the rollouts it trains (batch.exchange); a mini-batch is dealt across
ranks by tokens and packed into micro-batches, as many on every rank, a rank short of them running a
row of padding through the calls of a data pass, so that FSDP's collectives meet in one order on every
rank (the policy's forward, the reference's, the backward); on CPUs the prompts' common start runs
once per mini-batch; the old log-probs of later mini-batches, taken before the first step; the
reference's. tests/test_update.py runs train.py's update on a tiny model; tests/test_train.py, two ranks.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from conversation import pad_token_id, prompt_ids
from infra.batch import exchange, plan_micro_batches
from infra.logprobs import SharedPrefix, shared_prefix_length, token_logprobs, trajectory_tensors
from infra.lora import adapters_off
from infra.training import cpu_group
from rollout import Trajectory

# The metrics of one optimizer step. Each term is already divided by n_loss_tokens, so the micro-batches'
# values add up (padding_passes: a count); the largest mismatch and the gradient's norm follow.
# step_metrics sums them over ranks and averages over steps.
SUMMED = ["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref", "entropy",
          "logprob_mismatch", "masked_frac", "ess_sum_w", "ess_sum_w2", "ess_n", "padding_passes"]
METRICS = SUMMED + ["logprob_mismatch_max", "grad_norm"]
MICRO_BATCH_TOKENS = 8192  # train.py's tokens per forward pass, which the memory plan assumes by default


@dataclass
class Policy:
    """The model being trained, as the update needs it: `temperature` the sampler's; `probes` prompts whose
    common start runs once per micro-batch on CPUs; `reference` train.py's, with --kl-coef."""
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
        self.shared = shared_prefix_length(self.probes) if self.probes and self.device.type != "cuda" else 0

    @classmethod
    def of(cls, model, tokenizer, tools, device, temperature, micro_batch_tokens, reference=None):
        """train.py's: the ranks from the process group; the probes two prompts of the run's format."""
        probes = [prompt_ids(tokenizer, question, tools) for question in ("1", "What")]
        return cls(model, pad_token_id(tokenizer), device, temperature, micro_batch_tokens, dist.get_rank(),
                   dist.get_world_size(), probes, reference)


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

    def logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs at the sampler's temperature, with their graph, and each position's
        entropy: (B, T-1) each. Packed; on GPUs each chunk recomputed in the backward (token_logprobs)."""
        p = self.policy
        return token_logprobs(p.model, self.input_ids, self.attention_mask, p.temperature, prefix=self.prefix,
                              recompute=p.device.type == "cuda", packed=True, entropy=True)

    def reference_logprobs(self) -> torch.Tensor | None:
        """The reference policy's log-probs (B, T-1), or None. After the policy's pass: FSDP sets a model up
        at its first pass, and under LoRA the reference is the policy with its adapters off."""
        if self.policy.reference is None:
            return None
        with adapters_off(self.policy.reference):
            return scores(self.policy, self.policy.reference, self.input_ids, self.attention_mask)


class MiniBatch:
    """The rollouts of one optimizer step; `n_loss_tokens`, theirs on every rank, the loss's denominator.
    Iterating gives this rank's micro-batches; after the last backward, finish()."""

    def __init__(self, policy: Policy, rows: list, advantages: list, micro_batches: list, old: list):
        self.policy, self.rows, self.advantages, self.micro_batches = policy, rows, advantages, micro_batches
        self.old = old  # per micro-batch: the log-probs the ratio is against, or None (the first step)
        self.n_loss_tokens = max(1, sum(t.num_loss_tokens for t in rows))
        self.sums = dict(dict.fromkeys(METRICS, 0.0), padding_passes=float(sum(not b for b in micro_batches)))
        self.prefix = None  # (made by iterating)

    def __iter__(self):
        self.prefix = shared_prefix(self.policy, self.rows, self.micro_batches)
        for micro_batch, old_logp in zip(self.micro_batches, self.old):
            tensors = micro_tensors(self.policy, self.rows, micro_batch, self.prefix)
            advantages = [self.advantages[i] for i in micro_batch] or [0.0]  # (the padding's)
            advantages = torch.tensor(advantages, device=self.policy.device)                     # (B,)
            yield MicroBatch(*tensors, advantages, old_logp, self.prefix, self.policy)

    def finish(self) -> None:
        """Every rank, after the last backward: the micro-batches' gradient on the shared prefix goes back
        through it once; a frozen reference lets go of the root FSDP keeps gathered for a backward."""
        if self.prefix is not None:
            self.prefix.backward()
        reference = self.policy.reference
        if reference is not None and reference is not self.policy.model:
            reference.reshard()

    def record(self, logp: torch.Tensor, micro: MicroBatch, metrics: dict) -> None:
        """Adds one micro-batch's metrics (each a sum / n_loss_tokens) and the trainer-sampler mismatch."""
        mismatch = (logp.detach() - micro.sampler_logp).abs() * micro.loss_mask                 # (B, T-1)
        metrics = dict(metrics, logprob_mismatch=mismatch.sum().item() / self.n_loss_tokens)
        for key in SUMMED:
            self.sums[key] += metrics.get(key, 0.0)
        self.sums["logprob_mismatch_max"] = max(self.sums["logprob_mismatch_max"], mismatch.max().item())

    def record_grad_norm(self, grad_norm) -> None:
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # Every rank holds the whole norm, and step_metrics sums the ranks' values: divide here.
        self.sums["grad_norm"] = float(grad_norm) / self.policy.world_size


def micro_tensors(policy: Policy, rows: list, micro_batch: list[int], prefix):
    """A micro-batch's input_ids, attention_mask, loss_mask, sampler_logp. An empty one: a row of padding
    after the shared prefix, nothing in its loss mask (it runs what one with data runs)."""
    if micro_batch:
        return trajectory_tensors([rows[i] for i in micro_batch], policy.pad_id, policy.device)
    start = policy.probes[0][:prefix.length] if prefix is not None else []
    pad = policy.pad_id
    padding = Trajectory(-1, prompt_ids=[*start, pad], response_ids=[pad], loss_mask=[0], logprobs=[0.0])
    return trajectory_tensors([padding], pad, policy.device)


def mini_batches(policy: Policy, kept: list, advantages: list, k: int = 1) -> list[MiniBatch]:
    """The kept rollouts as min(k, len(kept)) contiguous parts (whole groups when G divides a part), each
    planned into micro-batches across ranks, whose tokens each rank receives. With k > 1 every part's
    ratio is against the policy before the first optimizer step: each part is scored now."""
    k = min(k, max(len(kept), 1))
    parts = []
    for j in range(k):
        part = range(j * len(kept) // k, (j + 1) * len(kept) // k)
        rows = [kept[i] for i in part]
        lengths = [t.prompt_length + t.response_length - policy.shared for t in rows]  # about what runs
        plan = plan_micro_batches(lengths, policy.micro_batch_tokens, policy.world_size, packed=True)
        rows = exchange(rows, plan, cpu_group())  # from the rank that rolled each one out
        parts.append((rows, [advantages[i] for i in part], plan[policy.rank]))
    old = [old_logprobs(policy, rows, mine) if k > 1 else [None] * len(mine) for rows, _, mine in parts]
    return [MiniBatch(policy, *part, part_old) for part, part_old in zip(parts, old)]


@torch.no_grad()
def old_logprobs(policy: Policy, kept, micro_batches) -> list[torch.Tensor]:
    """The current policy's log-probs of each of this rank's `micro_batches` of `kept`, (B, T-1) as the
    step will compute them (an empty micro-batch's row of padding too)."""
    prefix = shared_prefix(policy, kept, micro_batches)
    tensors = (micro_tensors(policy, kept, batch, prefix) for batch in micro_batches)
    return [scores(policy, policy.model, input_ids, mask, prefix) for input_ids, mask, *_ in tensors]


@torch.no_grad()
def scores(policy: Policy, model, input_ids, attention_mask, prefix=None) -> torch.Tensor:
    """`model`'s log-probs of a micro-batch (B, T-1), as the step computes the policy's, without gradients."""
    return token_logprobs(model, input_ids, attention_mask, policy.temperature, prefix=prefix,
                          recompute=False, packed=True)  # (B, T-1): no backward to recompute for


def shared_prefix(policy: Policy, kept, micro_batches) -> SharedPrefix | None:
    """The probes' common start (less if a row lacks it), run once on every rank; None on GPUs."""
    if not policy.shared:
        return None
    mine = [kept[i].prompt_ids for batch in micro_batches for i in batch] + policy.probes[:1]
    length = min(policy.shared, shared_prefix_length(mine))
    return SharedPrefix(policy.model, torch.tensor(policy.probes[0][:length], device=policy.device))


def step_metrics(parts: list[MiniBatch], device) -> dict:
    """The update's metrics: each summed over ranks, then averaged over the optimizer steps (a "_max" key:
    the largest); grpo_roc's (11) effective sample size; the steps. float64: small terms keep their digits."""
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
    common scale cancels: sums over micro-batches and ranks or means over steps give the same)."""
    if n <= 0:
        return 1.0          # no token kept: nothing to weigh
    if sum_w2 <= 0:
        return 0.0          # every weight underflowed to 0
    return sum_w * sum_w / (n * sum_w2)
