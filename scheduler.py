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

    python scheduler.py --bench [--model DIR]    # lockstep vs scheduler, one engine (see bench())
"""
import itertools
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
        self.key, self.local = f"rollout-counter/{key}", itertools.count()

    def next(self) -> int:
        return next(self.local) if self.store is None else self.store.add(self.key, 1) - 1


def rollout_scheduled(engine, tokenizer, sandbox, problems: list[dict], n: int, cfg: RolloutConfig,
                      kv_tokens: int, overcommit: float = 1.0, counter: SharedCounter | None = None,
                      sampling=sampling_params, on_turn=end_turn):
    """Roll out n samples of every problem this rank pulls. Returns (trajectories, stats); with a
    distributed counter the trajectories are those of all ranks, in problem order. Under torchrun
    every rank calls this with the same problems and a SharedCounter(key, distributed=True) whose
    key is new for the batch; stats' seconds are this rank's, its counts the whole batch's.

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


# -----------------------------------------------------------------------------
# The benchmark

def bench():
    """Lockstep vs scheduler on one engine, the same problems and the same scripted workload.

    The model's habits are taken out of the measurement: each turn's length is forced (min_tokens =
    max_tokens = L, ignore_eos, the per-turn seed) and the script, not the text, decides whether a
    turn ends in a tool call, whose code is `time.sleep(x)`. Each trajectory draws 1-6 turns (a
    geometric tail), each turn's length from a log-normal (median 12 tokens, at most 160) and each
    tool latency from a log-normal (median 0.08 s, at most 2 s). As in the paper (§3.2), most
    trajectories are short and a few are long (the longest samples ~7x the median's tokens; the
    slowest tool call over 20x the median), so the turn-synchronous driver waits for the slowest
    turn and the slowest tool call at every turn. The default model is the untrained toy model:
    with forced lengths any model measures the same thing."""
    import argparse, math, os, random, subprocess, sys, tempfile
    p = argparse.ArgumentParser(description="Benchmark the scheduler against rollout.rollout_lockstep.")
    p.add_argument("--bench", action="store_true", required=True, help="run the benchmark")
    p.add_argument("--model", help="model folder (default: build the untrained toy model in a temp folder)")
    p.add_argument("--problems", type=int, default=32, help="problems in the batch")
    p.add_argument("--samples", type=int, default=4, help="rollouts per problem")
    p.add_argument("--seed", type=int, default=0, help="the workload is a function of this")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="the engine's KV cache in tokens")
    args = p.parse_args()
    # A shared CPU: vLLM's default of one OpenMP thread pinned to each core makes every step wait
    # for the busiest core (steps several times slower); one unpinned thread suits a tiny model.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rollout import kv_capacity_tokens, make_engine, rollout_lockstep
    from sandbox import Sandbox
    from vllm import SamplingParams
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="scheduler-bench-")     # removed when the bench ends
        subprocess.run([sys.executable, "data/prepare_toy.py", "--out", tmp.name, "--n-train", "50", "--n-test",
                        "20", "--n-sft", "200"], cwd=os.path.dirname(os.path.abspath(__file__)),
                       check=True, stdout=subprocess.DEVNULL)
        args.model = os.path.join(tmp.name, "init_model")
    rng, max_len = random.Random(args.seed), 1024
    problems = [{"question": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(args.problems)]
    plan = {(i, s): [(min(round(rng.lognormvariate(math.log(12), 1.1)) + 1, 160),  # (turn length,
                      min(rng.lognormvariate(math.log(0.08), 1.2), 2.0))           #  then tool seconds)
                     for _ in range(min(1 + int(rng.expovariate(0.6)), 6))]
            for i in range(args.problems) for s in range(args.samples)}

    def sampling(t, cfg, tokenizer):
        n = min(plan[t.index, t.sample][t.num_turns][0], cfg.max_response - len(t.response_ids))
        return SamplingParams(seed=hash((cfg.seed, t.index, t.sample, t.num_turns)) % 2**31, logprobs=0,
                              min_tokens=n, max_tokens=n, ignore_eos=True)

    def on_turn(t, ids, logprobs, tokenizer, cfg):      # end_turn's bookkeeping, the script's verdict
        t.response_ids += ids
        t.loss_mask += [1] * len(ids)
        t.logprobs += logprobs
        t.num_turns += 1
        turns = plan[t.index, t.sample]
        if t.num_turns == len(turns) or len(t.response_ids) >= cfg.max_response:
            t.finish_reason = "no_tool_call" if t.num_turns == len(turns) else "length"
            return None
        t.tool_calls += 1
        return f"import time; time.sleep({turns[t.num_turns - 1][1]:.3f})", ""

    tokens = sorted(sum(n for n, _ in turns) for turns in plan.values())
    tools = sorted(x for turns in plan.values() for _, x in turns[:-1])
    print(f"workload: {len(plan)} trajectories, {len(tools)} tool calls (seconds: median "
          f"{statistics.median(tools):.2f}, max {tools[-1]:.2f}), sampled tokens per trajectory: "
          f"median {statistics.median(tokens):.0f}, max {tokens[-1]}")
    with Sandbox(workers=8, timeout=10.0) as sandbox:
        llm = make_engine(args.model, max_model_len=max_len, kv_cache_tokens=args.kv_cache_tokens)
        tok, walls, kv = llm.get_tokenizer(), {}, kv_capacity_tokens(llm)
        longest_prompt = max(len(t.prompt_ids) for t in start_trajectories(tok, problems, 1))
        cfg = RolloutConfig(max_response=max_len - longest_prompt)        # one trajectory fills max_len
        print(f"engine: {kv} KV-cache tokens, room for {kv // max_len} trajectories of {max_len} tokens")
        llm.generate([{"prompt_token_ids": [0] * 8}], use_tqdm=False)    # warm-up
        for name in ("lockstep", "scheduler"):
            llm.reset_prefix_cache()                     # neither run reuses the other's prompts
            if name == "lockstep":
                _, st = rollout_lockstep(llm, tok, sandbox, problems, args.samples, cfg,
                                          sampling=sampling, on_turn=on_turn)
            else:
                _, st = rollout_scheduled(llm.llm_engine, tok, sandbox, problems, args.samples, cfg,
                                           kv, sampling=sampling, on_turn=on_turn)
            walls[name] = wall = st["wall_seconds"]
            print(f"{name:9s}: wall {wall:5.1f} s, {st['generated_tokens']} tokens, {st['tool_calls']} tool "
                  f"calls, {st['generated_tokens'] / wall:4.0f} tokens/s, engine idle {1 - st['gen_seconds'] / wall:3.0%}")
    print(f"scheduler speedup vs lockstep: {walls['lockstep'] / walls['scheduler']:.2f}")


if __name__ == "__main__":
    bench()
