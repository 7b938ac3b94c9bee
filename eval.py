"""Evaluate a checkpoint on math benchmarks with tool use, as the paper does (§5.1).

    python eval.py --model runs/stage3 --benchmarks aime24 aime25 hmmt25 math500
    python eval.py --model runs/toy_sft --benchmarks data/toy/test.jsonl --n 4 --max-response 1024
    torchrun --nproc_per_node=8 eval.py --model runs/stage3 --benchmarks aime24 aime25 --samples 16
    python eval.py --model runs/stage2 --filter-solved 8 --data data/rl.jsonl --out data/rl_hard.jsonl

- The settings: same prompt, rollout code (scheduler.py) and reward as training; defaults are the
  paper's: temperature 0.6, 16 samples per problem, up to 30K tokens, T = 30 turns.
- The table, one per run: avg pass@1 (the share of correct samples: `correct`, never the reward, which
  a fork may shape), unbiased pass@k (pass_at_k) for k = 2, 4, ... up to n, mean response length in
  tokens (sampled and tool tokens), mean tool calls, tool-error ratio (failed calls / calls), share
  truncated, tool-use rate (share of samples with at least one tool call): rollout.trajectory_metrics.
  A sample the sandbox failed (a worker died, a check did not finish) is not scored: it is counted
  in its own column and left out of every rate; pass@k then uses the problem's scored samples.
- Under torchrun every rank runs its own engine and pulls problems from a shared counter; the
  trajectories' numbers and text are gathered; rank 0 prints the table, writes table.json + samples.jsonl.
- --filter-solved K: the stage-3 difficulty filter. Sample K rollouts per training problem and
  keep the problems not solved K/K (original fields kept); --min-solved M also drops those solved
  fewer than M times, a pass-rate band for a stage's data. Sampling then defaults to the stage-2
  training settings (temperature 1.0, 12K tokens, T = 10); explicit flags still win.
"""
import argparse
import itertools
import json
import math
import os
import time
from collections import defaultdict

from conversation import prompt_ids
from infra.batch import ProblemQueue
from infra.engine import add_engine_flags, make_engine, model_eos_ids
from infra.training import WAIT_TIMEOUT_MINUTES, cpu_group, init_distributed
from rollout import (EVALUATION, STAGE_ROLLOUTS, RolloutConfig, add_rollout_flags, drop_long_prompts,
                     read_problems, rollout_config, trajectory_metrics)
from sandbox import TOOL_TIMEOUT, Sandbox
from scheduler import rollout_scheduled

# -----------------------------------------------------------------------------
# Arguments. Defaults are the paper's evaluation settings; --filter-solved uses training's.

FILTER_DEFAULTS = dict(temperature=RolloutConfig.temperature, **STAGE_ROLLOUTS[2])


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Evaluate a checkpoint with tool use: avg pass@1, pass@k, lengths, tool statistics.")
    parser.add_argument("--model", required=True, help="HF checkpoint to evaluate (local path or hub id)")
    parser.add_argument("--benchmarks", nargs="+", default=["aime24", "aime25"],
                        help="names (aime24 aime25 hmmt25 math500) or local JSONL paths")
    parser.add_argument("--eval-dir", default="data/eval",
                        help="where named benchmarks are cached (data/prepare_eval.py)")
    parser.add_argument("--n", "--samples", type=int, default=16, dest="n",
                        help="samples per problem (--samples under torchrun, which takes --n for itself)")
    rollouts = add_rollout_flags(parser, **EVALUATION)  # the paper's settings
    rollouts.add_argument("--max-prompt", type=int, default=4096,
                          help="problems whose prompt has more tokens are dropped (and counted)")
    parser.add_argument("--dist-timeout-minutes", type=float, default=WAIT_TIMEOUT_MINUTES,
                        help="under torchrun: how long a rank may wait for the others' rollouts")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="engine context (default: longest prompt + --max-response, at most the model's)")
    add_engine_flags(parser, memory_fraction=0.85)
    parser.add_argument("--tool-workers", type=int, default=None,
                        help="sandbox workers per rank (default: the node's CPU cores shared among its ranks)")
    parser.add_argument("--tool-timeout", type=float, default=TOOL_TIMEOUT, help="seconds a tool call may run")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--first", type=int, default=None,
                        help="only the first N problems of each file (e.g. the stage-3 filter on a sample)")
    parser.add_argument("--out-dir", default=None,
                        help="where table.json, samples.jsonl and eval_config.json go (results/<model name>)")
    parser.add_argument("--filter-solved", type=int, default=0, metavar="K",
                        help="stage-3 filter: sample K per problem of --data; those not solved K/K go to --out")
    parser.add_argument("--min-solved", type=int, default=0, metavar="M",
                        help="with --filter-solved K: keep only the problems solved M to K-1 times in K")
    parser.add_argument("--data", default=None, help="with --filter-solved: the training JSONL to filter")
    parser.add_argument("--out", default=None, help="with --filter-solved: where the unsolved problems go")
    if parser.parse_known_args(argv)[0].filter_solved:  # training's sampling; explicit flags win
        parser.set_defaults(**FILTER_DEFAULTS)
    args = parser.parse_args(argv)
    if args.min_solved and not 0 < args.min_solved < args.filter_solved:
        parser.error("--min-solved M needs --filter-solved K > M\n---> HINT: --filter-solved 8 --min-solved 1")
    if args.filter_solved and not (args.data and args.out):
        parser.error("--filter-solved needs --data and --out\n"
                     "---> HINT: python eval.py --model runs/stage2 --filter-solved 8 --data data/rl.jsonl "
                     "--out data/rl_hard.jsonl")
    if args.out_dir is None:
        args.out_dir = os.path.join("results", os.path.basename(os.path.normpath(args.model)))
    return args


# -----------------------------------------------------------------------------
# The table's metrics: pure functions of graded samples, tested without a model.

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), computed as
    1 - prod_{i=n-c+1..n} (1 - k/i) so that large n neither overflows nor loses precision."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def table_ks(n: int) -> list[int]:
    """The k of the table's pass@k columns: powers of two from 2 up to n, and n itself."""
    return sorted({2 ** e for e in range(1, n.bit_length()) if 2 ** e <= n} | ({n} if n > 1 else set()))


TABLE_METRICS = ["response_length", "tool_calls", "tool_error_ratio", "truncated", "tool_use",
                 "sandbox_failures"]


def benchmark_row(name: str, trajs: list, n: int) -> dict:
    """One table row from a benchmark's graded trajectories (n per problem, t.index the problem)."""
    scored, correct = defaultdict(int), defaultdict(int)
    for t in trajs:
        scored[t.index] += not t.sandbox_failed
        correct[t.index] += t.correct and not t.sandbox_failed
    metrics = trajectory_metrics(trajs)
    row = {"benchmark": name, "problems": len(scored), "samples": len(trajs),
           "avg_pass@1": metrics["accuracy"]}
    for k in table_ks(n):
        per_problem = [pass_at_k(m, correct[i], min(k, m)) for i, m in scored.items() if m]
        row[f"pass@{k}"] = sum(per_problem) / max(len(per_problem), 1)
    return dict(row, **{key: metrics[key] for key in TABLE_METRICS})


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table; rates in percent."""
    ks = [key for key in rows[0] if key.startswith("pass@")]
    head = ["benchmark", "problems", "samples", "avg@1", *ks, "resp tok", "tool calls", "tool err", "trunc",
            "tool use", "sandbox failed"]
    lines = [[r["benchmark"], str(r["problems"]), str(r["samples"]), f"{100 * r['avg_pass@1']:.1f}"]
             + [f"{100 * r[k]:.1f}" for k in ks]
             + [f"{r['response_length']:.0f}", f"{r['tool_calls']:.2f}", f"{100 * r['tool_error_ratio']:.1f}",
                f"{100 * r['truncated']:.1f}", f"{100 * r['tool_use']:.1f}", str(r["sandbox_failures"])]
             for r in rows]
    width = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]

    def fmt(cells):  # the first column to the left, numbers to the right
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, width)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in width)] + [fmt(x) for x in lines])


def select_unsolved(problems: list[dict], trajs: list, k: int, min_solved: int = 0) -> list[dict]:
    """(--filter-solved) The problems solved (`correct`) at least min_solved times but not k/k, in order, each
    with its pass_rate (solved / k); a sample the sandbox failed is unsolved. Every problem needs k samples."""
    tried, solved = defaultdict(int), defaultdict(int)
    for t in trajs:
        tried[t.index] += 1
        solved[t.index] += t.correct and not t.sandbox_failed
    if any(tried[i] != k for i in range(len(problems))) or len(tried) != len(problems):
        raise ValueError(f"select_unsolved needs exactly {k} graded samples per problem")
    return [dict(p, pass_rate=solved[i] / k) for i, p in enumerate(problems) if min_solved <= solved[i] < k]


def benchmark_path(benchmark: str, eval_dir: str) -> str:
    """A benchmark's JSONL: a path as given, a name (aime24, ...) in eval_dir, written by prepare_eval.py."""
    if benchmark.endswith(".jsonl") or os.path.exists(benchmark):
        return benchmark
    path = os.path.join(eval_dir, f"{benchmark}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such benchmark\n---> HINT: `python data/prepare_eval.py --out-dir "
                                f"{eval_dir}` gets aime24, aime25, hmmt25, math500; or pass a JSONL's path")
    return path


def short_names(paths: list[str]) -> list[str]:
    """Table names: each file's name without .jsonl, unless two would collide (then the paths)."""
    names = [os.path.basename(p).removesuffix(".jsonl") for p in paths]
    return names if len(set(names)) == len(names) else list(paths)


# -----------------------------------------------------------------------------
# Rollouts (1, 3): all benchmarks in one scheduled batch, so ranks balance across all of them.

_batches = itertools.count()  # shared-counter keys; every rank calls evaluate in the same order


def evaluate(llm, tokenizer, sandbox, benchmarks: dict[str, list[dict]], cfg: RolloutConfig, n: int,
             distributed: bool = False) -> tuple[list[dict], list[dict], list]:
    """Roll out n samples of every problem of every benchmark and grade them. Returns (table rows, one
    per benchmark; samples, one dict per trajectory for samples.jsonl; the trajectories)."""
    names, problems = [], []
    for name, probs in benchmarks.items():
        names += [(name, i) for i in range(len(probs))]
        problems += probs
    group = cpu_group() if distributed else None  # ranks that finish early wait on gloo, not NCCL
    problem_queue = ProblemQueue(f"eval/{next(_batches)}", distributed, group, with_text=True)
    trajs, _ = rollout_scheduled(llm.llm_engine, tokenizer, sandbox, problems, n, cfg, problem_queue)
    samples = [{"benchmark": names[t.index][0], "problem": names[t.index][1], "sample": t.sample,
                "question": problems[t.index]["question"], "gold": t.gold, "answer": t.answer,
                "correct": t.correct, "reward": t.reward, "sandbox_failed": t.sandbox_failed,
                "finish_reason": t.finish_reason, "turns": t.num_turns, "tool_calls": t.tool_calls,
                "tool_failures": dict(t.tool_failures), "response_tokens": t.response_length,
                "text": t.text} for t in trajs]
    rows = [benchmark_row(name, [t for t in trajs if names[t.index][0] == name], n) for name in benchmarks]
    return rows, samples, trajs


# -----------------------------------------------------------------------------

def main(argv=None, llm=None):
    """The CLI. Returns (table rows, samples as written to samples.jsonl, the graded trajectories); `llm`:
    an engine already made (tests share one)."""
    args = get_args(argv)
    filtering = args.filter_solved > 0
    n = args.filter_solved if filtering else args.n

    # -- compute: torchrun -> one engine per rank in the ranks' process group; else no group
    distributed, rank = "RANK" in os.environ, 0
    if distributed:
        import torch.distributed as dist
        rank = init_distributed(wait_minutes=args.dist_timeout_minutes)[0]
    master = rank == 0

    # -- data (before the engine: the longest prompt sizes its context); overlong prompts are dropped
    from transformers import AutoConfig, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    paths = [args.data] if filtering else [benchmark_path(b, args.eval_dir) for b in args.benchmarks]
    benchmarks = {}
    for name, path in zip(short_names(paths), paths):
        problems = read_problems(path)[:args.first]
        benchmarks[name], n_long = drop_long_prompts(problems, tokenizer, args.max_prompt, args.tools)
        if n_long and master:
            print(f"{name}: dropped {n_long} problems with a prompt over {args.max_prompt} tokens")
    if not all(benchmarks.values()):
        raise ValueError(f"no problem left in {[b for b, p in benchmarks.items() if not p]}\n"
                         f"---> HINT: raise --max-prompt (every prompt there is longer)")
    longest = max(len(prompt_ids(tokenizer, p["question"], args.tools)) for b in benchmarks.values() for p in b)
    context = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    if args.max_model_len is None:
        args.max_model_len = longest + args.max_response
        if context and args.max_model_len > context:
            args.max_model_len = context
    if longest + args.max_response > args.max_model_len:
        cut = args.max_model_len - longest
        if cut < 16:
            raise ValueError(f"the longest prompt has {longest} tokens; --max-model-len {args.max_model_len} "
                             f"leaves no room to answer\n"
                             f"---> HINT: raise --max-model-len (the model's context is {context} tokens)")
        if master:
            print(f"warning: --max-response cut from {args.max_response} to {cut} tokens so that the longest "
                  f"prompt ({longest} tokens) and a response fit in {args.max_model_len} tokens")
        args.max_response = cut
    config = vars(args)
    if master:
        print(json.dumps(config, indent=2))
        print(f"{sum(map(len, benchmarks.values()))} problems x {n} samples, longest prompt {longest} tokens")

    # -- engine + sandbox
    if llm is None:
        llm = make_engine(args.model, args.max_model_len, seed=args.seed,
                          memory_fraction=args.memory_fraction, kv_cache_tokens=args.kv_cache_tokens,
                          external_launcher=distributed)
    cfg = rollout_config(args, seed=args.seed, eos_ids=model_eos_ids(args.model))

    # -- rollouts
    t0 = time.perf_counter()
    with Sandbox(workers=args.tool_workers, timeout=args.tool_timeout) as sandbox:
        args.tool_workers = sandbox.workers  # (the default, resolved, goes into eval_config.json)
        rows, samples, trajs = evaluate(llm, tokenizer, sandbox, benchmarks, cfg, n, distributed)
    seconds = time.perf_counter() - t0

    # -- table
    if master:
        print(f"\n{args.model}: temperature {args.temperature}, {n} samples, up to {args.max_response} tokens, "
              f"T = {args.max_turns} ({seconds:.0f} s)")
        print(format_table(rows))
        for r in rows:
            print(f"tool-use rate {r['benchmark']}: {100 * r['tool_use']:.1f}% of samples call the tool")

    # -- files (rank 0 only)
    if master and filtering:
        problems = next(iter(benchmarks.values()))
        hard = select_unsolved(problems, trajs, n, args.min_solved)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in hard)
        band = f"solved {n}/{n}" + (f" or fewer than {args.min_solved}/{n}" if args.min_solved else "")
        print(f"--filter-solved {n}: removed {len(problems) - len(hard)} of {len(problems)} problems "
              f"({band}); kept {len(hard)} -> {args.out}")
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "eval_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(args.out_dir, "table.json"), "w") as f:
            json.dump({"config": config, "seconds": seconds, "table": rows}, f, indent=2)
        with open(os.path.join(args.out_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        print(f"wrote table.json, samples.jsonl ({len(samples)} samples) and eval_config.json "
              f"to {args.out_dir}")
    if distributed:  # vLLM 0.32's engine shutdown destroys the process group: destroying it here breaks that
        dist.barrier(group=cpu_group())
    return rows, samples, trajs


if __name__ == "__main__":
    main()
