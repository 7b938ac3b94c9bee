"""Benchmark: the load-balanced scheduler against the turn-synchronous driver and against
asynchronous rollouts without admission control, on real vLLM engines.

    python bench/scheduler_speed.py            # the untrained toy model, built in a temporary folder
    python bench/scheduler_speed.py --model DIR
    python bench/scheduler_speed.py --rounds 3 # async and scheduler 3 times per regime, the fastest counts

Three arms run the same problems through the same engine and the same sandbox:
- lockstep: scheduler.rollout_lockstep, turn k of every trajectory, then turn k's tool calls.
- async: what peers' agent loops do (verl's AgentLoop, the official rStar2-Agent release): every
  trajectory's first turn added at once, each tool call sent to the sandbox the moment its turn
  ends, no admission control: vLLM queues what does not fit and preempts running requests (to
  recompute them later) when the KV cache runs out. rollout_async below, the same turn logic.
- scheduler: scheduler.rollout_scheduled, admission by KV budget, asynchronous tools, refill.

A scripted workload takes the model's habits out of the measurement: a ScriptedEngine forces each
turn's length (min_tokens = max_tokens, ignore_eos) and hands the driver, in place of what the
model wrote, a turn of exactly that many tokens that ends in a tool call running `time.sleep(x)`
or in an answer. Each trajectory draws 1-6 turns (a geometric tail), each turn's length from a
log-normal (median 40 tokens, at most 200) and each tool latency from a log-normal (median 0.08 s,
at most 2 s). As in the paper (§3.2), most trajectories are short and a few are long.

Three regimes, one engine each, sized in KV-cache tokens: the workload's worst-case KV demand
(every trajectory resident at once at its final length, in whole KV blocks) over the engine's
capacity is 1 (ample: everything fits), 2 or 4. Per arm and regime: wall time, sampled tokens per
second, the engine's idle share (wall time not spent in the engine's step()), vLLM's preemption count and
the prompt tokens each turn had to prefill (those not found in the prefix cache). The last lines:
`scheduler speedup vs lockstep: <x>` (the 2x regime) and
`scheduler speedup vs async: ample <a>, 2x <b>, 4x <c>`. About 4 minutes on 2 CPU cores.
"""
import argparse
import gc
import math
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# A shared CPU: vLLM's default of one OpenMP thread pinned to each core makes every step wait for
# the busiest core (steps several times slower); one unpinned thread suits a tiny model.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from infra.engine import CPU_BLOCK, kv_capacity_tokens, make_engine, turn_tokens  # noqa: E402
from conversation import IM_END, render_tool_call, render_tool_turn  # noqa: E402
from rollout import (RolloutConfig, add_tool_turn, end_turn, sampling_params, score,  # noqa: E402
                     start_trajectories, trajectory_metrics)
from sandbox import Sandbox  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from scheduler import request_id, rollout_lockstep, rollout_scheduled  # noqa: E402
from vllm import SamplingParams  # noqa: E402

parser = argparse.ArgumentParser(description="Benchmark the rollout scheduler against lockstep and async.")
parser.add_argument("--model", help="model folder (default: build the untrained toy model in a temp folder)")
parser.add_argument("--problems", type=int, default=32, help="problems in the batch")
parser.add_argument("--samples", type=int, default=4, help="rollouts per problem")
parser.add_argument("--seed", type=int, default=0, help="the workload is a function of this")
parser.add_argument("--rounds", type=int, default=1,
                    help="runs of async and scheduler per regime (alternating); speedups take the fastest")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# The workload: per trajectory, a list of (turn length in tokens, seconds of its tool call).

rng = random.Random(args.seed)
plan = {}
for i in range(args.problems):
    for s in range(args.samples):
        n_turns = min(1 + int(rng.expovariate(0.6)), 6)
        plan[i, s] = [(min(round(rng.lognormvariate(math.log(40), 0.9)), 200),
                       min(rng.lognormvariate(math.log(0.08), 1.2), 2.0)) for _ in range(n_turns)]


def vllm_requests(engine) -> dict:
    """The requests vLLM's scheduler holds (waiting, running or preempted), by id. vllm 0.32's
    in-process engine core keeps them in its scheduler's `requests`, each counting its own
    preemptions (`num_preemptions`); with stats off (the LLM class's default) nothing else does."""
    return engine.engine_core.engine_core.scheduler.requests


class ScriptedEngine:
    """A vLLM LLMEngine whose turns follow the plan: each request generates exactly the planned
    number of tokens, and the finished turn the driver sees is the script's, of the same length.
    A later turn's prompt gets the engine's own sampled tokens back in place of the script's, so
    that earlier turns hit the prefix cache as in a real rollout. It counts vLLM's preemptions and
    the prompt tokens prefilled without a prefix-cache hit."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer
        self.vllm_config = engine.vllm_config  # (the scheduler reads the KV-cache size from it)
        self.filler = tokenizer.encode(" ", add_special_tokens=False)
        self.preemptions, self.prefilled, self.sampled = {}, 0, {}

    def scripted_ids(self, index, sample, turn):
        turns = plan[index, sample]
        if turn + 1 < len(turns):  # a tool call that sleeps for the planned time
            text = "</reason>" + render_tool_call(f"import time; time.sleep({turns[turn][1]:.3f})") + IM_END
        else:
            text = "</reason><answer>\\boxed{0}</answer>" + IM_END
        ids = self.tok.encode(text, add_special_tokens=False)
        return self.filler * (length(index, sample, turn) - len(ids)) + ids

    def add_request(self, request_id, prompt, params):
        index, sample, turn = map(int, request_id.split("-"))
        ids = list(prompt["prompt_token_ids"])
        for start, sampled_ids in self.sampled.get((index, sample), []):
            ids[start:start + len(sampled_ids)] = sampled_ids  # the engine's own tokens: prefix-cache hits
        n = min(length(index, sample, turn), params.max_tokens)
        forced = SamplingParams(temperature=params.temperature, seed=params.seed, logprobs=0, min_tokens=n,
                                max_tokens=n, ignore_eos=True)
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, forced)

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def step(self):
        outs = []
        for out in self.engine.step():
            if out.finished:
                self.prefilled += len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
                index, sample, turn = map(int, out.request_id.split("-"))
                self.sampled.setdefault((index, sample), []).append(
                    (len(out.prompt_token_ids), list(out.outputs[0].token_ids)))
                ids = self.scripted_ids(index, sample, turn)[:len(out.outputs[0].token_ids)]
                logprobs = [{t: SimpleNamespace(logprob=0.0)} for t in ids]
                out = SimpleNamespace(request_id=out.request_id, finished=True,
                                      outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)])
            outs.append(out)
        # a request is never preempted and finished in the same step: reading after each step counts all
        self.preemptions.update((rid, r.num_preemptions) for rid, r in vllm_requests(self.engine).items())
        return outs


def length(index, sample, turn):
    """The planned length, or the script's own if longer (a tool call needs ~40 tokens)."""
    ending = 60 if turn + 1 < len(plan[index, sample]) else 20
    return max(plan[index, sample][turn][0], ending)


# -----------------------------------------------------------------------------
# The async arm: peers' agent loop, no admission control.


def rollout_async(engine, tokenizer, sandbox, problems, n, cfg):
    """Every trajectory's first turn added at once; each tool call to the sandbox as its turn ends,
    its result's next turn added when it arrives. vLLM's scheduler decides what runs."""
    trajs = start_trajectories(tokenizer, problems, n)
    results, running, in_tools = queue.SimpleQueue(), {}, 0
    gen_s, t_start = 0.0, time.perf_counter()

    def submit(t):
        running[request_id(t)] = t
        engine.add_request(request_id(t), {"prompt_token_ids": t.prompt_ids + t.response_ids},
                           sampling_params(t, cfg, tokenizer))

    for t in trajs:
        submit(t)
    while running or in_tools:
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            gen_s += time.perf_counter() - t0
        else:
            outs = []
            results.put(results.get())  # nothing to step: wait for a tool result
        for out in outs:
            if not out.finished:
                continue
            t = running.pop(out.request_id)
            call = end_turn(t, *turn_tokens(out.outputs[0]), tokenizer, cfg)
            if call is not None and call.error is None:
                in_tools += 1
                future = sandbox.submit(call.code, call.stdin)
                future.add_done_callback(lambda f, t=t: results.put((t, f.result())))
            elif call is not None:  # a parse error is its own tool output
                results.put((t, call.error))
                in_tools += 1
        while not results.empty():
            t, result = results.get()
            in_tools -= 1
            add_tool_turn(t, result, tokenizer, cfg)
            if not t.finish_reason:
                submit(t)
    score(trajs, sandbox, cfg)
    wall = time.perf_counter() - t_start
    return trajs, dict(trajectory_metrics(trajs), wall_seconds=wall, gen_seconds=gen_s)


# -----------------------------------------------------------------------------
# The model: any folder, or the untrained toy model (with forced lengths any model measures the same).

if args.model is None:
    tmp = tempfile.TemporaryDirectory(prefix="scheduler-bench-")  # removed when the bench ends
    subprocess.run([sys.executable, "data/prepare_toy.py", "--out", tmp.name, "--n-train", "50",
                    "--n-test", "20",
                    "--n-sft", "200"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    args.model = os.path.join(tmp.name, "init_model")

problems = [{"question": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(args.problems)]
max_len = 1024  # the toy model's context
tokens = sorted(sum(length(*key, k) for k in range(len(turns))) for key, turns in plan.items())
tools = sorted(x for turns in plan.values() for _, x in turns[:-1])
print(f"workload: {len(plan)} trajectories, {len(tools)} tool calls (seconds: median "
      f"{statistics.median(tools):.2f}, max {tools[-1]:.2f}), sampled tokens per trajectory: "
      f"median {statistics.median(tokens):.0f}, max {tokens[-1]}")

tok = AutoTokenizer.from_pretrained(args.model)
start = {(t.index, t.sample): t for t in start_trajectories(tok, problems, args.samples)}
cfg = RolloutConfig(max_response=max_len - max(len(t.prompt_ids) for t in start.values()))
tool_turn = len(tok.encode(render_tool_turn("(no output)"), add_special_tokens=False))  # sleep prints nothing
final = [min(len(start[key].prompt_ids) + sum(length(*key, k) for k in range(len(turns)))
             + tool_turn * (len(turns) - 1), max_len) for key, turns in plan.items()]
demand = sum(-(-x // CPU_BLOCK) * CPU_BLOCK for x in final)
print(f"worst-case KV demand: {demand} tokens (every trajectory at its final length, in whole blocks)")

arms = {"lockstep": rollout_lockstep, "async": rollout_async, "scheduler": rollout_scheduled}
walls = {}
with Sandbox(workers=8, timeout=10.0) as sandbox:
    for regime, factor in (("ample", 1), ("2x", 2), ("4x", 4)):
        llm = make_engine(args.model, max_model_len=max_len, kv_cache_tokens=demand // factor)
        capacity = kv_capacity_tokens(llm.llm_engine)
        print(f"{regime}: engine of {capacity} KV-cache tokens, demand / capacity {demand / capacity:.2f}")
        llm.generate([{"prompt_token_ids": [0] * 8}], use_tqdm=False)  # warm-up
        for round_ in range(args.rounds):
            for name, driver in arms.items():
                if name == "lockstep" and round_ > 0:
                    continue  # (several times slower: once is enough)
                llm.reset_prefix_cache()  # no run reuses another's prompts
                scripted = ScriptedEngine(llm.llm_engine, tok)
                _, stats = driver(scripted, tok, sandbox, problems, args.samples, cfg)
                wall = stats["wall_seconds"]
                walls[regime, name] = min(wall, walls.get((regime, name), wall))
                print(f"  {name:9s}: wall {wall:5.1f} s, {stats['generated_tokens'] / wall:5.0f} tokens/s, "
                      f"engine idle {1 - stats['gen_seconds'] / wall:3.0%}, "
                      f"{sum(scripted.preemptions.values()):3d} preemptions, {scripted.prefilled:5d} tokens "
                      f"prefilled (load average {os.getloadavg()[0]:.1f})")
        del llm, scripted
        gc.collect()
print(f"scheduler speedup vs lockstep: {walls['2x', 'lockstep'] / walls['2x', 'scheduler']:.2f}")
versus_async = [f"{r} {walls[r, 'async'] / walls[r, 'scheduler']:.2f}" for r in ("ample", "2x", "4x")]
print(f"scheduler speedup vs async: {', '.join(versus_async)}")
