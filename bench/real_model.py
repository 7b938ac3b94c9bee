"""Benchmark: can a real pretrained model run the loop on this CPU? Training and generation throughput
of one model (SmolLM2-135M-Instruct is the one the tests build), on the project's own format.

    python bench/real_model.py --model ~/.cache/rstar2-agent/real-artefacts-*/smollm2-135m-instruct
    python bench/real_model.py --model DIR --data toy/test.jsonl --sft-data toy/sft.jsonl

1. Training (first: vLLM's CPU worker takes over torch's thread count once the engine exists):
   the HF model in fp32, AdamW, micro-batches of conversations rendered by
   conversation.render_messages (up to --micro-batch-tokens tokens, padding included), each one
   a forward, a backward through training.token_logprobs (the loss sft.py and train.py use) and an
   optimizer step. One warm-up step, then --train-steps timed steps per thread count. Tokens/s
   counts real tokens, not padding; peak RSS is the process's after training.
2. Generation: one vLLM engine (engine.make_engine) whose KV cache holds the largest batch at its
   longest (prompt + --max-tokens, in whole blocks). Per batch size, prompts of our format
   (conversation.prompt_ids) sampled at --temperature until the end of the turn or --max-tokens;
   batch 1 runs --single-requests prompts one after another. Output tokens/s = sampled tokens / wall.
Every row carries the 1-minute load average (this process's own threads included) and `cores`, the
process's CPU time over its wall time: on a shared machine the figures move with both.
The last line: `real model: generation <x> tokens/s at batch <b> (<y> at batch 1), training <z> tokens/s
(1 thread), <w> (2 threads), peak RSS <r> GB`.
"""
import argparse
import json
import operator
import os
import random
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conversation import prompt_ids, render_messages  # noqa: E402
from engine import CPU_BLOCK, kv_capacity_tokens, make_engine  # noqa: E402
from logprobs import token_logprobs  # noqa: E402
from training import plan_micro_batches, right_pad  # noqa: E402

parser = argparse.ArgumentParser(description="Training and generation throughput of a real model on a CPU.")
parser.add_argument("--model", required=True, help="HF model folder (e.g. the SmolLM2-135M-Instruct one)")
parser.add_argument("--data", default=None,
                    help="problems JSONL for the prompts (default: toy-style arithmetic made here)")
parser.add_argument("--sft-data", default=None,
                    help='{"messages": [...]} JSONL to train on (default: toy-style tool conversations)')
parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="concurrent requests per run")
parser.add_argument("--single-requests", type=int, default=4, help="requests run one by one at batch 1")
parser.add_argument("--max-tokens", type=int, default=256, help="sampled tokens per request at most")
parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
parser.add_argument("--engine-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the in-process vLLM engine")
parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch thread counts to train with")
parser.add_argument("--micro-batch-tokens", type=int, default=2048,
                    help="tokens per training micro-batch, padding included")
parser.add_argument("--train-steps", type=int, default=3, help="timed training steps per thread count")
parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (the value does not matter)")
parser.add_argument("--skip", choices=["train", "generate"], default=None, help="leave one part out")
parser.add_argument("--seed", type=int, default=0, help="data, sampling and initial-state seed")
args = parser.parse_args()

rng = random.Random(args.seed)
tok = AutoTokenizer.from_pretrained(args.model)


OPS = {"*": operator.mul, "+": operator.add, "-": operator.sub}


def toy_problem():
    a, b, op = rng.randint(1000, 9999), rng.randint(1000, 9999), rng.choice("*+-")
    return {"question": f"What is {a} {op} {b}?", "answer": str(OPS[op](a, b))}


def toy_conversation():
    p = toy_problem()
    expr = p["question"].removeprefix("What is ").removesuffix("?")
    return [{"role": "user", "content": p["question"]},
            {"role": "assistant", "content": f"I will compute {expr} with Python.</reason>",
             "tool_call": {"code": f"print({expr})", "input": ""}},
            {"role": "tool", "content": p["answer"]},
            {"role": "assistant",
             "content": f"The code printed {p['answer']}.</reason><answer>\\boxed{{{p['answer']}}}</answer>"}]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load():
    return os.getloadavg()[0]


# -----------------------------------------------------------------------------
# Training (1): fp32 HF model, AdamW, micro-batches of rendered conversations.

train_rows, peak_rss_gb = [], None
if args.skip != "train":
    if args.sft_data:
        conversations = [row["messages"] for row in read_jsonl(args.sft_data)]
    else:
        conversations = [toy_conversation() for _ in range(1000)]
    rng.shuffle(conversations)
    samples = [render_messages(tok, messages) for messages in conversations[:1000]]
    lengths = [len(ids) for ids, _ in samples]
    # each micro-batch: the most conversations of similar length that fit the token budget
    order = sorted(range(len(samples)), key=lambda i: lengths[i])
    micro_batches = [[order[i] for i in mb] for mb in
                     plan_micro_batches([lengths[i] for i in order], args.micro_batch_tokens, 1)[0]]
    micro_batches.sort(key=lambda mb: -sum(lengths[i] for i in mb))  # the fullest ones first
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def train_step(micro_batch):
        rows = [samples[i] for i in micro_batch]
        input_ids = right_pad([ids for ids, _ in rows], pad_id)                   # (B, T)
        attention_mask = right_pad([[1] * len(ids) for ids, _ in rows], 0)       # (B, T)
        loss_mask = right_pad([mask[1:] for _, mask in rows], 0)                 # (B, T-1)
        n_loss_tokens = max(int(loss_mask.sum()), 1)
        logp = token_logprobs(model, input_ids, attention_mask)                 # (B, T-1)
        loss = -(logp * loss_mask).sum() / n_loss_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sum(len(ids) for ids, _ in rows), input_ids.numel()

    print(f"training: {n_params / 1e6:.1f}M parameters in fp32, micro-batches of up to "
          f"{args.micro_batch_tokens} tokens; conversations of {min(lengths)}-{max(lengths)} tokens")
    train_step(micro_batches[0])  # warm-up: AdamW's state, the allocator's pools
    step = 1
    for threads in args.threads:
        torch.set_num_threads(threads)
        tokens = padded = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(args.train_steps):
            real, total = train_step(micro_batches[step % len(micro_batches)])
            tokens, padded, step = tokens + real, padded + total, step + 1
        seconds = time.perf_counter() - t0
        train_rows.append(dict(threads=threads, steps=args.train_steps, tokens=tokens, padded=padded,
                               seconds=seconds, tokens_per_s=tokens / seconds,
                               cores=(time.process_time() - cpu0) / seconds, load=load()))
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (KB on Linux)
    del model, optimizer

    print(f"{'threads':>7}  {'steps':>5}  {'tokens':>7}  {'padding':>7}  {'s/step':>6}  {'tokens/s':>8}  "
          f"{'cores':>5}  {'load':>4}")
    for r in train_rows:
        print(f"{r['threads']:7d}  {r['steps']:5d}  {r['tokens']:7d}  {1 - r['tokens'] / r['padded']:7.1%}  "
              f"{r['seconds'] / r['steps']:6.1f}  {r['tokens_per_s']:8.1f}  {r['cores']:5.2f}  "
              f"{r['load']:4.1f}")
    print(f"peak RSS after training: {peak_rss_gb:.2f} GB")

# -----------------------------------------------------------------------------
# Generation (2): one engine sized for the largest batch; sampled tokens / wall time per batch size.

gen_rows = []
if args.skip != "generate":
    from vllm import SamplingParams
    torch.set_num_threads(args.engine_threads)  # (before the engine: its worker then fixes the count)
    n_prompts = max(max(args.batch_sizes), args.single_requests)
    problems = read_jsonl(args.data)[:n_prompts] if args.data else [toy_problem() for _ in range(n_prompts)]
    prompts = [prompt_ids(tok, p["question"]) for p in problems]
    longest = max(map(len, prompts)) + args.max_tokens
    per_request = -(-longest // CPU_BLOCK) * CPU_BLOCK
    llm = make_engine(args.model, max_model_len=longest, seed=args.seed,
                      kv_cache_tokens=max(args.batch_sizes) * per_request)
    print(f"generation: prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, up to "
          f"{args.max_tokens} sampled at temperature {args.temperature}; KV cache of "
          f"{kv_capacity_tokens(llm.llm_engine)} tokens, {args.engine_threads} engine threads")
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    def run(batch):
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
                  for i in range(len(batch))]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [len(out.outputs[0].token_ids) for out in outs]

    for size in args.batch_sizes:
        llm.reset_prefix_cache()  # each size pays for its first prefill of the shared system prompt
        t0, cpu0 = time.perf_counter(), time.process_time()
        if size == 1:
            out_lengths = [n for ids in prompts[:args.single_requests] for n in run([ids])]
        else:
            out_lengths = run(prompts[:size])
        seconds = time.perf_counter() - t0
        gen_rows.append(dict(batch=size, requests=len(out_lengths), seconds=seconds, tokens=sum(out_lengths),
                             mean_length=sum(out_lengths) / len(out_lengths),
                             at_max=sum(n == args.max_tokens for n in out_lengths) / len(out_lengths),
                             tokens_per_s=sum(out_lengths) / seconds,
                             cores=(time.process_time() - cpu0) / seconds, load=load()))
    print(f"{'batch':>5}  {'requests':>8}  {'wall (s)':>8}  {'tokens':>6}  {'mean len':>8}  {'at max':>6}  "
          f"{'tokens/s':>8}  {'cores':>5}  {'load':>4}")
    for r in gen_rows:
        print(f"{r['batch']:5d}  {r['requests']:8d}  {r['seconds']:8.1f}  {r['tokens']:6d}  "
              f"{r['mean_length']:8.1f}  {r['at_max']:6.0%}  {r['tokens_per_s']:8.1f}  {r['cores']:5.2f}  "
              f"{r['load']:4.1f}")

# -----------------------------------------------------------------------------

summary = []
if gen_rows:
    rates = {r["batch"]: r["tokens_per_s"] for r in gen_rows}
    biggest = max(rates)
    summary.append(f"generation {rates[biggest]:.0f} tokens/s at batch {biggest}"
                   + (f" ({rates[1]:.1f} at batch 1)" if 1 in rates and biggest != 1 else ""))
if train_rows:
    per_thread = ", ".join(f"{r['tokens_per_s']:.0f} ({r['threads']} thread{'s' * (r['threads'] > 1)})"
                           for r in train_rows)
    summary.append(f"training {per_thread} tokens/s, peak RSS {peak_rss_gb:.1f} GB")
print("real model: " + ", ".join(summary))
