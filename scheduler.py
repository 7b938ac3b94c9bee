"""Rollout drivers: the load-balanced scheduler (paper §3.2) and the turn-synchronous baseline.

Both step rollout.py's turn logic on a vLLM engine (an LLMEngine: add_request / step), take the
same arguments and return the same thing: every rank gets the whole batch in problem order, its own
rollouts whole and the others' without their tokens and text (ProblemQueue.gather).

`rollout_lockstep`, the baseline most RL code uses, wastes the engine three ways: short
trajectories wait for the longest one at every turn, tool calls wait to run as one batch, and a
batch bigger than the KV cache makes the engine preempt and recompute. `rollout_scheduled` fixes
all three:

1. KV-budget admission by what trajectories hold. Each admitted trajectory counts the KV-cache
   tokens it holds (prompt + response so far, in whole cache blocks; while it waits on a tool its
   prefix stays cached for the next turn) plus room for one more turn (the batch's mean growth per
   turn so far; max_response / max_turns before a turn has ended). New trajectories are admitted
   while the total fits the budget (the engine's cache unless RolloutConfig.kv_budget says
   otherwise), and as trajectories finish the next are admitted. Reserving prompt + max_response
   instead (the paper's estimate) never overflows the cache but leaves most of it idle when most
   responses are short; here a trajectory that outgrows its turn of room can make vLLM preempt
   and recompute a request, and admission waits until the total fits again. All turns of a
   trajectory run on the engine that admitted it, so its earlier turns stay in the prefix cache.
2. Asynchronous tool calls. When a turn ends with a tool call it goes to the sandbox at once; the
   engine keeps stepping the other trajectories; when the result arrives its tool turn is
   appended and the next turn is queued. With nothing to step the loop blocks on the results
   queue: it never spins.
3. Dynamic balance across ranks. Under torchrun each rank drives its own engine and pulls the next
   problem from one shared counter (batch.ProblemQueue) whenever it has room, so a rank slowed by
   long trajectories or slow tools simply takes fewer problems.

Same turn logic; with per-turn seeds (RolloutConfig.deterministic) the same inputs give the same
trajectories, up to vLLM's numerics changing with batch composition (see tests).
bench/scheduler_speed.py measures the difference.
"""
import queue
import statistics
import time
from collections import deque

from batch import ProblemQueue
from engine import kv_block_tokens, kv_capacity_tokens, turn_tokens
from rollout import (RolloutConfig, add_tool_turn, end_turn, sampling_params, score, start_trajectories,
                     trajectory_metrics)


def request_id(traj) -> str:
    """The engine request of a trajectory's next turn: problem-sample-turn."""
    return f"{traj.index}-{traj.sample}-{traj.num_turns}"


def _whole_batch(trajs, problem_queue, sandbox):
    """Grade this rank's trajectories, then every rank's, sorted by problem and sample."""
    score(trajs, sandbox)
    return sorted(problem_queue.gather(trajs), key=lambda t: (t.index, t.sample))


# -----------------------------------------------------------------------------
# The baseline: turn-synchronous


def rollout_lockstep(engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                     problem_queue: ProblemQueue | None = None):
    """Turn k of every active trajectory of this rank's share, then all turn-k tool calls as one
    sandbox batch, then turn k+1. Returns (the whole batch's trajectories, stats: its
    trajectory_metrics and this rank's seconds; tool_wait_seconds: the engine idle, waiting on tools)."""
    from tqdm import tqdm
    problem_queue = problem_queue or ProblemQueue()
    mine = problem_queue.share(len(problems))
    trajs = start_trajectories(tokenizer, problems[mine.start:mine.stop], n, offset=mine.start)
    active, gen_s, tool_wait_s, t_start = list(trajs), 0.0, 0.0, time.perf_counter()
    with tqdm(total=len(trajs), desc="rollouts", unit="traj", leave=False) as bar:
        while active:
            t0 = time.perf_counter()
            for t in active:
                engine.add_request(request_id(t), {"prompt_token_ids": t.prompt_ids + t.response_ids},
                                   sampling_params(t, cfg, tokenizer))
            outputs = {}
            while engine.has_unfinished_requests():
                outputs.update((out.request_id, out) for out in engine.step() if out.finished)
            gen_s += time.perf_counter() - t0
            calls = []
            for t in active:
                call = end_turn(t, *turn_tokens(outputs[request_id(t)].outputs[0]), tokenizer, cfg)
                if call is not None:
                    calls.append((t, call))
            t0 = time.perf_counter()
            results = iter(sandbox.run_batch([call for _, call in calls if not isinstance(call, str)]))
            for t, call in calls:  # a parse error (a string) is its own tool output
                add_tool_turn(t, call if isinstance(call, str) else next(results), tokenizer, cfg)
            tool_wait_s += time.perf_counter() - t0
            bar.update(sum(1 for t in active if t.finish_reason))
            active = [t for t in active if not t.finish_reason]
    trajs = _whole_batch(trajs, problem_queue, sandbox)
    return trajs, dict(trajectory_metrics(trajs), gen_seconds=gen_s, tool_wait_seconds=tool_wait_s,
                       wall_seconds=time.perf_counter() - t_start)


# -----------------------------------------------------------------------------
# The scheduler


def rollout_scheduled(engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                      problem_queue: ProblemQueue | None = None):
    """Roll out n samples of every problem this rank pulls (1-3). Returns (the whole batch's
    trajectories, stats: its trajectory_metrics and this rank's seconds; tool_wait_seconds: the
    engine idle, waiting on tools)."""
    from tqdm import tqdm
    problem_queue = problem_queue or ProblemQueue()
    kv_tokens = cfg.kv_budget or kv_capacity_tokens(engine)
    block = kv_block_tokens(engine)
    results = queue.SimpleQueue()        # (trajectory, future) put by the sandbox's threads (2)
    waiting, running, live = deque(), {}, {}  # pulled-not-admitted; request id -> traj; admitted, unfinished
    trajs, in_tools, exhausted = [], 0, False
    grown, turns = 0, 0                  # (1) response tokens added by the batch's turns, and how many
    gen_s = tool_wait_s = kv_sum = 0.0
    steps, peak, finished_at, t_start = 0, 0, [], time.perf_counter()
    bar = tqdm(total=len(problems) * n, desc="rollouts", unit="traj", leave=False)

    def cost(t):                                   # (1) what t holds, plus one turn of growth
        turn = grown / turns if turns else cfg.max_response / cfg.max_turns
        tokens = len(t.prompt_ids) + min(len(t.response_ids) + turn, cfg.max_response)
        return -(-int(tokens) // block) * block

    def submit(t):                                 # queue t's next turn on this engine
        running[request_id(t)] = t
        engine.add_request(request_id(t), {"prompt_token_ids": t.prompt_ids + t.response_ids},
                           sampling_params(t, cfg, tokenizer))

    def admit():                                   # (1) admit while the total fits, (3) pull
        nonlocal exhausted
        held = sum(cost(t) for t in live.values())
        while True:
            if not waiting:
                if exhausted or (live and held >= kv_tokens):
                    return
                i = problem_queue.next()
                if i >= len(problems):
                    exhausted = True
                    return
                waiting.extend(start_trajectories(tokenizer, [problems[i]], n, offset=i))
            if live and held + cost(waiting[0]) > kv_tokens:
                return                             # an empty engine always takes one
            t = waiting.popleft()
            held += cost(t)
            live[t.index, t.sample] = t
            trajs.append(t)
            submit(t)

    def done(t):
        del live[t.index, t.sample]                # (1) release; admit() refills next round
        finished_at.append(time.perf_counter() - t_start)
        bar.update(1)

    def after_tool(t, result):
        nonlocal grown
        before = len(t.response_ids)
        add_tool_turn(t, result, tokenizer, cfg)
        grown += len(t.response_ids) - before      # (1) a turn's growth includes its tool turn
        if t.finish_reason:
            done(t)
        else:
            submit(t)

    while True:
        admit()
        peak = max(peak, len(running) + in_tools)
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            gen_s += time.perf_counter() - t0
            steps += 1
            kv_sum += sum(len(t.prompt_ids) + len(t.response_ids) for t in running.values()) / kv_tokens
            for out in outs:
                if not out.finished:
                    continue
                t = running.pop(out.request_id)
                call = end_turn(t, *turn_tokens(out.outputs[0]), tokenizer, cfg)
                grown, turns = grown + len(out.outputs[0].token_ids), turns + 1
                if call is None:
                    done(t)
                elif isinstance(call, str):        # a parse error is its own tool output
                    after_tool(t, call)
                else:                              # (2) to the sandbox now; the engine goes on
                    in_tools += 1
                    sandbox.submit(*call).add_done_callback(lambda f, t=t: results.put((t, f)))
        elif in_tools:
            t0 = time.perf_counter()
            item = results.get()                   # (2) nothing to step: block, don't spin
            tool_wait_s += time.perf_counter() - t0
            results.put(item)
        elif not waiting and exhausted:
            break
        while not results.empty():                 # (2) tool results that have arrived
            t, fut = results.get()
            in_tools -= 1
            after_tool(t, fut.result())
    bar.close()
    trajs = _whole_batch(trajs, problem_queue, sandbox)
    finished_at.sort()
    return trajs, dict(
        trajectory_metrics(trajs), wall_seconds=time.perf_counter() - t_start, gen_seconds=gen_s,
        tool_wait_seconds=tool_wait_s, peak_admitted=peak, kv_utilisation=kv_sum / max(steps, 1),
        straggler_seconds=finished_at[-1] - statistics.median(finished_at) if finished_at else 0.0)
