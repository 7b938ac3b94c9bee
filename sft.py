"""Non-reasoning SFT (paper §4.1): teach a base model the chat format, the JSON
tool call and instruction following, with the loss on assistant tokens only.

    python sft.py --preset toy                                   # toy world, CPU
    torchrun --nproc_per_node=8 sft.py --model Qwen/Qwen3-14B-Base --data data/sft.jsonl

- Defaults are the paper's: 3 epochs, lr 5e-6, 4% warm-up, cosine decay, batch 128.
- Conversations are rendered by conversation.render_messages: loss_mask = assistant tokens.
- FSDP2 per decoder layer, rank 0 reading the weights (bf16 compute on GPU); `python sft.py` is a
  group of one (infra/training.py).
- A step's batch is dealt across ranks and packed into micro-batches (batch.plan_micro_batches):
  rows run back to back without padding (logprobs.token_logprobs(packed=True)).
- Loss = mean over the step's assistant tokens (global count): any split, same gradient.
- Without activation checkpointing, the tokens every conversation of a step starts with (the system
  prompt) run once for the step, not once per conversation (logprobs.SharedPrefix).
- --lora-rank r trains LoRA adapters on a frozen base instead (infra/lora.py); the export is the merged model.
"""
import argparse
import ctypes
import json
import math
import os
import time

import psutil
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from conversation import pad_token_id, render_messages
from infra.logprobs import SharedPrefix, empty_pass, right_pad, shared_prefix_length, token_logprobs
from infra.lora import add_lora_flags, describe, lora_settings, param_groups, peak_lr
from infra.batch import plan_micro_batches
from infra.training import init_distributed, load_sharded_model, save_hf_checkpoint

try:
    LIBC = ctypes.CDLL("libc.so.6")  # glibc, whose malloc_trim returns freed pages to the system
except OSError:  # macOS, musl: the allocator is left as it is
    LIBC = None

# -----------------------------------------------------------------------------
# Arguments. Defaults are the paper's recipe; a preset replaces some of them.

PRESETS = {
    "toy": dict(model="data/toy/init_model", data="data/toy/sft.jsonl", out_dir="runs/toy_sft",
                lr=3e-3, batch_size=32, epochs=5, max_len=1024, micro_batch_tokens=1200,
                grad_checkpointing=0, threads=1),
}


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Supervised fine-tuning on chat JSONL, loss on assistant tokens only.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a named set of defaults; explicit flags win")
    parser.add_argument("--model", default="Qwen/Qwen3-14B-Base",
                        help="HF causal LM to start from (path or hub name)")
    parser.add_argument("--data", default="data/sft.jsonl",
                        help='JSONL, one {"messages": [...]} conversation per line')
    parser.add_argument("--out-dir", default="runs/sft",
                        help="where the HF checkpoint, metrics.jsonl and sft_config.json go")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--max-steps", type=int, default=-1,
                        help="optimizer steps to run (-1: all epochs); the schedule follows")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="conversations per optimizer step, over all ranks")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384,
                        help="tokens per forward pass, padding included")
    parser.add_argument("--max-len", type=int, default=4096,
                        help="longest conversation in tokens; longer ones are an error")
    parser.add_argument("--lr", type=float, default=5e-6, help="peak learning rate")
    parser.add_argument("--warmup-ratio", type=float, default=0.04,
                        help="share of steps spent in linear warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad-clip", type=float, default=1.0,
                        help="clip the global gradient norm to this (inf: no clipping)")
    parser.add_argument("--grad-checkpointing", type=int, default=1,
                        help="1: recompute activations in backward to save memory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data order and anything random")
    add_lora_flags(parser)  # --lora-rank and its settings: train adapters on a frozen base (infra/lora.py)
    parser.add_argument("--trim-memory", type=int, default=1,
                        help="1: on a CPU, hand the pages freed in a step back to the system after it")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default; a tiny model on a shared CPU wants 1)")
    if preset := parser.parse_known_args(argv)[0].preset:  # a preset replaces defaults; explicit flags win
        parser.set_defaults(**PRESETS[preset])
    return parser.parse_args(argv)


# -----------------------------------------------------------------------------
# Data: JSONL -> conversations -> (ids, loss_mask) -> length-sorted micro-batches.

def load_conversations(path):
    """Read {"messages": [...]} lines. Returns [(line_number, messages)]."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such data file\n"
                                f"---> HINT: for the toy world run `python data/prepare_toy.py`; "
                                f"otherwise pass --data")
    conversations = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                if not isinstance(messages, list) or not messages:
                    raise TypeError("messages must be a non-empty list")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f'{path}:{line_number}: not a JSON object {{"messages": [...]}} '
                                 f'({type(e).__name__}: {e})\n---> HINT: each line is {{"messages": '
                                 f'[{{"role": "system"|"user"|"assistant"|"tool", "content": ...}}, ...]}}'
                                 ) from None
            conversations.append((line_number, messages))
    if not conversations:
        raise ValueError(f"{path}: no conversations in the file\n"
                         f"---> HINT: check that it was written completely "
                         f"(toy world: rerun `python data/prepare_toy.py`)")
    return conversations


def tokenize_conversations(tokenizer, conversations, path, max_len):
    """Render each conversation; one longer than max_len is an error. Returns [(ids, loss_mask)]."""
    samples, too_long = [], []
    for line_number, messages in conversations:
        try:
            ids, loss_mask = render_messages(tokenizer, messages)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line_number}: cannot render this conversation: {e!r}\n"
                             f"---> HINT: roles are system/user/assistant/tool; assistant messages may carry "
                             f'"tool_call": {{"tool": NAME IN conversation.TOOLS, ARGUMENT: VALUE, ...}} '
                             f'(conversation.tool_call), or the Python tool\'s {{"code": ..., "input": ...}}'
                             ) from None
        if len(ids) > max_len:
            too_long.append((line_number, len(ids)))
        samples.append((ids, loss_mask))
    if too_long:
        (first, first_len), longest = too_long[0], max(n for _, n in too_long)
        raise ValueError(f"{path}: {len(too_long)} conversations are longer than --max-len {max_len} tokens "
                         f"(first at line {first}: {first_len} tokens; longest: {longest})\n"
                         f"---> HINT: pass --max-len {longest} if memory allows, "
                         f"or drop or shorten these conversations")
    return samples


# -----------------------------------------------------------------------------
# Loss and schedule.

def assistant_nll_sum(model, samples, pad_id, device, prefix=None):
    """Sum of -log p(token) over the assistant tokens (loss mask 1) of (ids, loss_mask) samples, the
    rows packed: no padding runs. Position t predicts token t+1, so the mask is read one to the
    right. `prefix`: a SharedPrefix every sample starts with (run once per step; then each chunk's
    logits are kept)."""
    input_ids = right_pad([ids for ids, _ in samples], pad_id).to(device)                 # (B, T)
    attention_mask = right_pad([[1] * len(ids) for ids, _ in samples], 0).to(device)     # (B, T)
    loss_mask = right_pad([mask[1:] for _, mask in samples], 0).to(device)               # (B, T-1)
    logp = token_logprobs(model, input_ids, attention_mask, prefix=prefix,             # (B, T-1)
                          recompute=prefix is None, packed=True)
    return -(logp * loss_mask).sum()


def return_freed_pages():
    """glibc keeps the pages of freed tensors for reuse, so on a CPU the resident memory after a step
    climbs with every longer batch (docs/words.md, bench/sft_memory.py). Trimming after each step hands
    them back: a step still reuses its own pages, and the next maps again only what it needs."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def lr_at(step, total_steps, warmup_steps, lr):
    """Linear warm-up to lr, then cosine decay to 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------

def main(argv=None):
    args = get_args(argv)
    config = vars(args)

    # ---- compute init ----
    rank, local_rank, world_size, device = init_distributed()
    master = rank == 0
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if master:
        print(json.dumps(config, indent=2) + f"\nworld size {world_size}, device {device.type}")
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "sft_config.json"), "w") as f:
            json.dump(config, f, indent=2)

    # ---- data ----
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = pad_token_id(tokenizer)
    samples = tokenize_conversations(tokenizer, load_conversations(args.data), args.data, args.max_len)
    lengths = [len(ids) for ids, _ in samples]
    n_assistant = [sum(mask) for _, mask in samples]
    steps_per_epoch = math.ceil(len(samples) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch if args.max_steps < 0 else args.max_steps
    warmup_steps = round(args.warmup_ratio * total_steps)
    if master:
        print(f"data: {len(samples)} conversations, {sum(lengths):,} tokens "
              f"({sum(n_assistant):,} assistant), longest {max(lengths)}; {steps_per_epoch} steps per epoch, "
              f"{total_steps} steps, {warmup_steps} warm-up")

    # ---- model + FSDP2 ----
    save_dtype = AutoConfig.from_pretrained(args.model).dtype or torch.float32  # saved as it came in
    checkpointing = bool(args.grad_checkpointing)
    model = load_sharded_model(args.model, device, activation_checkpointing=checkpointing,
                               lora=lora_settings(args)).train()
    if master:
        print(f"model: {describe(model)}; peak learning rate {peak_lr(args):.2e}")

    # ---- optimizer ----
    groups = param_groups(model, args)  # (the adapters, then what trains in full: infra/lora.py)
    peaks = [group["lr"] for group in groups]
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay)

    # ---- training loop ----
    metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "w", buffering=1) if master else None
    for step in tqdm(range(total_steps), desc="sft", disable=not master, dynamic_ncols=True):
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        # a fresh deterministic order each epoch, the same on every rank
        generator = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(len(samples), generator=generator).tolist()
        batch = order[k * args.batch_size:(k + 1) * args.batch_size]
        # conversations start with the same template tokens (the system prompt, when they share one):
        # without activation checkpointing those run once for the step (logprobs.SharedPrefix)
        shared = shared_prefix_length([samples[i][0] for i in batch]) if not checkpointing else 0
        run = [lengths[i] - shared for i in batch]  # the tokens each conversation runs
        plan = plan_micro_batches(run, args.micro_batch_tokens, world_size, packed=True)
        n_loss_tokens = max(1, sum(n_assistant[i] for i in batch))  # the global denominator
        n_tokens = sum(lengths[i] for i in batch)
        n_run = shared + sum(run)  # what the layers run: the prefix once, then each conversation's rest

        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = lr_at(step, total_steps, warmup_steps, peak)
        lr = optimizer.param_groups[0]["lr"]
        nll_sum_local = torch.zeros((), device=device)
        prefix_ids = torch.tensor(samples[batch[0]][0][:shared], device=device)
        prefix = SharedPrefix(model, prefix_ids) if shared else None
        for micro_batch in plan[rank]:
            if not micro_batch:
                empty_pass(model, pad_id, device)
                continue
            rows = [samples[batch[j]] for j in micro_batch]
            nll_sum = assistant_nll_sum(model, rows, pad_id, device, prefix)
            nll_sum_local += nll_sum.detach()
            # FSDP averages gradients over ranks; times world_size undoes that, so the
            # gradient is exactly that of (sum of assistant-token losses) / n_loss_tokens.
            (nll_sum / n_loss_tokens * world_size).backward()
        if prefix is not None:
            prefix.backward()  # (the micro-batches' gradient on the shared prefix, through it once)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        grad_norm = grad_norm.full_tensor()  # (a DTensor under FSDP2)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(nll_sum_local)
        if args.trim_memory and device.type == "cpu":
            return_freed_pages()

        # ---- logging ----
        if master:
            seconds = time.time() - t0
            row = dict(step=step + 1, epoch=round((step + 1) / steps_per_epoch, 4),
                       loss=nll_sum_local.item() / n_loss_tokens, lr=lr, grad_norm=grad_norm.item(),
                       n_loss_tokens=n_loss_tokens, tokens=n_tokens, tokens_run=n_run, shared_prefix=shared,
                       micro_batches=len(plan[0]), tokens_per_s=n_tokens / seconds, seconds=seconds,
                       resident_gib=psutil.Process().memory_info().rss / 2**30)  # (the host's, this rank)
            tqdm.write(f"step {step + 1:5d}/{total_steps} | epoch {row['epoch']:6.3f} "
                       f"| loss {row['loss']:.4f} "
                       f"| lr {lr:.2e} | grad norm {row['grad_norm']:7.3f} | tokens {n_tokens:7d} "
                       f"(run {n_run}, {len(plan[0])} mb) | {row['tokens_per_s']:7.0f} tok/s "
                       f"| {seconds:6.2f} s | RSS {row['resident_gib']:.2f} GiB")
            metrics_file.write(json.dumps(row) + "\n")

    # ---- save ----
    save_hf_checkpoint(model, tokenizer, args.out_dir, dtype=save_dtype)
    if master:
        metrics_file.close()
        print(f"saved the checkpoint to {args.out_dir}")
    dist.barrier()  # the ranks leave together: a rank that tears gloo down while another talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
