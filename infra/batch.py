"""One RL step's batch across ranks: the problems it takes, its rollouts, and where each is trained.

- ProblemStream: the endless stream of training problems, a seeded shuffle per epoch, so that a
  position in it (saved with checkpoints) names the same problems on every rank and every run.
- ProblemQueue: a draw's problems across ranks, and every trajectory's numbers back to every rank;
  mixed_groups, the groups GRPO learns from (scheduler.draw's dynamic sampling counts them).
- RolloutTimer: a rollout driver's statistics (scheduler.rollout_scheduled's), apart from its control flow.
- plan_micro_batches and exchange: the kept rollouts dealt across ranks by tokens and cut into
  micro-batches; each rank receives the tokens of those it trains, and nothing else. At the paper's
  scale (16,384 trajectories of up to 8K tokens, 8 ranks) every rank holding everything would be
  ~11 GB of Python objects per rank: bench/gather_memory.py measures the difference. With one rank
  no collective runs.
"""
import dataclasses
import functools
import itertools
import pickle
import statistics
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from rollout import TOKENS


class ProblemStream:
    """Epoch after epoch, a shuffle seeded by the seed and the epoch: the problems at a position are the
    same whoever asks and however the stream is cut."""

    def __init__(self, problems: list[dict], seed: int):
        self.problems, self.seed = problems, seed

    @functools.lru_cache(maxsize=2)  # (one shuffle per epoch, not one per problem taken)
    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.problems), generator=generator).tolist()

    def take(self, position: int, count: int) -> list[dict]:
        """The problems at positions position .. position + count - 1."""
        picks = [divmod(p, len(self.problems)) for p in range(position, position + count)]  # (epoch, i)
        return [self.problems[self.order(epoch)[i]] for epoch, i in picks]


class ProblemQueue:
    """A draw's problems across ranks: pulled one index at a time (`next`: the scheduler's balance, a rank
    slowed by long rollouts simply takes fewer) or as a fixed contiguous share (`share`, lockstep);
    `gather` gives every rank every trajectory's numbers (a few hundred bytes each), its own rollouts
    whole. Under torchrun (distributed=True) the counter is atomic, in the key-value store every rank
    shares (`key`: new for every draw); ranks that finish early wait in `gather`, on `group` (a gloo
    group on GPUs, training.cpu_group(): the wait is not inside an NCCL collective)."""

    def __init__(self, key: str = "", distributed: bool = False, group=None, with_text: bool = False):
        self.rank, self.world_size, self.store, self.group = 0, 1, None, group
        if distributed:
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
        parts = [None] * self.world_size
        dist.all_gather_object(parts, [without_payload(t, self.with_text) for t in trajs], group=self.group)
        parts[self.rank] = trajs
        return [t for part in parts for t in part]


def without_payload(t, with_text: bool = False):
    """`t` without its tokens (their counts in `sizes`) and its text: what other ranks need of it."""
    return dataclasses.replace(t, prompt_ids=None, response_ids=None, loss_mask=None, logprobs=None,
                               text=t.text if with_text else None,
                               sizes=(t.prompt_length, t.response_length, t.num_loss_tokens))


def mixed_groups(trajs: list) -> set[int]:
    """The problems whose graded rollouts are some right, some wrong (all-equal ones have no advantage)."""
    rewards = defaultdict(set)
    for t in trajs:
        if not t.sandbox_failed:
            rewards[t.index].add(t.reward)
    return {index for index, seen in rewards.items() if len(seen) > 1}


def exchange(trajs: list, plan: list[list[list[int]]], group=None) -> list:
    """The gathered `trajs`, each with its tokens on the rank that trains it as `plan` says (the same on
    every rank: plan_micro_batches), only its numbers elsewhere. Each rank pickles the tokens of its own
    rollouts that another trains (numpy arrays pickle as raw bytes); one all-to-all on `group` (a gloo
    group on GPUs: training.cpu_group) delivers them, after one of their sizes."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    where_trained = {i: r for r, batches in enumerate(plan) for batch in batches for i in batch}
    trainers = [where_trained[i] for i in range(len(trajs))]
    outgoing, out = [[] for _ in range(world_size)], []
    for t, trainer in zip(trajs, trainers):
        if trainer != rank and t.response_ids is not None:
            outgoing[trainer].append(((t.index, t.sample), [getattr(t, name) for name in TOKENS]))
            t = without_payload(t)
        out.append(t)
    if world_size > 1:
        blobs = [np.frombuffer(pickle.dumps(items), np.uint8) for items in outgoing]
        sizes = torch.tensor([len(blob) for blob in blobs])                         # (world,) bytes out
        incoming = torch.empty_like(sizes)                                          # (world,) bytes in
        dist.all_to_all_single(incoming, sizes, group=group)
        received = torch.empty(int(incoming.sum()), dtype=torch.uint8)
        dist.all_to_all_single(received, torch.from_numpy(np.concatenate(blobs)), incoming.tolist(),
                               sizes.tolist(), group=group)
        where = {(t.index, t.sample): i for i, t in enumerate(out)}
        for part in np.split(received.numpy(), np.cumsum(incoming.tolist())[:-1]):
            for key, arrays in pickle.loads(part):
                out[where[key]] = dataclasses.replace(out[where[key]], **dict(zip(TOKENS, arrays)))
    if any(r == rank and t.response_ids is None for t, r in zip(out, trainers)):
        raise RuntimeError(f"rank {rank} lacks the tokens of a trajectory it trains\n---> HINT: "
                           f"exchange what gather returned, with the same plan on every rank")
    return out


def plan_micro_batches(lengths: list[int], budget: int, world_size: int,
                       packed: bool = False) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of indices into `lengths`: rows x longest row <= budget, or
    `packed` (rows back to back: logprobs.token_logprobs) their tokens <= budget, each in the first with
    room; a longer sequence alone. All ranks get as many (empty ones last: update.micro_tensors)."""
    shares, load = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # longest first, to the lightest rank
        lightest = load.index(min(load))
        shares[lightest].append(i)
        load[lightest] += lengths[i]
    plans = []
    for share in shares:  # each share is longest first: a micro-batch's first row is its longest
        batches, tokens = [], []
        for i in share:
            if packed:  # (first fit, longest first: at most 11/9 of the fewest micro-batches, + 2/3)
                room = [j for j, n in enumerate(tokens) if n + lengths[i] <= budget][:1]
            else:  # rows padded to the first (longest) row: only the last micro-batch may take more
                fits = batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget
                room = [len(batches) - 1] if fits else []
            if room:
                batches[room[0]].append(i)
                tokens[room[0]] += lengths[i]
            else:
                batches.append([i])
                tokens.append(lengths[i])
        plans.append(batches)
    passes = max(len(batches) for batches in plans)
    return [batches + [[] for _ in range(passes - len(batches))] for batches in plans]


class RolloutTimer:
    """Seconds generating and waiting on tools, the KV cache's mean use per engine step, the most
    trajectories in flight, when each finished; and the progress bar."""

    def __init__(self, kv_tokens: int, total: int):
        from tqdm import tqdm
        self.kv_tokens, self.start = kv_tokens, time.perf_counter()
        self.gen_s = self.tool_wait_s = self.kv_sum = 0.0
        self.steps, self.peak, self.finished_at = 0, 0, []
        self.bar = tqdm(total=total, desc="rollouts", unit="traj", leave=False)

    def step(self, engine, running: dict):
        """engine.step(), timed; then the share of the KV budget the running requests fill."""
        t0 = time.perf_counter()
        outs = engine.step()
        self.gen_s += time.perf_counter() - t0
        self.steps += 1
        self.kv_sum += sum(len(t.prompt_ids) + len(t.response_ids) for t in running.values()) / self.kv_tokens
        return outs

    def wait(self, results):
        """The next tool result, blocking: the engine has nothing to step."""
        t0 = time.perf_counter()
        item = results.get()
        self.tool_wait_s += time.perf_counter() - t0
        return item

    def finished(self) -> None:
        self.finished_at.append(time.perf_counter() - self.start)
        self.bar.update(1)

    def summary(self) -> dict:
        self.bar.close()
        ends = sorted(self.finished_at)
        return dict(wall_seconds=time.perf_counter() - self.start, gen_seconds=self.gen_s,
                    tool_wait_seconds=self.tool_wait_s, peak_admitted=self.peak,
                    kv_utilisation=self.kv_sum / max(self.steps, 1),
                    straggler_seconds=ends[-1] - statistics.median(ends) if ends else 0.0)
