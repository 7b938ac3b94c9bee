"""Rollout drivers, the load-balanced scheduler (paper §3.2) and the turn-synchronous baseline, and
a training step's draw of rollouts (draw: DAPO's dynamic sampling on top of either driver).

Both drivers step rollout.py's turn logic on a vLLM engine (an LLMEngine: add_request / step), take
the same arguments and return the same thing: every rank gets the whole batch in problem order, its
own rollouts whole and the others' without their tokens and text (ProblemQueue.gather).

`rollout_lockstep`, the simplest driver, wastes the engine three ways: short trajectories wait for
the longest one at every turn, tool calls wait to run as one batch, and a batch bigger than the KV
cache makes the engine preempt and recompute. `rollout_scheduled` fixes all three:

1. KV-budget admission by what trajectories hold: each admitted trajectory counts its prompt and
   response so far in whole cache blocks (while it waits on a tool its prefix stays cached) plus room
   for one more turn (the batch's mean growth per turn so far; max_response / max_turns before one
   has ended). New trajectories are admitted while the total fits the engine's cache, and as they
   finish the next are admitted. The paper reserves prompt + max_response instead: that never
   overflows the cache, but leaves most of it idle when most responses are short. Here a trajectory
   that outgrows its room can make vLLM preempt and recompute a request, and admission waits until
   the total fits again. All turns of a trajectory run on one engine: its prefix stays cached.
2. Asynchronous tool calls: a turn that ends with a call goes to the sandbox at once, and the engine
   steps the others; when the result arrives, the tool turn is appended and the next turn queued.
   With nothing to step the loop blocks on the results queue: it never spins.
3. Balance across ranks: under torchrun each rank drives its own engine and pulls the next problem
   from one shared counter (batch.ProblemQueue) whenever it has room, so a rank slowed by long
   trajectories or slow tools simply takes fewer problems.
bench/scheduler_speed.py measures it (docs/benchmarks.md): 1.4-1.6x faster than lockstep on the toy
benchmark, and level with plain asynchronous rollouts (every first turn submitted at once, each tool
call run as it comes, the engine's own scheduler left to preempt), which peers' agent loops use.
With per-turn seeds (RolloutConfig.deterministic) the same inputs give the same trajectories, up to
vLLM's numerics changing with batch composition (see tests).
"""
import dataclasses
import queue
import time
from collections import defaultdict, deque

import torch.distributed as dist

from infra.batch import ProblemQueue, ProblemStream, RolloutTimer, mixed_groups
from infra.engine import kv_block_tokens, kv_capacity_tokens, turn_tokens
from rollout import (RolloutConfig, add_tool_turn, end_turn, sampling_params, score, start_trajectories,
                     trajectory_metrics)


def request_id(traj) -> str:
    """The engine request of a trajectory's next turn: problem-sample-turn."""
    return f"{traj.index}-{traj.sample}-{traj.num_turns}"


def _whole_batch(trajs, problem_queue, sandbox, cfg):
    """Grade this rank's trajectories, then every rank's, sorted by problem and sample."""
    score(trajs, sandbox, cfg)
    return sorted(problem_queue.gather(trajs), key=lambda t: (t.index, t.sample))


# -----------------------------------------------------------------------------
# The baseline: turn-synchronous


def rollout_lockstep(llm_engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                     problem_queue: ProblemQueue | None = None):
    """Turn k of every active trajectory of this rank's share, then all turn-k tool calls as one
    sandbox batch, then turn k+1. Returns (the whole batch's trajectories, stats: its
    trajectory_metrics and this rank's seconds; tool_wait_seconds: the engine idle, waiting on tools)."""
    from tqdm import tqdm
    problem_queue = problem_queue or ProblemQueue()
    mine = problem_queue.share(len(problems))
    trajs = start_trajectories(tokenizer, problems[mine.start:mine.stop], n, mine.start, cfg.tools)
    active, gen_s, tool_wait_s, t_start = list(trajs), 0.0, 0.0, time.perf_counter()
    with tqdm(total=len(trajs), desc="rollouts", unit="traj", leave=False) as bar:
        while active:
            t0 = time.perf_counter()
            for t in active:
                llm_engine.add_request(request_id(t), {"prompt_token_ids": t.prompt_ids + t.response_ids},
                                   sampling_params(t, cfg, tokenizer))
            outputs = {}
            while llm_engine.has_unfinished_requests():
                outputs.update((out.request_id, out) for out in llm_engine.step() if out.finished)
            gen_s += time.perf_counter() - t0
            calls = []
            for t in active:
                call = end_turn(t, *turn_tokens(outputs[request_id(t)].outputs[0]), tokenizer, cfg)
                if call is not None:
                    calls.append((t, call))
            t0 = time.perf_counter()
            results = iter(sandbox.run_batch([(c.code, c.stdin) for _, c in calls if c.error is None]))
            for t, call in calls:  # a malformed call's error is its own tool output
                add_tool_turn(t, call.error if call.error is not None else next(results), tokenizer, cfg)
            tool_wait_s += time.perf_counter() - t0
            bar.update(sum(1 for t in active if t.finish_reason))
            active = [t for t in active if not t.finish_reason]
    trajs = _whole_batch(trajs, problem_queue, sandbox, cfg)
    return trajs, dict(trajectory_metrics(trajs), gen_seconds=gen_s, tool_wait_seconds=tool_wait_s,
                       wall_seconds=time.perf_counter() - t_start)


# -----------------------------------------------------------------------------
# The scheduler: its KV-budget admission bookkeeping, then the loop that drives it (its statistics:
# batch.RolloutTimer)


class KVAdmission:
    """The KV-cache tokens the admitted, unfinished trajectories hold, and whether one more fits.
    Each counts its prompt + response so far in whole cache blocks, plus room for one more turn: the
    batch's mean growth per turn so far (a tool turn included), max_response / max_turns before any."""

    def __init__(self, kv_tokens: int, block: int, cfg: RolloutConfig):
        self.kv_tokens, self.block, self.cfg = kv_tokens, block, cfg
        self.live = {}                   # (index, sample) -> admitted, unfinished trajectory
        self.grown, self.turns = 0, 0    # response tokens added by the batch's turns, and how many

    def cost(self, t) -> int:
        turn = self.grown / self.turns if self.turns else self.cfg.max_response / self.cfg.max_turns
        tokens = len(t.prompt_ids) + min(len(t.response_ids) + turn, self.cfg.max_response)
        return -(-int(tokens) // self.block) * self.block

    def held(self) -> int:
        return sum(self.cost(t) for t in self.live.values())

    def fits(self, t, held: int) -> bool:
        """t fits beside what is held; an empty engine always takes one."""
        return not self.live or held + self.cost(t) <= self.kv_tokens

    def admit(self, t) -> None:
        self.live[t.index, t.sample] = t

    def release(self, t) -> None:
        del self.live[t.index, t.sample]

    def grew(self, tokens: int, turn: bool = False) -> None:
        """A sampled turn (turn=True) or a tool turn added `tokens` to a response."""
        self.grown, self.turns = self.grown + tokens, self.turns + turn


def rollout_scheduled(llm_engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                      problem_queue: ProblemQueue | None = None):
    """Roll out n samples of every problem this rank pulls (1-3 above). Returns (the whole batch's
    trajectories, stats: its trajectory_metrics and this rank's seconds; tool_wait_seconds: the
    engine idle, waiting on tools)."""
    problem_queue = problem_queue or ProblemQueue()
    kv_tokens = cfg.kv_budget or kv_capacity_tokens(llm_engine)
    admission = KVAdmission(kv_tokens, kv_block_tokens(llm_engine), cfg)
    timer = RolloutTimer(kv_tokens, len(problems) * n)
    results = queue.SimpleQueue()        # (trajectory, future), put by the sandbox's threads
    waiting, running = deque(), {}       # pulled, not yet admitted; request id -> trajectory on the engine
    trajs, in_tools, exhausted = [], 0, False

    def next_turn(t):                    # queue t's next turn; if t has finished, free what it held
        if t.finish_reason:
            admission.release(t)
            timer.finished()
            return
        running[request_id(t)] = t
        llm_engine.add_request(request_id(t), {"prompt_token_ids": t.prompt_ids + t.response_ids},
                           sampling_params(t, cfg, tokenizer))

    def after_tool(t, result):           # a turn's growth includes its tool turn
        before = len(t.response_ids)
        add_tool_turn(t, result, tokenizer, cfg)
        admission.grew(len(t.response_ids) - before)
        next_turn(t)

    while True:
        # KV-budget admission while the total fits; dynamic balance: pull the next problem when none waits
        held = admission.held()
        while waiting or not exhausted:
            if not waiting:
                if admission.live and held >= kv_tokens:
                    break
                i = problem_queue.next()
                exhausted = i >= len(problems)
                if exhausted:
                    break
                waiting.extend(start_trajectories(tokenizer, [problems[i]], n, i, cfg.tools))
            if not admission.fits(waiting[0], held):
                break
            t = waiting.popleft()
            held += admission.cost(t)
            admission.admit(t)
            trajs.append(t)
            next_turn(t)
        timer.peak = max(timer.peak, len(running) + in_tools)

        # step the engine: a finished turn ends its trajectory, shows a malformed call's error as the
        # tool output, or goes to the sandbox; with nothing to step, wait for a tool result
        arrived = []                     # (trajectory, future) of the tool results to append now
        if llm_engine.has_unfinished_requests():
            for out in timer.step(llm_engine, running):
                if not out.finished:
                    continue
                t = running.pop(out.request_id)
                call = end_turn(t, *turn_tokens(out.outputs[0]), tokenizer, cfg)
                admission.grew(len(out.outputs[0].token_ids), turn=True)
                if call is None:
                    next_turn(t)         # it has finished
                elif call.error is not None:
                    after_tool(t, call.error)
                else:                    # to the sandbox now; the engine goes on
                    in_tools += 1
                    sandbox.submit(call.code, call.stdin).add_done_callback(lambda f, t=t: results.put((t, f)))
        elif in_tools:
            arrived.append(timer.wait(results))  # blocks: it never spins
        elif not waiting and exhausted:
            break
        while not results.empty():       # and every other result that has arrived
            arrived.append(results.get())
        for t, future in arrived:
            in_tools -= 1
            after_tool(t, future.result())
    trajs = _whole_batch(trajs, problem_queue, sandbox, cfg)
    return trajs, dict(trajectory_metrics(trajs), **timer.summary())


# -----------------------------------------------------------------------------
# A training step's draw


def draw(driver, llm_engine, tokenizer, sandbox, problems: list[dict], seed: int, position: int, count: int,
         n: int, cfg: RolloutConfig, key: str, dynamic: int = 0, group=None) -> tuple[list, dict, int]:
    """A step's rollouts: `count` problems of the stream of `problems` (batch.ProblemStream, shuffled by
    `seed`) from `position`, `n` rollouts each, by `driver` (one of the two above) with `cfg`. With
    dynamic sampling (DAPO), `dynamic` > 0 draws at most: more draws of `count` while the step holds
    fewer than `count` mixed groups (an all-right or all-wrong group has zero advantages and teaches
    nothing), each with a seed and problem indices of its own; the first `count` mixed groups are what
    the step trains. `key`: new for every step (the ranks' shared counter). Returns (the trajectories the
    step trains, their stats over every draw, the stream's position after them)."""
    stream, trajs, timing, drawn, first = ProblemStream(problems, seed), [], defaultdict(float), 0, 0
    while True:
        index = drawn // count  # the first draw samples as a step without dynamic sampling does
        problem_queue = ProblemQueue(f"{key}/{index}", dist.is_initialized() and dist.get_world_size() > 1,
                                     group)
        settings = dataclasses.replace(cfg, seed=cfg.seed + 100_003 * index)
        batch = stream.take(position + drawn, count)
        new, stats = driver(llm_engine, tokenizer, sandbox, batch, n, settings, problem_queue)
        for t in new:
            t.index += drawn
        trajs += new
        drawn += count
        for name in ("gen_seconds", "tool_wait_seconds"):
            timing[name] += stats.get(name, 0.0)
        mixed = mixed_groups(trajs)
        first = len(mixed) if index == 0 else first  # what a step without dynamic sampling trains
        if not dynamic or len(mixed) >= count or drawn >= dynamic * count:
            break
    stats = dict(stats, **trajectory_metrics(trajs), **timing, drawn_problems=drawn, mixed_groups=len(mixed),
                 mixed_first_draw=first)
    if dynamic:
        trained = set(sorted(mixed)[:count])
        trajs = [t for t in trajs if t.index in trained]
    return trajs, dict(stats, mixed_share=min(len(mixed), count) / count), position + drawn
