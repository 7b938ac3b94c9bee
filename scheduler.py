"""The load-balanced rollout scheduler (paper §3.2): the fast driver of rollout.py's turn logic.

A turn-synchronous rollout (rollout.rollout_lockstep) wastes the engine three ways: short
trajectories wait for the longest one at every turn, tool calls wait to run as one batch, and
launching everything at once overflows the KV cache (the engine then preempts and recomputes).
This driver fixes all three:

1. KV-budget admission. Each running trajectory reserves its prompt plus the maximum response
   length in KV-cache tokens; new trajectories are admitted while the reservations fit the
   engine's capacity (times `overcommit`, default 1: never), and the moment one finishes its
   reservation is released and the next is admitted. All turns of a trajectory run on the engine
   that admitted it, so its earlier turns stay in the prefix cache.
2. Asynchronous tool calls. When a turn ends with a tool call it goes to the sandbox at once; the
   engine keeps stepping the other trajectories; when the result arrives its tool turn is
   appended and the next turn is queued. With nothing to step the loop blocks on the results
   queue: it never spins.
3. Dynamic balance across ranks. Under torchrun each rank drives its own engine and pulls the next
   problem from one shared counter in torch.distributed's key-value store whenever it has room,
   so a rank slowed by long trajectories or slow tools simply takes fewer problems. The finished
   trajectories are gathered so that every rank returns the whole batch, in problem order.

Same turn logic, same per-turn seeds as the lockstep driver: the same inputs give the same
trajectories, up to vLLM's numerics changing with batch composition (see tests).
"""
import queue
import statistics
import time
from collections import deque

from rollout import (RolloutConfig, add_tool_turn, batch_stats, end_turn, finish, sampled,
                     sampling_params, start_trajectories)


def _default_store():
    """torch.distributed's key-value store of the default process group (torch 2.13 keeps the
    accessor private; every rank already shares this store, so no new port is needed)."""
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


class SharedCounter:
    """Hands out problem indices 0, 1, 2, ...: a local counter on one rank, an atomic counter in
    torch.distributed's key-value store across ranks (3). `key` must be new for every batch."""

    def __init__(self, key: str = "", distributed: bool = False):
        self.store = _default_store() if distributed else None
        self.key, self.n = f"rollout-counter/{key}", 0

    def next(self) -> int:
        if self.store is None:
            self.n += 1
            return self.n - 1
        return self.store.add(self.key, 1) - 1


def rollout_scheduled(engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                      kv_tokens: int, overcommit: float = 1.0, counter: SharedCounter | None = None,
                      sampling=sampling_params, on_turn=end_turn):
    """Roll out n samples of every problem this rank pulls. Returns (trajectories, stats); with a
    distributed counter the trajectories are those of all ranks, in problem order.

    engine: a vLLM LLMEngine (llm.llm_engine) or anything with add_request / step /
    has_unfinished_requests. kv_tokens: its KV-cache capacity (rollout.kv_capacity_tokens).
    sampling / on_turn: the turn logic; benchmarks replace them to script a workload."""
    from tqdm import tqdm
    counter = counter or SharedCounter()
    budget = kv_tokens * overcommit
    results = queue.SimpleQueue()        # (trajectory, future) put by the sandbox's threads (2)
    waiting, running, trajs = deque(), {}, []  # pulled-not-admitted, request id -> traj, admitted
    reserved, in_tools, exhausted = 0, 0, False
    gen_s = idle_s = kv_sum = 0.0
    steps, peak, finished_at, t_start = 0, 0, [], time.perf_counter()
    bar = tqdm(total=len(problems) * n, desc="rollouts", unit="traj", leave=False)

    def cost(t):                                   # (1) prompt + the whole response budget
        return len(t.prompt_ids) + cfg.max_response

    def submit(t):                                 # queue t's next turn on this engine
        rid = f"{t.index}-{t.sample}-{t.num_turns}"
        running[rid] = t
        engine.add_request(rid, {"prompt_token_ids": t.prompt_ids + t.response_ids},
                           sampling(t, cfg, tokenizer))

    def admit():                                   # (1) admit while the reservations fit, (3) pull
        nonlocal reserved, exhausted
        while True:
            if not waiting:
                if exhausted or (reserved and budget - reserved < cfg.max_response):
                    return
                i = counter.next()
                if i >= len(problems):
                    exhausted = True
                    return
                waiting.extend(start_trajectories(tokenizer, [problems[i]], n, offset=i))
            if reserved and reserved + cost(waiting[0]) > budget:
                return                             # an empty engine always takes one
            t = waiting.popleft()
            reserved += cost(t)
            trajs.append(t)
            submit(t)

    def done(t):
        nonlocal reserved
        reserved -= cost(t)                        # (1) release; admit() refills next round
        finished_at.append(time.perf_counter() - t_start)
        bar.update(1)

    def after_tool(t, result):
        add_tool_turn(t, result, tokenizer, cfg)
        done(t) if t.finish_reason else submit(t)

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
                call = on_turn(t, *sampled(out.outputs[0]), tokenizer, cfg)
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
            idle_s += time.perf_counter() - t0
            results.put(item)
        elif not waiting and exhausted:
            break
        while not results.empty():                 # (2) tool results that have arrived
            t, fut = results.get()
            in_tools -= 1
            after_tool(t, fut.result())
    bar.close()
    finish(trajs, sandbox)
    if counter.store is not None:                  # (3) every rank gets the whole batch
        import torch.distributed as dist
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, trajs)
        trajs = [t for part in parts for t in part]
    trajs.sort(key=lambda t: (t.index, t.sample))
    finished_at.sort()
    return trajs, batch_stats(
        trajs, wall_seconds=time.perf_counter() - t_start, gen_seconds=gen_s, idle_seconds=idle_s,
        peak_admitted=peak, kv_utilisation=kv_sum / max(steps, 1),
        straggler_seconds=finished_at[-1] - statistics.median(finished_at) if finished_at else 0.0)
