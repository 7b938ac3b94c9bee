"""rStar2-Agent RL: GRPO-RoC on multi-turn Python-tool rollouts (paper §2-§4).

    python train.py --preset toy                                       # the toy world, on a CPU
    torchrun --nproc_per_node=8 train.py --stage 1 --model runs/sft --data data/rl.jsonl
    torchrun --nproc_per_node=8 train.py --stage 2 --init-from runs/stage1/checkpoints
    torchrun --nproc_per_node=8 train.py --stage 3 --init-from runs/stage2/checkpoints --data data/rl_hard.jsonl

One RL step, in the order the code below runs it:
1. Take the next problems (a seeded shuffle per epoch; the position is saved in checkpoints).
2. Roll out 2G samples per problem with the colocated vLLM engine and the sandbox, through the
   load-balanced scheduler (every rank ends up with the whole batch); reward 1 if correct.
3. GRPO-RoC: drop all-equal groups, down-sample each group to G (grpo_roc.py), advantages.
4. The policy update: the kept trajectories dealt across ranks by token count and packed into
   micro-batches; the token-level clipped loss divided by the global token count (so any split
   gives the gradient of one big batch); one optimizer step (AdamW, warm-up then constant lr).
5. Sync the new weights into the engine.
With one optimizer step per RL step the policy ratio is against the trainer's own log-probs
(exactly 1 before the step); the sampler's log-probs are compared with them and logged, and
--tis-cap weights each token by the truncated ratio trainer/sampler for engines that disagree.
"""
import argparse
import glob
import json
import os
import random
import shutil
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_roc import downsample_uniform, group_advantages, policy_loss, resample_on_correct, tool_error_penalty
from rollout import RolloutConfig, kv_capacity_tokens, make_engine, sleep, sync_weights, wake
from sandbox import Sandbox
from scheduler import ProblemQueue, rollout_lockstep, rollout_scheduled
from training import (empty_pass, init_distributed, plan_micro_batches, read_problems, right_pad,
                      save_hf_checkpoint, shard_model, token_logprobs)

# -----------------------------------------------------------------------------
# Arguments. Defaults are the paper's; a stage or preset replaces some; explicit flags win.

STAGES = {  # paper §4.3
    1: dict(max_response=8192, max_turns=10, steps=300),
    2: dict(max_response=12288, max_turns=10, steps=85, warmup_steps=0),   # continues stage 1
    3: dict(max_response=12288, max_turns=15, steps=125, data="data/rl_hard.jsonl", reset_optimizer=1),
}
PRESETS = {  # the toy world on a CPU: the SFT'd toy model, minutes not days
    "toy": dict(model="runs/toy_sft", data="data/toy/train.jsonl", out_dir="runs/toy_rl", steps=20,
                problems_per_step=16, rollouts_per_problem=8, group_size=4, max_response=384,
                max_turns=4, max_prompt=512, lr=2e-4, warmup_steps=2, save_every=10, sample_every=5),
}

parser = argparse.ArgumentParser(description="GRPO-RoC training with multi-turn Python tool use.")
parser.add_argument("--stage", type=int, choices=sorted(STAGES), default=None,
                    help="the paper's RL stage: its length, turns and steps")
parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a named set of defaults (toy: the toy world on a CPU)")
parser.add_argument("--model", default="runs/sft", help="HF checkpoint to start from (the SFT model)")
parser.add_argument("--init-from", default=None,
                    help="a checkpoints folder of an earlier stage: start from its latest model (and optimizer)")
parser.add_argument("--reset-optimizer", type=int, default=0,
                    help="1: with --init-from, start with a fresh optimizer (stage 3)")
parser.add_argument("--data", default="data/rl.jsonl", help='JSONL of {"question", "answer"} problems')
parser.add_argument("--out-dir", default="runs/rl", help="checkpoints, HF exports, metrics.jsonl, samples.txt")
parser.add_argument("--resume", type=int, default=0,
                    help="1: continue from the latest complete checkpoint in --out-dir")
parser.add_argument("--steps", type=int, default=300, help="RL steps of this run")
parser.add_argument("--problems-per-step", type=int, default=512, help="problems per RL step, over all ranks")
parser.add_argument("--rollouts-per-problem", type=int, default=32, help="2G: rollouts sampled per problem")
parser.add_argument("--group-size", type=int, default=16, help="G: rollouts kept per problem by down-sampling")
parser.add_argument("--no-roc", action="store_true",
                    help="ablation: down-sample uniformly instead of Resample-on-Correct")
parser.add_argument("--max-response", type=int, default=8192,
                    help="token budget of a response: sampled and tool tokens together")
parser.add_argument("--max-turns", type=int, default=10, help="T: assistant turns per trajectory")
parser.add_argument("--max-prompt", type=int, default=2048,
                    help="longest prompt in tokens (sizes the engine's context)")
parser.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
parser.add_argument("--driver", choices=["scheduler", "lockstep"], default="scheduler",
                    help="rollout driver (lockstep: the simple baseline)")
parser.add_argument("--kv-overcommit", type=float, default=1.0,
                    help="admit rollouts up to this times the KV-cache capacity")
parser.add_argument("--memory-fraction", type=float, default=0.5,
                    help="GPUs: share of GPU memory for the vLLM engine (weights + KV cache)")
parser.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="CPUs: the engine's KV cache in tokens (default: rollout.CPU_KV_CACHE_TOKENS)")
parser.add_argument("--tool-timeout", type=float, default=5.0, help="seconds per tool call")
parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant after warm-up)")
parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
parser.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this")
parser.add_argument("--eps-low", type=float, default=0.2, help="PPO clip below")
parser.add_argument("--eps-high", type=float, default=0.28, help="PPO clip above (Clip-Higher)")
parser.add_argument("--tis-cap", type=float, default=0.0,
                    help=">0: weight tokens by min(p_trainer / p_sampler, cap) (truncated importance sampling)")
parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                    help="tokens per forward pass, padding included (README: memory per GPU)")
parser.add_argument("--save-every", type=int, default=10,
                    help="sharded checkpoint (model, optimizer, data position) every N steps")
parser.add_argument("--export-every", type=int, default=50, help="HF-format export every N steps (and at the end)")
parser.add_argument("--sample-every", type=int, default=10,
                    help="write a few full trajectories to samples.txt every N steps")
parser.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and down-sampling")
parser.add_argument("--wandb", default="", help="a wandb project name to log to (needs wandb installed)")
pre = parser.parse_known_args()[0]
if pre.stage:
    parser.set_defaults(**STAGES[pre.stage])
if pre.preset:
    parser.set_defaults(**PRESETS[pre.preset])
args = parser.parse_args()
config = vars(args)
problems = read_problems(args.data)  # (checked before anything slow starts)

# -----------------------------------------------------------------------------
# Compute: torchrun's environment or one process; NCCL on GPUs, gloo on CPUs.

rank, local_rank, world_size, device = init_distributed()
master = rank == 0
log = print if master else (lambda *a, **k: None)
if args.problems_per_step % world_size:
    raise SystemExit(f"--problems-per-step {args.problems_per_step} does not divide across {world_size} ranks\n"
                     f"---> HINT: use a multiple of {world_size}, "
                     f"e.g. {args.problems_per_step // world_size * world_size or world_size}")
if args.group_size > args.rollouts_per_problem:
    raise SystemExit(f"--group-size {args.group_size} > --rollouts-per-problem {args.rollouts_per_problem}\n"
                     f"---> HINT: RoC keeps G of 2G rollouts; the paper samples 32 and keeps 16")
log(json.dumps(config, indent=2) + f"\nworld size {world_size}, device {device.type}")
log(f"data: {len(problems)} problems from {args.data}")
os.makedirs(args.out_dir, exist_ok=True)

# -----------------------------------------------------------------------------
# Model and FSDP2: fp32 master weights; bf16 compute and activation checkpointing on GPUs.

try:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
except (OSError, ValueError) as e:
    raise SystemExit(f"cannot load the model {args.model!r}: {e}\n---> HINT: pass --model an HF checkpoint "
                     f"folder or hub id (the toy world: run `python sft.py --preset toy` first)")
if device.type == "cuda":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = shard_model(model, device).train()
pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

# -----------------------------------------------------------------------------
# Rollout engine and sandbox: one vLLM engine per rank on its own GPU (colocated), asleep while
# the trainer runs; a sandbox pool per rank sized to its share of the node's cores.

llm = make_engine(args.model, max_model_len=args.max_prompt + args.max_response, seed=args.seed,
                  memory_fraction=args.memory_fraction, kv_cache_tokens=args.kv_cache_tokens,
                  external_launcher=world_size > 1)
kv_budget = int(kv_capacity_tokens(llm.llm_engine) * args.kv_overcommit)
sandbox = Sandbox(timeout=args.tool_timeout)
sleep(llm)
rollout = rollout_scheduled if args.driver == "scheduler" else rollout_lockstep


def next_problems(position: int, count: int) -> list[dict]:
    """Problems position .. position+count of the endless, epoch-by-epoch shuffled stream."""
    out = []
    for pos in range(position, position + count):
        epoch, i = divmod(pos, len(problems))
        order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(args.seed + epoch))
        out.append(problems[order[i]])
    return out

# -----------------------------------------------------------------------------
# Optimizer and checkpoints. A checkpoint is written to step_N.tmp by all ranks (sharded, with
# torch.distributed.checkpoint), then renamed to step_N by rank 0: a crash mid-write leaves a
# .tmp folder that resume ignores, never a broken step_N.


optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
ckpt_root = os.path.join(args.out_dir, "checkpoints")


def latest_checkpoint(root: str) -> str | None:
    done = [d for d in glob.glob(os.path.join(root, "step_*"))
            if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json"))]
    return max(done, key=lambda d: int(d.rsplit("_", 1)[1]), default=None)


def save_checkpoint(step: int, position: int) -> None:
    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = final + ".tmp"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    if master:
        meta = dict(step=step, position=position, config=config, python_rng=random.getstate(),
                    torch_rng=torch.get_rng_state().tolist())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        os.replace(tmp, final)
    dist.barrier()


def load_checkpoint(path: str, with_optimizer: bool) -> dict:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in meta["python_rng"]))
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta


def full_weights():
    """(name, full tensor) one parameter at a time: each is gathered from its FSDP2 shards only
    when the engine asks for it, so the whole model is never materialised at once."""
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield name, full.to(torch.bfloat16 if device.type == "cuda" else torch.float32)


start_step, position = 0, 0
resume_from = latest_checkpoint(ckpt_root) if args.resume else None
if resume_from:
    meta = load_checkpoint(resume_from, with_optimizer=True)
    start_step, position = meta["step"], meta["position"]
    log(f"resumed from {resume_from}: step {start_step}, data position {position}")
elif args.init_from:
    source = latest_checkpoint(args.init_from) or args.init_from
    load_checkpoint(source, with_optimizer=not args.reset_optimizer)
    log(f"initialised from {source}" + (" (fresh optimizer)" if args.reset_optimizer else ""))
if resume_from or args.init_from:
    wake(llm)
    sync_weights(llm, full_weights())
    sleep(llm)

wandb_run = None
if args.wandb and master:
    import wandb  # optional: only when asked for
    wandb_run = wandb.init(project=args.wandb, config=config)

# -----------------------------------------------------------------------------
# The policy update (4), defined here, used in the step loop below.

METRICS = ["loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "logprob_mismatch"]


def micro_batch_tensors(rows):
    """The trainer's view of kept trajectories. The log-prob at position k scores token k + 1, so a
    response token r sits at position len(prompt) - 1 + r: the loss mask and the sampler's
    log-probs are shifted by one against the ids."""
    ids = [t.prompt_ids + t.response_ids for t in rows]
    input_ids = right_pad(ids, pad_id).to(device)                                                 # (B, T)
    attention_mask = right_pad([[1] * len(x) for x in ids], 0).to(device)                         # (B, T)
    loss_mask = right_pad([[0] * (len(t.prompt_ids) - 1) + t.loss_mask for t in rows], 0)        # (B, T-1)
    sampler_logp = right_pad([[0.0] * (len(t.prompt_ids) - 1) + t.logprobs for t in rows], 0.0)  # (B, T-1)
    return input_ids, attention_mask, loss_mask.to(device), sampler_logp.to(device)


def policy_update(kept, advantages) -> dict:
    """One optimizer step on the kept trajectories. Returns the step's metrics, over all ranks."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in kept]
    plan = plan_micro_batches(lengths, args.micro_batch_tokens, world_size)[rank]
    n_loss_tokens = max(1, sum(sum(t.loss_mask) for t in kept))  # the global denominator of the loss
    sums, mismatch_max = dict.fromkeys(METRICS, 0.0), 0.0         # this rank's sums
    for micro_batch in plan:
        if not micro_batch:  # FSDP's collectives need every rank in every pass
            empty_pass(model, pad_id, device)
            continue
        input_ids, attention_mask, loss_mask, sampler_logp = micro_batch_tensors([kept[i] for i in micro_batch])
        adv = torch.tensor([advantages[i] for i in micro_batch], device=device)  # (B,)
        logp = token_logprobs(model, input_ids, attention_mask)                  # (B, T-1)
        old_logp = logp.detach()  # one optimizer step per RL step: the policy before it is this one
        weights = None
        if args.tis_cap > 0:      # truncated importance sampling: the sampler drew these tokens, not us
            weights = torch.exp(old_logp - sampler_logp).clamp(max=args.tis_cap)
        loss, metrics = policy_loss(logp, old_logp, adv, loss_mask, n_loss_tokens, args.eps_low,
                                    args.eps_high, token_weights=weights)
        (loss * world_size).backward()  # FSDP averages gradients over ranks: undo it
        mismatch = (old_logp - sampler_logp).abs() * loss_mask                # (B, T-1)
        metrics.update(loss=loss.item(), logprob_mismatch=mismatch.sum().item() / n_loss_tokens)
        for k in METRICS:
            sums[k] += metrics[k]
        mismatch_max = max(mismatch_max, mismatch.max().item())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    if kept:  # a step where every group was dropped changes nothing
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals = torch.tensor([sums[k] for k in METRICS], device=device)
    worst = torch.tensor(mismatch_max, device=device)
    dist.all_reduce(totals)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return dict(zip(METRICS, totals.tolist()), logprob_mismatch_max=worst.item(), grad_norm=grad_norm.item())

# -----------------------------------------------------------------------------
# The step loop.


metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "a", buffering=1) if master else None
samples_file = open(os.path.join(args.out_dir, "samples.txt"), "a", buffering=1) if master else None
for step in range(start_step, args.steps):
    t_step = time.perf_counter()
    row = {"step": step + 1}

    # ---- 1-2. rollouts: 2G per problem, every rank gets the whole batch ----
    batch = next_problems(position, args.problems_per_step)
    position += args.problems_per_step
    cfg = RolloutConfig(max_turns=args.max_turns, max_response=args.max_response, temperature=args.temperature,
                        seed=args.seed * 1_000_003 + step, kv_budget=kv_budget)
    wake(llm)
    t0 = time.perf_counter()
    problem_queue = ProblemQueue(key=f"{args.out_dir}/{step}", distributed=world_size > 1)
    trajs, rstats = rollout(llm.llm_engine, tokenizer, sandbox, batch, args.rollouts_per_problem, cfg,
                            problem_queue)
    row["rollout_seconds"] = time.perf_counter() - t0
    row["tool_wait_seconds"] = rstats.get("idle_seconds", rstats.get("tool_seconds"))
    sleep(llm)

    # ---- 3. GRPO-RoC down-sampling and advantages ----
    groups = defaultdict(list)
    for t in trajs:
        groups[t.index].append(t)
    rng = random.Random(args.seed * 1_000_003 + step)
    downsample = downsample_uniform if args.no_roc else resample_on_correct
    kept, advantages, n_dropped = [], [], 0
    for index in sorted(groups):
        group, stats = downsample(groups[index], args.group_size, rng)
        n_dropped += stats["dropped_all_equal"]
        kept += group
        advantages += group_advantages([t.reward for t in group]).tolist() if group else []

    # ---- 4. the policy update ----
    t0 = time.perf_counter()
    lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else args.lr
    for g in optimizer.param_groups:
        g["lr"] = lr
    row.update(policy_update(kept, advantages), lr=lr)
    row["train_seconds"] = time.perf_counter() - t0

    # ---- 5. weight sync: the engine samples the next step with the new weights ----
    t0 = time.perf_counter()
    wake(llm)
    sync_weights(llm, full_weights())
    sleep(llm)
    row["sync_seconds"] = time.perf_counter() - t0

    # ---- logging ----
    positives = [t for t in trajs if t.reward > 0]
    calls = sum(t.tool_calls for t in trajs)
    lengths = [len(t.response_ids) for t in trajs]
    row.update(
        reward=sum(t.reward for t in kept) / max(len(kept), 1),             # what the gradient saw
        accuracy=sum(t.reward for t in trajs) / len(trajs),                 # all 2G rollouts
        dropped_groups=n_dropped / len(groups), kept=len(kept),
        response_length=sum(lengths) / len(lengths), response_length_max=max(lengths),
        truncated=sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        turns=sum(t.num_turns for t in trajs) / len(trajs), tool_calls=calls / len(trajs),
        tool_use=sum(t.tool_calls > 0 for t in trajs) / len(trajs),
        tool_error_ratio=sum(t.num_tool_failures for t in trajs) / max(calls, 1),
        tool_error_ratio_pos=sum(tool_error_penalty(t) for t in positives if t.tool_calls)
        / max(sum(t.tool_calls > 0 for t in positives), 1),
        tokens_per_s=rstats["generated_tokens"] / row["rollout_seconds"],
        step_seconds=time.perf_counter() - t_step)
    if master:
        print(f"step {step + 1:4d}/{args.steps} | acc {row['accuracy']:.3f} | reward {row['reward']:.3f} | "
              f"drop {row['dropped_groups']:.2f} | len {row['response_length']:6.1f} | "
              f"tools {row['tool_calls']:.2f} (err {row['tool_error_ratio']:.3f}, "
              f"pos {row['tool_error_ratio_pos']:.3f}) | loss {row['loss']:+.4f} | "
              f"gnorm {row['grad_norm']:.3f} | mismatch {row['logprob_mismatch']:.1e} | "
              f"rollout {row['rollout_seconds']:.1f}s train {row['train_seconds']:.1f}s "
              f"sync {row['sync_seconds']:.1f}s")
        metrics_file.write(json.dumps(row) + "\n")
        if wandb_run:
            wandb_run.log(row, step=step + 1)
        if args.sample_every and (step + 1) % args.sample_every == 0:
            for t in trajs[:: max(1, len(trajs) // 3)][:3]:
                samples_file.write(f"===== step {step + 1} problem {t.index} sample {t.sample} reward {t.reward} "
                                   f"({t.finish_reason}) =====\n{t.text}\n")

    # ---- checkpoints ----
    if args.save_every and (step + 1) % args.save_every == 0:
        save_checkpoint(step + 1, position)
    if (args.export_every and (step + 1) % args.export_every == 0) or step + 1 == args.steps:
        save_hf_checkpoint(model, tokenizer, os.path.join(args.out_dir, f"hf_step_{step + 1}"),
                           dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        if master:  # `final` always points at the newest export
            final = os.path.join(args.out_dir, "final")
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(os.path.join(args.out_dir, f"hf_step_{step + 1}"), final)

# -----------------------------------------------------------------------------
# Cleanup: the engine goes before the process group, or its finalizer complains.

sandbox.close()
del llm
if dist.is_initialized():  # (vLLM may already have torn it down with the engine)
    dist.destroy_process_group()
