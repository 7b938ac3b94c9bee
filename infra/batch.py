"""One RL step's batch across ranks: the problems it takes, and the trajectories it gives back.

- ProblemStream: the endless stream of training problems, a seeded shuffle per epoch, so that a
  position in it (saved with checkpoints) names the same problems on every rank and every run.
- ProblemQueue: a step's problems across ranks, pulled one at a time from a counter every rank
  shares (the scheduler's balance: a rank slowed by long rollouts simply takes fewer), or as fixed
  shares (lockstep); then the trajectories back: `gather` gives every rank every trajectory's
  numbers (what down-sampling and logging read: a few hundred bytes each), its own rollouts whole;
  `exchange` sends each rank the tokens of the trajectories it trains, and nothing else. At the
  paper's scale (16,384 trajectories of up to 8K tokens, 8 ranks) every rank holding everything
  would be ~11 GB of Python objects per rank: bench/gather_memory.py measures the difference.
With one rank no collective runs and the objects come back as they are.
- mixed_groups: the problems of a batch whose rollouts are some right and some wrong, the only ones
  GRPO learns from; train.py --dynamic-sampling draws problems until a step has enough of them.
"""
import dataclasses
import functools
import itertools
import pickle
from collections import defaultdict

import numpy as np

from rollout import TOKENS


class ProblemStream:
    """An endless stream of problems, epoch after epoch, each epoch a shuffle seeded by the seed and
    the epoch: the problems at a position are the same whoever asks and however the stream is cut."""

    def __init__(self, problems: list[dict], seed: int):
        self.problems, self.seed = problems, seed

    @functools.lru_cache(maxsize=2)  # (one shuffle per epoch, not one per problem taken)
    def order(self, epoch: int) -> list[int]:
        import torch
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.problems), generator=generator).tolist()

    def take(self, position: int, count: int) -> list[dict]:
        """The problems at positions position .. position + count - 1."""
        picks = [divmod(p, len(self.problems)) for p in range(position, position + count)]  # (epoch, i)
        return [self.problems[self.order(epoch)[i]] for epoch, i in picks]


class ProblemQueue:
    """A batch's problems across ranks: pulled one index at a time (`next`, the scheduler) or as a
    fixed contiguous share (`share`, lockstep); `gather` gives every rank every trajectory's numbers,
    `exchange` each rank the tokens of those it trains (bench/gather_memory.py measures the saving).
    One rank: a local counter. Under torchrun (distributed=True): an atomic counter in
    torch.distributed's key-value store, which every rank already shares; `key` must be new for
    every batch. Ranks that finish early wait in `gather`, on `group`: pass a gloo group on GPUs
    (training.cpu_group()), so that the wait is not inside an NCCL collective."""

    def __init__(self, key: str = "", distributed: bool = False, group=None, with_text: bool = False):
        self.rank, self.world_size, self.store, self.group = 0, 1, None, group
        if distributed:
            import torch.distributed as dist
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            # (torch 2.13 keeps the default group's store private; no new port is needed for it)
            self.store = dist.distributed_c10d._get_default_store()
        self.key, self.local = f"rollout-queue/{key}", itertools.count()
        self.with_text = with_text  # gather the others' text too (eval.py writes every sample's)

    def next(self) -> int:
        return next(self.local) if self.store is None else self.store.add(self.key, 1) - 1

    def share(self, n: int) -> range:
        """This rank's contiguous share of n problems."""
        size = -(-n // self.world_size)
        return range(min(n, self.rank * size), min(n, (self.rank + 1) * size))

    def gather(self, trajs: list) -> list:
        """Every rank's trajectories in rank order: this rank's whole, the others' without_payload; each
        one's `rank` says which rank rolled it out."""
        for t in trajs:
            t.rank = self.rank
        if self.world_size == 1:
            return list(trajs)
        import torch.distributed as dist
        parts = [None] * self.world_size
        dist.all_gather_object(parts, [without_payload(t, self.with_text) for t in trajs], group=self.group)
        parts[self.rank] = trajs
        return [t for part in parts for t in part]

    def exchange(self, trajs: list, plan: list[list[list[int]]]) -> list:
        """The gathered `trajs`, each with its tokens on the rank that trains it, as `plan` says (every
        rank's micro-batches of `trajs`, the same on every rank: training.plan_micro_batches), and
        only its numbers elsewhere. A rank holds the tokens of its own rollouts: it pickles those
        another rank trains (numpy arrays pickle as their raw bytes) and one all-to-all on `group`
        delivers them, after one of their sizes."""
        where_trained = {i: r for r, batches in enumerate(plan) for batch in batches for i in batch}
        trainers = [where_trained[i] for i in range(len(trajs))]
        outgoing, out = [[] for _ in range(self.world_size)], []
        for t, trainer in zip(trajs, trainers):
            if trainer != self.rank and t.response_ids is not None:
                outgoing[trainer].append(((t.index, t.sample), [getattr(t, name) for name in TOKENS]))
                t = without_payload(t)
            out.append(t)
        if self.world_size > 1:
            import torch
            import torch.distributed as dist
            blobs = [np.frombuffer(pickle.dumps(items), np.uint8) for items in outgoing]
            sizes = torch.tensor([len(blob) for blob in blobs])                         # (world,) bytes out
            incoming = torch.empty_like(sizes)                                          # (world,) bytes in
            dist.all_to_all_single(incoming, sizes, group=self.group)
            received = torch.empty(int(incoming.sum()), dtype=torch.uint8)
            dist.all_to_all_single(received, torch.from_numpy(np.concatenate(blobs)), incoming.tolist(),
                                   sizes.tolist(), group=self.group)
            where = {(t.index, t.sample): i for i, t in enumerate(out)}
            for part in np.split(received.numpy(), np.cumsum(incoming.tolist())[:-1]):
                for key, arrays in pickle.loads(part):
                    out[where[key]] = dataclasses.replace(out[where[key]], **dict(zip(TOKENS, arrays)))
        if any(r == self.rank and t.response_ids is None for t, r in zip(out, trainers)):
            raise RuntimeError(f"rank {self.rank} lacks the tokens of a trajectory it trains\n---> HINT: "
                               f"exchange what gather returned, with the same plan on every rank")
        return out


def without_payload(t, with_text: bool = False):
    """A copy of `t` without its tokens (and its text unless with_text), their counts in `sizes`:
    the few hundred bytes of it that other ranks need."""
    return dataclasses.replace(t, prompt_ids=None, response_ids=None, loss_mask=None, logprobs=None,
                               text=t.text if with_text else None,
                               sizes=(t.prompt_length, t.response_length, t.num_loss_tokens))


def mixed_groups(trajs: list) -> set[int]:
    """The problems whose graded rollouts are some right and some wrong: the groups GRPO learns from
    (an all-equal group's advantages are all zero)."""
    rewards = defaultdict(set)
    for t in trajs:
        if not t.sandbox_failed:
            rewards[t.index].add(t.reward)
    return {index for index, seen in rewards.items() if len(seen) > 1}
