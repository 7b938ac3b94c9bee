"""Benchmark: the load-balanced scheduler against the turn-synchronous driver on one vLLM engine.

    python bench/scheduler.py                  # the untrained toy model, built in a temporary folder
    python bench/scheduler.py --model DIR

Both drivers run the same problems through the same real engine and the same sandbox, with a
scripted workload that takes the model's habits out of the measurement: a ScriptedEngine forces
each turn's length (min_tokens = max_tokens, ignore_eos) and hands the driver, in place of what
the model wrote, a turn of exactly that many tokens that ends in a tool call running
`time.sleep(x)` or in an answer. Each trajectory draws 1-6 turns (a geometric tail), each turn's
length from a log-normal (median 40 tokens, at most 200) and each tool latency from a log-normal
(median 0.08 s, at most 2 s). As in the paper (§3.2), most trajectories are short and a few are
long, so the turn-synchronous driver waits for the slowest turn and the slowest tool call at every
turn. The last line: `scheduler speedup vs lockstep: <x>`.
"""
import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# A shared CPU: vLLM's default of one OpenMP thread pinned to each core makes every step wait for
# the busiest core (steps several times slower); one unpinned thread suits a tiny model.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from engine import make_engine  # noqa: E402
from rollout import IM_END, RolloutConfig, render_tool_call, start_trajectories  # noqa: E402
from sandbox import Sandbox  # noqa: E402
from scheduler import rollout_lockstep, rollout_scheduled  # noqa: E402
from vllm import SamplingParams  # noqa: E402

parser = argparse.ArgumentParser(description="Benchmark the rollout scheduler against the lockstep driver.")
parser.add_argument("--model", help="model folder (default: build the untrained toy model in a temp folder)")
parser.add_argument("--problems", type=int, default=32, help="problems in the batch")
parser.add_argument("--samples", type=int, default=4, help="rollouts per problem")
parser.add_argument("--kv-cache-tokens", type=int, default=65536, help="the engine's KV cache in tokens")
parser.add_argument("--seed", type=int, default=0, help="the workload is a function of this")
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


class ScriptedEngine:
    """A vLLM LLMEngine whose turns follow the plan: each request generates exactly the planned
    number of tokens, and the finished turn the driver sees is the script's, of the same length."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer
        self.vllm_config = engine.vllm_config  # (the scheduler reads the KV-cache size from it)
        self.filler = tokenizer.encode(" ", add_special_tokens=False)

    def scripted_ids(self, index, sample, turn):
        turns = plan[index, sample]
        if turn + 1 < len(turns):  # a tool call that sleeps for the planned time
            text = "</reason>" + render_tool_call(f"import time; time.sleep({turns[turn][1]:.3f})") + IM_END
        else:
            text = "</reason><answer>\\boxed{0}</answer>" + IM_END
        ids = self.tok.encode(text, add_special_tokens=False)
        return self.filler * (self.length(index, sample, turn) - len(ids)) + ids

    def length(self, index, sample, turn):
        """The planned length, or the script's own if longer (a tool call needs ~40 tokens)."""
        ending = 60 if turn + 1 < len(plan[index, sample]) else 20
        return max(plan[index, sample][turn][0], ending)

    def add_request(self, request_id, prompt, params):
        index, sample, turn = map(int, request_id.split("-"))
        n = min(self.length(index, sample, turn), params.max_tokens)
        forced = SamplingParams(temperature=params.temperature, seed=params.seed, logprobs=0, min_tokens=n,
                                max_tokens=n, ignore_eos=True)
        self.engine.add_request(request_id, prompt, forced)

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def step(self):
        outs = []
        for out in self.engine.step():
            if out.finished:
                index, sample, turn = map(int, out.request_id.split("-"))
                ids = self.scripted_ids(index, sample, turn)[:len(out.outputs[0].token_ids)]
                logprobs = [{t: SimpleNamespace(logprob=0.0)} for t in ids]
                out = SimpleNamespace(request_id=out.request_id, finished=True,
                                      outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)])
            outs.append(out)
        return outs


# -----------------------------------------------------------------------------
# The model: any folder, or the untrained toy model (with forced lengths any model measures the same).

if args.model is None:
    tmp = tempfile.TemporaryDirectory(prefix="scheduler-bench-")  # removed when the bench ends
    subprocess.run([sys.executable, "data/prepare_toy.py", "--out", tmp.name, "--n-train", "50", "--n-test", "20",
                    "--n-sft", "200"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    args.model = os.path.join(tmp.name, "init_model")

problems = [{"question": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(args.problems)]
max_len = 1024  # the toy model's context
tokens = sorted(sum(n for n, _ in turns) for turns in plan.values())
tools = sorted(x for turns in plan.values() for _, x in turns[:-1])
print(f"workload: {len(plan)} trajectories, {len(tools)} tool calls (seconds: median "
      f"{statistics.median(tools):.2f}, max {tools[-1]:.2f}), sampled tokens per trajectory: "
      f"median {statistics.median(tokens):.0f}, max {tokens[-1]}")

with Sandbox(workers=8, timeout=10.0) as sandbox:
    llm = make_engine(args.model, max_model_len=max_len, kv_cache_tokens=args.kv_cache_tokens)
    tok = llm.get_tokenizer()
    longest_prompt = max(len(t.prompt_ids) for t in start_trajectories(tok, problems, 1))
    cfg = RolloutConfig(max_response=max_len - longest_prompt)  # one trajectory may fill max_len
    print(f"engine: {args.kv_cache_tokens} KV-cache tokens, room for {args.kv_cache_tokens // max_len} "
          f"trajectories of {max_len} tokens")
    llm.generate([{"prompt_token_ids": [0] * 8}], use_tqdm=False)  # warm-up
    walls = {}
    for name, driver in (("lockstep", rollout_lockstep), ("scheduler", rollout_scheduled)):
        llm.reset_prefix_cache()  # neither run reuses the other's prompts
        _, stats = driver(ScriptedEngine(llm.llm_engine, tok), tok, sandbox, problems, args.samples, cfg)
        walls[name] = wall = stats["wall_seconds"]
        print(f"{name:9s}: wall {wall:5.1f} s, {stats['generated_tokens']} tokens, {stats['tool_calls']} tool "
              f"calls, {stats['generated_tokens'] / wall:4.0f} tokens/s, "
              f"engine idle {1 - stats['gen_seconds'] / wall:3.0%}")
print(f"scheduler speedup vs lockstep: {walls['lockstep'] / walls['scheduler']:.2f}")
