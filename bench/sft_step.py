"""Where an SFT step's tokens go, and what a step costs with its rows padded or packed.

    python bench/sft_step.py --model runs/real/artefacts/smollm2-135m-instruct --data data/mawps/sft.jsonl

Takes the first --batch conversations of the file as one step's batch, as sft.py renders them, and
prints what their tokens are: the prefix every conversation starts with (the system prompt and the
user turn's preamble), the questions, the assistant tokens the loss counts, and the tool turns and
template between them. Then it times sft.py's step on them (the shared prefix run once, the loss
on the assistant tokens, its backward, the prefix's backward, the optimizer step), its micro-batches'
rows padded to their longest (as sft.py ran them before packing) and packed back to back (as it runs
them now), each --repeats times after one warm-up step, in one process. The last line is the ratio.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conversation import pad_token_id, prompt_ids, render_messages  # noqa: E402
from infra.logprobs import SharedPrefix, right_pad, shared_prefix_length, token_logprobs  # noqa: E402
from infra.batch import plan_micro_batches  # noqa: E402

parser = argparse.ArgumentParser(description="An SFT step's tokens, and its time padded against packed.")
parser.add_argument("--model", required=True, help="the model sft.py trains")
parser.add_argument("--data", required=True, help="its SFT conversations (JSONL)")
parser.add_argument("--batch", type=int, default=16, help="conversations in the step (the words recipe)")
parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="sft.py's (the words recipe's)")
parser.add_argument("--repeats", type=int, default=2, help="timed steps of each way, after a warm-up")
args = parser.parse_args()

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402  (after --help)
tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # (small: the weights barely move)
with open(args.data) as f:
    conversations = [json.loads(line)["messages"] for _, line in zip(range(args.batch), f)]
samples = [render_messages(tokenizer, messages) for messages in conversations]
pad = pad_token_id(tokenizer)

# ---- where the tokens go ----
shared = shared_prefix_length([ids for ids, _ in samples])
counted = sum(len(ids) for ids, _ in samples)
questions = sum(len(prompt_ids(tokenizer, m[0]["content"])) - shared for m in conversations)
assistant = sum(sum(mask) for _, mask in samples)
between = counted - len(samples) * shared - questions - assistant
longest = max(len(ids) for ids, _ in samples) - shared
print(f"{len(samples)} conversations, {counted} tokens counted: the shared prefix {shared} x {len(samples)} "
      f"= {shared * len(samples)} ({shared * len(samples) / counted:.0%}), run once; the questions "
      f"{questions}, the assistant tokens (the loss) {assistant}, the tool turns and template {between}")
run = shared + counted - len(samples) * shared
lengths = [len(ids) - shared for ids, _ in samples]
(padded_plan,) = plan_micro_batches(lengths, args.micro_batch_tokens, 1)
padded_run = shared + sum(len(mb) * lengths[mb[0]] for mb in padded_plan)  # (a first row is the longest)
print(f"tokens the layers run: packed {run}; padded, {len(padded_plan)} micro-batches of rows as long as "
      f"their longest, {padded_run} ({padded_run / run - 1:.0%} more)")


def step(packed: bool) -> float:
    """One optimizer step on the batch, as sft.py takes it (micro-batches of --micro-batch-tokens
    planned by batch.plan_micro_batches); its seconds."""
    start = time.perf_counter()
    prefix = SharedPrefix(model, torch.tensor(samples[0][0][:shared]))
    (plan,) = plan_micro_batches(lengths, args.micro_batch_tokens, 1, packed)
    for micro_batch in plan:
        rows = [samples[i] for i in micro_batch]
        input_ids = right_pad([ids for ids, _ in rows], pad)                       # (B, T)
        attention_mask = right_pad([[1] * len(ids) for ids, _ in rows], 0)         # (B, T)
        loss_mask = right_pad([mask[1:] for _, mask in rows], 0)                   # (B, T-1)
        logp = token_logprobs(model, input_ids, attention_mask, prefix=prefix, recompute=False,
                              packed=packed)                                       # (B, T-1)
        (-(logp * loss_mask).sum() / assistant).backward()
    prefix.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


seconds = {}
for name, packed in (("padded", False), ("packed", True)):
    step(packed)  # (warm-up)
    seconds[name] = [step(packed) for _ in range(args.repeats)]
    each = ", ".join(f"{s:.1f}" for s in seconds[name])
    print(f"{name}: {statistics.mean(seconds[name]):.1f} s a step ({each})")
padded, packed = statistics.mean(seconds["padded"]), statistics.mean(seconds["packed"])
print(f"packed: a step {padded / packed:.2f}x faster than padded ({packed:.1f} s / {padded:.1f} s)")
