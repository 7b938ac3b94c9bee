"""rStar2-Agent RL: GRPO-RoC on multi-turn Python-tool rollouts (paper §2-§4).

    python train.py --preset toy                                       # the toy world, on a CPU
    torchrun --nproc_per_node=8 train.py --stage 1 --model runs/sft --data data/rl.jsonl
    torchrun --nproc_per_node=8 train.py --stage 2 --model runs/sft --init-from runs/stage1/checkpoints
    torchrun --nproc_per_node=8 train.py --stage 3 --model runs/sft --init-from runs/stage2/checkpoints
    python train.py --stage 1 --model Qwen3-14B --plan                  # the memory plan per GPU, then exit

One RL step, in the order the code below runs it:
1. Take the next problems (a seeded shuffle per epoch; the position is saved in checkpoints).
2. Roll out 2G samples per problem with the colocated vLLM engine and the sandbox, through the
   load-balanced scheduler (every rank ends up with the whole batch); reward 1 if correct.
3. GRPO-RoC: drop all-equal groups, down-sample each group to G (grpo_roc.py), advantages.
4. The policy update: the kept trajectories split into --mini-batches optimizer steps (one by
   default, as the paper and the official release do); each dealt across ranks by token count and
   packed into micro-batches; the token-level clipped loss divided by the global token count (so
   any split gives the gradient of one big batch); AdamW, warm-up then constant lr.
5. Sync the new weights into the engine.
Stages hand over through --init-from: the model, the optimizer (not in stage 3) and the position in
the data stream, which goes on where the earlier stage stopped when it reads the same file (stage
2 sees new problems before it sees stage 1's again), and starts afresh on a new file (stage 3).
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
from transformers import AutoConfig, AutoTokenizer

import memory_plan
from engine import kv_capacity_tokens, make_engine, sleep, sync_weights, wake_for_rollout
from grpo_roc import (downsample_uniform, group_advantages, policy_loss, resample_on_correct,
                      tool_error_penalty)
from rollout import RolloutConfig, drop_long_prompts, model_eos_ids, read_problems
from sandbox import Sandbox
from scheduler import ProblemQueue, rollout_lockstep, rollout_scheduled
from training import (DIST_TIMEOUT_MINUTES, check_shared_dir, cpu_group, empty_pass, full_weights,
                      init_distributed, load_sharded_model, plan_micro_batches, right_pad,
                      save_hf_checkpoint, token_logprobs)

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
                    help="an earlier stage's checkpoints folder: its latest model, optimizer, data position")
parser.add_argument("--reset-optimizer", type=int, default=0,
                    help="1: with --init-from, start with a fresh optimizer (stage 3)")
parser.add_argument("--data", default="data/rl.jsonl", help='JSONL of {"question", "answer"} problems')
parser.add_argument("--out-dir", default="runs/rl",
                    help="checkpoints, HF exports, metrics.jsonl, samples.txt (shared by all nodes)")
parser.add_argument("--resume", type=int, default=0,
                    help="1: continue from the latest complete checkpoint in --out-dir")
parser.add_argument("--steps", type=int, default=300, help="RL steps of this run")
parser.add_argument("--problems-per-step", type=int, default=512, help="problems per RL step, over all ranks")
parser.add_argument("--rollouts-per-problem", type=int, default=32, help="2G: rollouts sampled per problem")
parser.add_argument("--group-size", type=int, default=16,
                    help="G: rollouts kept per problem by down-sampling")
parser.add_argument("--no-roc", action="store_true",
                    help="ablation: down-sample uniformly instead of Resample-on-Correct")
parser.add_argument("--max-response", type=int, default=8192,
                    help="token budget of a response: sampled and tool tokens together")
parser.add_argument("--max-turns", type=int, default=10, help="T: assistant turns per trajectory")
parser.add_argument("--max-prompt", type=int, default=2048,
                    help="longest prompt in tokens (sizes the engine's context; longer problems are dropped)")
parser.add_argument("--temperature", type=float, default=1.0,
                    help="rollout sampling temperature (the trainer scores with the same)")
parser.add_argument("--driver", choices=["scheduler", "lockstep"], default="scheduler",
                    help="rollout driver (lockstep: the simple baseline)")
parser.add_argument("--kv-overcommit", type=float, default=1.0,
                    help="the scheduler admits rollouts while what they hold fits this times the KV cache")
parser.add_argument("--memory-fraction", default="auto",
                    help="GPUs: the engine's share of GPU memory (weights + KV); auto: the memory plan's")
parser.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="CPUs: the engine's KV cache in tokens (default: engine.CPU_KV_CACHE_TOKENS)")
parser.add_argument("--plan", action="store_true",
                    help="print the memory plan per GPU (from the model's config alone) and exit")
parser.add_argument("--gpu-memory", type=float, default=None,
                    help="GiB per GPU for the plan (default: this GPU's, else 80)")
parser.add_argument("--plan-gpus", type=int, default=None,
                    help="GPUs for --plan (default: torchrun's world size, else 8)")
parser.add_argument("--tool-timeout", type=float, default=5.0, help="seconds per tool call")
parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant after warm-up)")
parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
parser.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this")
parser.add_argument("--mini-batches", type=int, default=1,
                    help="optimizer steps per RL step (K > 1: the PPO clip acts from the second)")
parser.add_argument("--eps-low", type=float, default=0.2, help="PPO clip below")
parser.add_argument("--eps-high", type=float, default=0.28, help="PPO clip above (Clip-Higher)")
parser.add_argument("--tis-cap", type=float, default=0.0,
                    help=">0: weight tokens by min(p_trainer / p_sampler, cap) (truncated importance "
                         "sampling)")
parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                    help="tokens per forward pass, padding included (the memory plan assumes it)")
parser.add_argument("--save-every", type=int, default=10,
                    help="sharded checkpoint (model, optimizer, data position) every N steps and at the end")
parser.add_argument("--keep-checkpoints", type=int, default=3,
                    help="keep the newest N checkpoints (a 14B one is ~170 GB); 0: keep all")
parser.add_argument("--export-every", type=int, default=50,
                    help="HF-format export every N steps (and at the end)")
parser.add_argument("--sample-every", type=int, default=10,
                    help="write a few full trajectories to samples.txt every N steps")
parser.add_argument("--dist-timeout-minutes", type=float, default=DIST_TIMEOUT_MINUTES,
                    help="how long a rank may wait for the others (their rollouts) before the job fails")
parser.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and down-sampling")
parser.add_argument("--wandb", default="", help="a wandb project name to log to (needs wandb installed)")
pre = parser.parse_known_args()[0]
if pre.stage:
    parser.set_defaults(**STAGES[pre.stage])
if pre.preset:
    parser.set_defaults(**PRESETS[pre.preset])
args = parser.parse_args()
config = vars(args)

# -----------------------------------------------------------------------------
# The memory plan (memory_plan.py): printed with --plan; on GPUs it sets the engine's share.


def gpu_memory_plan(ranks: int) -> memory_plan.Plan:
    if args.model in memory_plan.KNOWN:
        model_config = memory_plan.KNOWN[args.model]
    else:
        model_config = AutoConfig.from_pretrained(args.model)
    if args.gpu_memory is not None:
        gib = args.gpu_memory
    elif torch.cuda.is_available():
        gib = torch.cuda.get_device_properties(0).total_memory / memory_plan.GiB
    else:
        gib = 80
    rollout_tokens = args.max_prompt + args.max_response
    return memory_plan.plan(model_config, ranks, gib, args.micro_batch_tokens, rollout_tokens)


if args.plan:
    ranks = args.plan_gpus or int(os.environ.get("WORLD_SIZE", 8))
    gpu_plan = gpu_memory_plan(ranks)
    print(memory_plan.describe(gpu_plan, ranks))
    raise SystemExit(0 if gpu_plan.fits else 1)
problems = read_problems(args.data)  # (checked before anything slow starts)

# -----------------------------------------------------------------------------
# Compute: torchrun's environment or one process; NCCL on GPUs, gloo on CPUs; a gloo group for waits.

rank, local_rank, world_size, device = init_distributed(args.dist_timeout_minutes)
master = rank == 0
log = print if master else (lambda *a, **k: None)
if args.problems_per_step % world_size:
    raise SystemExit(f"--problems-per-step {args.problems_per_step} does not divide across {world_size} "
                     f"ranks\n---> HINT: use a multiple of {world_size}, "
                     f"e.g. {args.problems_per_step // world_size * world_size or world_size}")
if args.group_size > args.rollouts_per_problem:
    raise SystemExit(f"--group-size {args.group_size} > --rollouts-per-problem {args.rollouts_per_problem}\n"
                     f"---> HINT: RoC keeps G of 2G rollouts; the paper samples 32 and keeps 16")
memory_fraction = args.memory_fraction
if device.type == "cuda" and memory_fraction == "auto":
    gpu_plan = gpu_memory_plan(world_size)
    log(memory_plan.describe(gpu_plan, world_size))
    if not gpu_plan.fits:
        raise SystemExit("the memory plan above does not fit these GPUs\n---> HINT: fewer "
                         "--micro-batch-tokens, more GPUs (the trainer's share shrinks with them), "
                         "or a smaller model")
    memory_fraction = gpu_plan.memory_fraction
log(json.dumps(config, indent=2) + f"\nworld size {world_size}, device {device.type}")
check_shared_dir(args.out_dir)

# -----------------------------------------------------------------------------
# Model and FSDP2: fp32 master weights, rank 0 reads them; bf16 compute and activation
# checkpointing on GPUs. Problems whose prompt is longer than --max-prompt are dropped.

try:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos_ids = model_eos_ids(args.model)  # where vLLM ends a turn besides <|im_end|>
    model = load_sharded_model(args.model, device, activation_checkpointing=device.type == "cuda").train()
except (OSError, ValueError) as e:
    raise SystemExit(f"cannot load the model {args.model!r}: {e}\n---> HINT: pass --model an HF checkpoint "
                     f"folder or hub id (the toy world: run `python sft.py --preset toy` first)")
pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
problems, n_long = drop_long_prompts(problems, tokenizer, args.max_prompt)
log(f"data: {len(problems)} problems from {args.data}; "
    f"dropped {n_long} with a prompt over {args.max_prompt} tokens")

# -----------------------------------------------------------------------------
# Rollout engine and sandbox: one vLLM engine per rank on its own GPU (colocated), asleep while
# the trainer runs; a sandbox pool per rank sized to its share of the node's cores. A rank whose
# pool cannot start raises, and torchrun stops the job.

llm = make_engine(args.model, max_model_len=args.max_prompt + args.max_response, seed=args.seed,
                  memory_fraction=memory_fraction, kv_cache_tokens=args.kv_cache_tokens,
                  external_launcher=world_size > 1)
kv_budget = int(kv_capacity_tokens(llm.llm_engine) * args.kv_overcommit)
sandbox = Sandbox(timeout=args.tool_timeout)
rollout = rollout_scheduled if args.driver == "scheduler" else rollout_lockstep
sync_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32


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
# .tmp folder that resume ignores, never a broken step_N. The oldest complete ones beyond
# --keep-checkpoints are removed, the newest never.

optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
ckpt_root = os.path.join(args.out_dir, "checkpoints")


def complete_checkpoints(root: str) -> list[str]:
    """step_N folders with their meta.json (written last), oldest first."""
    done = [d for d in glob.glob(os.path.join(root, "step_*"))
            if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json"))]
    return sorted(done, key=lambda d: int(d.rsplit("_", 1)[1]))


def save_checkpoint(step: int, meta: dict) -> None:
    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = final + ".tmp"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    if master:
        meta = dict(meta, step=step, config=config, python_rng=random.getstate(),
                    torch_rng=torch.get_rng_state().tolist())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        os.replace(tmp, final)
        if args.keep_checkpoints:
            for old in complete_checkpoints(ckpt_root)[:-args.keep_checkpoints]:
                shutil.rmtree(old)
    dist.barrier(group=cpu_group())


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


# The data stream: `position` counts problems taken; `stream_start` is where this run began in it
# (it enters the sampling seeds, so a continued stream never repeats an earlier stage's seeds).
start_step, position, stream_start = 0, 0, 0
resume_from = (complete_checkpoints(ckpt_root) or [None])[-1] if args.resume else None
if resume_from:
    meta = load_checkpoint(resume_from, with_optimizer=True)
    start_step, position, stream_start = meta["step"], meta["position"], meta.get("stream_start", 0)
    log(f"resumed from {resume_from}: step {start_step}, data position {position}")
elif args.init_from:
    source = (complete_checkpoints(args.init_from) or [args.init_from])[-1]
    meta = load_checkpoint(source, with_optimizer=not args.reset_optimizer)
    if os.path.abspath(meta["config"]["data"]) == os.path.abspath(args.data):
        position = stream_start = meta["position"]  # the same data: go on where the earlier stage stopped
    log(f"initialised from {source}" + (" (fresh optimizer)" if args.reset_optimizer else "")
        + f"; data position {position}")
if resume_from or args.init_from:
    sync_weights(llm, full_weights(model, sync_dtype))

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
    shift = [len(t.prompt_ids) - 1 for t in rows]
    input_ids = right_pad(ids, pad_id).to(device)                                                 # (B, T)
    attention_mask = right_pad([[1] * len(x) for x in ids], 0).to(device)                         # (B, T)
    loss_mask = right_pad([[0] * k + t.loss_mask for k, t in zip(shift, rows)], 0)               # (B, T-1)
    sampler_logp = right_pad([[0.0] * k + t.logprobs for k, t in zip(shift, rows)], 0.0)         # (B, T-1)
    return input_ids, attention_mask, loss_mask.to(device), sampler_logp.to(device)


def micro_batches(kept):
    """This rank's micro-batches of `kept`, as lists of indices (empty ones keep FSDP in step)."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in kept]
    return plan_micro_batches(lengths, args.micro_batch_tokens, world_size)[rank]


@torch.no_grad()
def old_logprobs(kept) -> list[torch.Tensor | None]:
    """The current policy's log-probs of this rank's trajectories of `kept` (the same micro-batches
    optimizer_step will run), per trajectory; None for the other ranks' trajectories."""
    out = [None] * len(kept)
    for micro_batch in micro_batches(kept):
        if not micro_batch:
            empty_pass(model, pad_id, device)  # (a forward only, under no_grad)
            continue
        input_ids, attention_mask, _, _ = micro_batch_tensors([kept[i] for i in micro_batch])
        logp = token_logprobs(model, input_ids, attention_mask, args.temperature)               # (B, T-1)
        for row, i in enumerate(micro_batch):  # each trajectory's own positions, without padding
            out[i] = logp[row, :len(kept[i].prompt_ids) + len(kept[i].response_ids) - 1].cpu()
    return out


def optimizer_step(kept, advantages, old) -> dict:
    """One optimizer step on `kept`; this rank's metric sums (each already / n_loss_tokens)."""
    n_loss_tokens = max(1, sum(sum(t.loss_mask) for t in kept))  # the global denominator of the loss
    sums, mismatch_max = dict.fromkeys(METRICS, 0.0), 0.0
    for micro_batch in micro_batches(kept):
        if not micro_batch:  # FSDP's collectives need every rank in every pass
            empty_pass(model, pad_id, device)
            continue
        rows = [kept[i] for i in micro_batch]
        input_ids, attention_mask, loss_mask, sampler_logp = micro_batch_tensors(rows)
        adv = torch.tensor([advantages[i] for i in micro_batch], device=device)                # (B,)
        logp = token_logprobs(model, input_ids, attention_mask, args.temperature)               # (B, T-1)
        if old is None:  # one step per RL step: the policy before the step is this one (ratio 1)
            old_logp = logp.detach()
        else:
            old_logp = right_pad([old[i].tolist() for i in micro_batch], 0.0).to(device)       # (B, T-1)
        weights = None
        if args.tis_cap > 0:  # truncated importance sampling: the sampler drew these tokens, not us
            weights = torch.exp(old_logp - sampler_logp).clamp(max=args.tis_cap)
        loss, metrics = policy_loss(logp, old_logp, adv, loss_mask, n_loss_tokens, args.eps_low,
                                    args.eps_high, token_weights=weights)
        (loss * world_size).backward()  # FSDP averages gradients over ranks: undo it
        mismatch = (logp.detach() - sampler_logp).abs() * loss_mask                            # (B, T-1)
        metrics.update(loss=loss.item(), logprob_mismatch=mismatch.sum().item() / n_loss_tokens)
        for k in METRICS:
            sums[k] += metrics[k]
        mismatch_max = max(mismatch_max, mismatch.max().item())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    if kept:  # a step where every group was dropped changes nothing
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return dict(sums, logprob_mismatch_max=mismatch_max, grad_norm=grad_norm.item())


def policy_update(kept, advantages) -> dict:
    """(4) --mini-batches optimizer steps on the kept trajectories. Returns the metrics, summed over
    ranks and averaged over the steps (the mismatch's maximum: the largest)."""
    k = min(args.mini_batches, max(len(kept), 1))
    # contiguous parts of the kept batch (whole groups stay together when G divides the part)
    parts = [range(j * len(kept) // k, (j + 1) * len(kept) // k) for j in range(k)]
    old = [old_logprobs([kept[i] for i in part]) if k > 1 else None for part in parts]  # all before the first
    steps = []
    for part, part_old in zip(parts, old):
        steps.append(optimizer_step([kept[i] for i in part], [advantages[i] for i in part], part_old))
    totals = torch.tensor([[s[m] for m in METRICS] for s in steps], device=device)            # (K, metrics)
    worst = torch.tensor(max(s["logprob_mismatch_max"] for s in steps), device=device)
    dist.all_reduce(totals)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row = dict(zip(METRICS, totals.mean(0).tolist()), logprob_mismatch_max=worst.item())
    row.update(grad_norm=sum(s["grad_norm"] for s in steps) / k, optimizer_steps=k)
    return row

# -----------------------------------------------------------------------------
# The step loop.


metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "a", buffering=1) if master else None
samples_file = open(os.path.join(args.out_dir, "samples.txt"), "a", buffering=1) if master else None
for step in range(start_step, args.steps):
    t_step = time.perf_counter()
    row = {"step": step + 1}
    step_seed = args.seed * 1_000_003 + stream_start + step

    # ---- 1-2. rollouts: 2G per problem, every rank gets the whole batch ----
    batch = next_problems(position, args.problems_per_step)
    position += args.problems_per_step
    cfg = RolloutConfig(max_turns=args.max_turns, max_response=args.max_response,
                        temperature=args.temperature, seed=step_seed, kv_budget=kv_budget, eos_ids=eos_ids)
    wake_for_rollout(llm)
    t0 = time.perf_counter()
    problem_queue = ProblemQueue(key=f"{args.out_dir}/{step}", distributed=world_size > 1, group=cpu_group())
    trajs, rstats = rollout(llm.llm_engine, tokenizer, sandbox, batch, args.rollouts_per_problem, cfg,
                            problem_queue)
    row["rollout_seconds"] = time.perf_counter() - t0
    row["tool_wait_seconds"] = rstats.get("idle_seconds", rstats.get("tool_seconds"))
    row["peak_admitted"] = rstats.get("peak_admitted")  # rollouts at once on this rank's engine (scheduler)
    sleep(llm)

    # ---- 3. GRPO-RoC down-sampling and advantages ----
    groups = defaultdict(list)
    for t in trajs:
        groups[t.index].append(t)
    rng = random.Random(step_seed)
    downsample = downsample_uniform if args.no_roc else resample_on_correct
    kept, advantages, n_dropped = [], [], 0
    for index in sorted(groups):
        group, stats = downsample(groups[index], args.group_size, rng)
        n_dropped += stats["dropped_all_equal"]
        kept += group
        advantages += group_advantages([t.reward for t in group]).tolist() if group else []

    # ---- 4. the policy update (its tensors are freed when it returns, before the sync) ----
    t0 = time.perf_counter()
    lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else args.lr
    for g in optimizer.param_groups:
        g["lr"] = lr
    row.update(policy_update(kept, advantages), lr=lr)
    row["train_seconds"] = time.perf_counter() - t0

    # ---- 5. weight sync: the engine samples the next step with the new weights ----
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the allocator's cached training blocks, for the engine's weights
    sync_weights(llm, full_weights(model, sync_dtype))
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
                samples_file.write(f"===== step {step + 1} problem {t.index} sample {t.sample} "
                                   f"reward {t.reward} ({t.finish_reason}) =====\n{t.text}\n")

    # ---- checkpoints: every --save-every steps and always at the last (the next stage starts there) ----
    last = step + 1 == args.steps
    if args.save_every and ((step + 1) % args.save_every == 0 or last):
        save_checkpoint(step + 1, dict(position=position, stream_start=stream_start))
    if (args.export_every and (step + 1) % args.export_every == 0) or last:
        export = os.path.join(args.out_dir, f"hf_step_{step + 1}")
        save_hf_checkpoint(model, tokenizer, export, dtype=sync_dtype)
        if master:  # `final` always points at the newest export
            final = os.path.join(args.out_dir, "final")
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(export, final)

# -----------------------------------------------------------------------------
# Cleanup: the engine goes before the process group, or its finalizer complains.

sandbox.close()
del llm
if dist.is_initialized():  # (vLLM may already have torn it down with the engine)
    dist.destroy_process_group()
