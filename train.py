"""rStar2-Agent RL: GRPO-RoC on multi-turn Python-tool rollouts (paper §2-§4).

    python train.py --preset toy                                       # the toy world, on a CPU
    torchrun --nproc_per_node=8 train.py --stage 1 --model runs/sft --data data/rl.jsonl
    torchrun --nproc_per_node=8 train.py --stage 2 --model runs/sft --init-from runs/stage1/checkpoints
    torchrun --nproc_per_node=8 train.py --stage 3 --model runs/sft --init-from runs/stage2/checkpoints
    python train.py --stage 1 --model Qwen3-14B --plan                  # the memory plan per GPU, then exit

One RL step, as the step loop at the bottom of this file runs it (what comes before sets it up):
- The rollouts: the next problems of the stream (a seeded shuffle per epoch; the position is saved in
  checkpoints), 2G samples each with the colocated vLLM engine and the sandbox, through the
  load-balanced scheduler; graded, rewarded. Every rank gets every rollout's numbers.
- GRPO-RoC (grpo_roc.py): leave out what the sandbox failed, drop all-equal groups, down-sample
  each group to G, advantages.
- The policy update, in the loop: --mini-batches optimizer steps (one, as in the paper), each on
  micro-batches (infra/update.py deals them across ranks by token count and packs them): the
  log-probs, GRPO-RoC's token-level clipped loss over the step's loss tokens on every rank, so any
  split gives the gradient of one big batch; backward; the clip and AdamW.
- The weight sync: the new weights into the engine.
A run goes on from its own newest checkpoint in --out-dir if it has one. Stages hand over through
--init-from: the model, the optimizer (not in stage 3) and the data stream's position (the same
file goes on where the earlier stage stopped; a new one starts afresh).
"""
import argparse
import dataclasses
import json
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from grpo_roc import (DOWNSAMPLER_SETTINGS, DOWNSAMPLERS, EPS_HIGH, EPS_LOW, drop_sandbox_failures,
                      filter_void_turns, group_advantages, mismatch_correction, policy_loss)
from infra import memory_plan
from infra.engine import (add_engine_flags, engine_dtype, full_weights, make_engine, model_eos_ids, shutdown,
                          sleep, sync_weights, wake_for_rollout)
from infra.lora import add_lora_flags, describe, lora_settings, param_groups, peak_lr
from infra.offload import trainer_offloaded
from infra.training import (KEEP_CHECKPOINTS, TIMEOUT_MINUTES, check_shared_dir, collapse_alarms, cpu_group,
                            init_distributed, load_reference, load_sharded_model, save_checkpoint,
                            save_hf_checkpoint, start_point)
from infra.update import MICRO_BATCH_TOKENS, Policy, mini_batches, step_metrics
from rollout import (MAX_PROMPT, PROBLEMS_PER_STEP, ROLLOUTS_PER_PROBLEM, STAGE_ROLLOUTS, add_rollout_flags,
                     drop_long_prompts, read_problems, rollout_config)
from sandbox import Sandbox
from scheduler import draw, rollout_lockstep, rollout_scheduled

# -----------------------------------------------------------------------------
# Settings: the flags with the paper's defaults (§4.3), the stages and the presets. They are resolved
# once, in the block after the flags.

STAGES = {  # paper §4.3; each stage's budget and turns: rollout.STAGE_ROLLOUTS
    1: dict(**STAGE_ROLLOUTS[1], steps=300),
    2: dict(**STAGE_ROLLOUTS[2], steps=85, warmup_steps=0),   # continues stage 1
    3: dict(**STAGE_ROLLOUTS[3], steps=125, data="data/rl_hard.jsonl", reset_optimizer=1),
}
PRESETS = {  # the toy world on a CPU: the SFT'd toy model, minutes not days
    "toy": dict(model="runs/toy_sft", data="data/toy/train.jsonl", out_dir="runs/toy_rl", steps=20,
                problems_per_step=16, rollouts_per_problem=8, group_size=4, max_response=384,
                max_turns=4, max_prompt=512, lr=2e-4, warmup_steps=2, save_every=10, sample_every=5,
                deterministic=True,  # seeded turns make a rerun the same run, and cost little on a CPU
                # With --lora-rank the head trains in full too: in a 4-layer model its logits carry the
                # choice to call the tool, and LoRA alone learned it 5 points slower (docs/benchmarks.md)
                lora_setting=["train=lm_head"]),
}

parser = argparse.ArgumentParser(description="GRPO-RoC training with multi-turn Python tool use.")
run = parser.add_argument_group("the run")
run.add_argument("--stage", type=int, choices=sorted(STAGES), help="the paper's RL stage: budget, T, steps")
run.add_argument("--preset", choices=sorted(PRESETS), help="a named set of defaults (toy: the toy world)")
run.add_argument("--model", default="runs/sft", help="HF checkpoint to start from (the SFT model)")
run.add_argument("--data", default="data/rl.jsonl", help='JSONL of {"question", "answer"} problems')
run.add_argument("--out-dir", default="runs/rl",
                 help="checkpoints, HF exports, metrics.jsonl, samples.txt (shared by all nodes); a run "
                      "goes on from the newest complete checkpoint here")
run.add_argument("--steps", type=int, default=300, help="RL steps of this run")
run.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and down-sampling")
run.add_argument("--init-from", default=None,
                 help="an earlier stage's checkpoints folder: its latest model, optimizer, data position")
run.add_argument("--reset-optimizer", type=int, default=0,
                 help="1: with --init-from, a fresh optimizer (stage 3); the old one is not even read")

recipe = parser.add_argument_group("the paper's recipe: GRPO-RoC")
recipe.add_argument("--problems-per-step", type=int, default=PROBLEMS_PER_STEP,
                    help="problems per RL step, over all ranks")
recipe.add_argument("--rollouts-per-problem", type=int, default=ROLLOUTS_PER_PROBLEM,
                    help="2G: rollouts sampled per problem")
recipe.add_argument("--group-size", type=int, default=16, help="G: rollouts kept per problem (down-sampling)")
recipe.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant after warm-up)")
recipe.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
recipe.add_argument("--downsample", choices=sorted(DOWNSAMPLERS), default="roc",
                    help="2G -> G: roc (Resample-on-Correct) or uniform (the plain-GRPO ablation)")
recipe.add_argument("--downsample-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the down-sampler, repeatable (a JSON value, else a string), e.g. "
                         "positive_weight=roc (each one's: grpo_roc.DOWNSAMPLER_SETTINGS)")
recipe.add_argument("--eps-low", type=float, default=EPS_LOW, help="PPO clip below")
recipe.add_argument("--eps-high", type=float, default=EPS_HIGH, help="PPO clip above (Clip-Higher)")
recipe.add_argument("--mini-batches", type=int, default=1,
                    help="optimizer steps per RL step (K > 1: the PPO clip acts from the second)")

rollouts = add_rollout_flags(parser, training=True)  # (stage 1's budget and turns, training's temperature)
rollouts.add_argument("--max-prompt", type=int, default=MAX_PROMPT,
                      help="longest prompt in tokens (sizes the engine's context; longer ones are dropped)")

guards = parser.add_argument_group("guards beyond the paper (off by default; see grpo_roc.py)")
guards.add_argument("--dynamic-sampling", type=int, nargs="?", const=4, default=0, metavar="DRAWS",
                    help="drop groups whose rollouts are all right or all wrong and draw more problems, up "
                         "to DRAWS times --problems-per-step (default 4), until the step holds that many "
                         "mixed groups (DAPO's dynamic sampling)")
guards.add_argument("--mismatch-correction", default="none", metavar="MODE[:K]",
                    help="sampler/trainer mismatch (K: 2 unless given): tis weights tokens by min(ratio, K); "
                         "mask drops tokens whose ratio is outside [1/K, K]; seq-mask drops whole "
                         "trajectories by the geometric mean of their ratios")
guards.add_argument("--kl-coef", type=float, default=0.0,
                    help="beta of GRPO's KL penalty to --model, the initial policy (0: none, as the paper)")
guards.add_argument("--filter-void-turns", action="store_true",
                    help="leave out trajectories with a turn that has neither a tool call nor an answer")

infra = parser.add_argument_group("infrastructure")
infra.add_argument("--micro-batch-tokens", type=int, default=MICRO_BATCH_TOKENS,
                   help="tokens per forward pass, rows packed without padding (the memory plan assumes it)")
add_lora_flags(infra)  # --lora-rank, and --lora-setting NAME=VALUE (infra/lora.py's DEFAULTS)
add_engine_flags(infra, memory_fraction="auto")  # --memory-fraction (auto: the plan's), --kv-cache-tokens
memory_plan.add_plan_flags(infra)  # --offload-trainer, --plan
infra.add_argument("--driver", choices=["scheduler", "lockstep"], default="scheduler",
                   help="rollout driver (lockstep: the simple baseline)")
infra.add_argument("--timeout-minutes", type=float, default=TIMEOUT_MINUTES,
                   help="how long a training collective (NCCL's on GPUs) may wait before the job fails; the "
                        "waits for other ranks' rollouts are on a gloo group that waits for hours")
infra.add_argument("--save-every", type=int, default=10,
                   help=f"sharded checkpoint (model, optimizer, data position) every N steps, the newest "
                        f"{KEEP_CHECKPOINTS} kept; the last step is always saved (0: only the last)")
infra.add_argument("--export-every", type=int, default=50, help="HF-format export every N steps and the last")
infra.add_argument("--wandb", default="", help="a wandb project name to log to (needs wandb installed)")
# Settings without a flag: a preset or a fork changes them (the toy preset: deterministic, sample_every).
parser.set_defaults(weight_decay=0.01, grad_clip=1.0, sample_every=10)

# -----------------------------------------------------------------------------
# The settings, resolved once. Each one is its default above, unless the --stage sets it, unless the
# --preset sets it, unless the command line gives it. `config` is the result: printed when the run
# starts, saved with each checkpoint, logged. The down-sampler's settings (--downsample-setting NAME=VALUE,
# a JSON value or else a string) and the mismatch correction's come from it, checked here, before
# anything slow starts.

given = parser.parse_known_args()[0]  # read only for --stage and --preset
for layer in (STAGES.get(given.stage, {}), PRESETS.get(given.preset, {})):
    parser.set_defaults(**layer)
args = parser.parse_args()
config = vars(args)

downsample = DOWNSAMPLERS[args.downsample]
declared = DOWNSAMPLER_SETTINGS[args.downsample]
downsample_settings = {}
for setting in args.downsample_setting:
    name, _, value = setting.partition("=")
    if name not in declared:
        raise SystemExit(f"--downsample-setting {name}: not a setting of --downsample {args.downsample}\n"
                         f"---> HINT: its settings are {declared or 'none'}")
    try:
        downsample_settings[name] = json.loads(value)
    except json.JSONDecodeError:
        downsample_settings[name] = value  # a plain string
downsample([], args.group_size, random.Random(0), **downsample_settings)  # a bad value fails here
mismatch_mode, _, k = args.mismatch_correction.partition(":")
try:  # a bad mode or K fails here, not after the first step's rollouts
    mismatch_threshold = float(k or 2.0)
    nothing = torch.zeros(1, 0)
    mismatch_correction(nothing, nothing, nothing, 1, mismatch_mode, mismatch_threshold)
except ValueError as e:
    raise SystemExit(f"--mismatch-correction {args.mismatch_correction}: {e}")

# -----------------------------------------------------------------------------
# The memory plan (infra/memory_plan.py): --plan prints it and exits; on GPUs it sets the engine's share.

if args.plan:
    raise SystemExit(memory_plan.report(args, int(os.environ.get("WORLD_SIZE", 0))))
problems = read_problems(args.data)  # a bad file fails here, before anything slow starts

# -----------------------------------------------------------------------------
# Compute: torchrun's environment or one process; NCCL on GPUs, gloo on CPUs; a gloo group for waits.

rank, local_rank, world_size, device = init_distributed(args.timeout_minutes)
master = rank == 0
log = print if master else (lambda *a, **k: None)
if args.problems_per_step % world_size:
    raise SystemExit(f"--problems-per-step {args.problems_per_step} does not divide across {world_size} "
                     f"ranks\n---> HINT: use a multiple of {world_size}")
if args.group_size > args.rollouts_per_problem:
    raise SystemExit(f"--group-size {args.group_size} > --rollouts-per-problem {args.rollouts_per_problem}\n"
                     f"---> HINT: RoC keeps G of 2G rollouts; the paper samples 32 and keeps 16")
# on GPUs the plan, printed, says what is auto: the engine's share and whether the trainer offloads
memory_fraction, offload = memory_plan.gpu_settings(args, device, world_size, log)
log(json.dumps(config, indent=2) + f"\nworld size {world_size}, device {device.type}")
check_shared_dir(args.out_dir)

# -----------------------------------------------------------------------------
# The model: FSDP2, fp32 master weights that rank 0 reads (with --lora-rank, a frozen base and fp32
# adapters: infra/lora.py); bf16 compute and activation checkpointing on GPUs. With --kl-coef, the
# reference policy: --model as loaded here (training.load_reference). Then the checkpoint the run
# continues, if any, while the engine does not hold its memory yet.

model = load_sharded_model(args.model, device, activation_checkpointing=device.type == "cuda",
                           lora=lora_settings(args)).train()
reference = load_reference(model, args.model, device) if args.kl_coef else None
tokenizer = AutoTokenizer.from_pretrained(args.model)
problems, n_long = drop_long_prompts(problems, tokenizer, args.max_prompt, args.tools)
log(f"data: {len(problems)} problems from {args.data}; "
    f"dropped {n_long} with a prompt over {args.max_prompt} tokens")
log(f"model: {describe(model)}; learning rate {peak_lr(args):.2e}")
groups = param_groups(model, args)  # under LoRA two groups: the adapters, then what trains in full
peaks = [group["lr"] for group in groups]  # taken before a loaded optimizer state could change them
optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay,
                              fused=device.type == "cuda")  # one kernel per step on GPUs

# Where the run starts: its own newest checkpoint, an earlier stage's (--init-from), or the beginning.
# The data stream's `position` counts problems taken; `stream_start` is where this run began in it (it
# enters the sampling seeds, so a continued stream never repeats an earlier stage's).
ckpt_root = os.path.join(args.out_dir, "checkpoints")
start = start_point(model, optimizer, ckpt_root, args.init_from, args.reset_optimizer, args.data)
start_step, position, stream_start = start["step"], start["position"], start["stream_start"]
log(start["message"])

# -----------------------------------------------------------------------------
# Rollout engine and sandbox: one vLLM engine per rank on its own GPU (colocated), asleep while the
# trainer runs, its weights the trainer's (it never reads the checkpoint); a sandbox pool per rank
# sized to its share of the node's cores. A rank whose pool cannot start raises: the job stops.

frozen = (reference,) if reference is not None and reference is not model else ()  # offloaded with the model
with trainer_offloaded(model, optimizer, offload, frozen):  # vLLM wants its whole share free at start
    llm = make_engine(args.model, max_model_len=args.max_prompt + args.max_response, seed=args.seed,
                      memory_fraction=memory_fraction, kv_cache_tokens=args.kv_cache_tokens,
                      external_launcher=world_size > 1, weights=False, rank=rank)  # a seed of its own
    sleep(llm)  # the sync below wakes its weights, and the first rollout its KV cache
rollout_settings = rollout_config(args, eos_ids=model_eos_ids(args.model))  # each step: its own seed
sandbox = Sandbox()
roll_out = rollout_scheduled if args.driver == "scheduler" else rollout_lockstep
dtype = engine_dtype(device)  # what the engine runs: the sync and the HF exports cast to it
sync_weights(llm, full_weights(model, dtype))  # the engine started without the checkpoint's weights
# What the update's infrastructure (infra/update.py) needs of the policy: the sampler's temperature,
# the micro-batch budget, the reference; the run's format, whose shared start runs once on CPUs.
policy = Policy.of(model, tokenizer, args.tools, device, args.temperature, args.micro_batch_tokens, reference)
wandb_run = None
if args.wandb and master:
    import wandb  # optional: only when asked for
    wandb_run = wandb.init(project=args.wandb, config=config)

# -----------------------------------------------------------------------------
# The step loop.

metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "a", buffering=1) if master else None
samples_file = open(os.path.join(args.out_dir, "samples.txt"), "a", buffering=1) if master else None
history = []  # this run's earlier rows, for the collapse alarm
for step in range(start_step, args.steps):
    t_step = time.perf_counter()
    step_seed = args.seed * 1_000_003 + stream_start + step

    # ---- the rollouts: 2G per problem, graded and rewarded; every rank gets all their numbers ----
    t0 = time.perf_counter()
    with trainer_offloaded(model, optimizer, offload, frozen):  # when the plan gives the engine room
        wake_for_rollout(llm)
        cfg = dataclasses.replace(rollout_settings, seed=step_seed)
        trajs, stats, position = draw(roll_out, llm.llm_engine, tokenizer, sandbox, problems, args.seed,
                                      position, args.problems_per_step, args.rollouts_per_problem, cfg,
                                      key=f"{args.out_dir}/{step}", dynamic=args.dynamic_sampling,
                                      group=cpu_group())
        sleep(llm)
    row = dict(step=step + 1, rollout_seconds=time.perf_counter() - t0)

    # ---- GRPO-RoC: guards, down-sampling, advantages ----
    groups = defaultdict(list)
    for t in trajs:
        groups[t.index].append(t)
    rng = random.Random(step_seed)
    kept, advantages, counts = [], [], dict(dropped_groups=0, sandbox_dropped=0, void_filtered=0)
    for index in sorted(groups):
        group, n_failed = drop_sandbox_failures(groups[index], args.group_size)  # not the model's doing
        counts["sandbox_dropped"] += n_failed
        if args.filter_void_turns:
            group, n_void = filter_void_turns(group)
            counts["void_filtered"] += n_void
        group, group_stats = downsample(group, args.group_size, rng, **downsample_settings)
        counts["dropped_groups"] += group_stats["dropped_all_equal"]
        kept += group
        advantages += group_advantages([t.reward for t in group]).tolist() if group else []

    # ---- the policy update: --mini-batches optimizer steps, each on this rank's micro-batches ----
    t0 = time.perf_counter()
    warm = min(1.0, (step + 1) / max(args.warmup_steps, 1))
    for g, peak in zip(optimizer.param_groups, peaks):
        g["lr"] = peak * warm
    parts = mini_batches(policy, kept, advantages, args.mini_batches)  # each rank receives what it trains
    for part in parts:
        for micro in part:  # as many on every rank: a rank short of them runs a row of padding
            logp, entropy = micro.logprobs()                                               # (B, T-1) each
            old_logp = logp.detach() if micro.old_logp is None else micro.old_logp  # the first: ratio 1
            # The sampler drew these tokens, not the trainer: an optional correction (grpo_roc.py (11)).
            weights, loss_mask, mismatch = mismatch_correction(old_logp, micro.sampler_logp, micro.loss_mask,
                                                            part.n_loss_tokens, mismatch_mode,
                                                            mismatch_threshold)
            loss, metrics = policy_loss(logp, old_logp, micro.advantages, loss_mask, part.n_loss_tokens,
                                        args.eps_low, args.eps_high, token_weights=weights,
                                        ref_logp=micro.reference_logprobs(), kl_coef=args.kl_coef,
                                        entropy=entropy)
            # FSDP averages the gradients over ranks, while n_loss_tokens already counts every rank's
            # tokens: scaled back by the world size, the sum is the gradient of one big batch.
            (loss * world_size).backward()
            part.record(logp, micro, dict(metrics, **mismatch, loss=loss.item()))
        part.finish()  # the shared prompt prefix's gradient through it; the reference lets go of its root
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if kept:  # a step where every group was dropped changes nothing
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        part.record_grad_norm(grad_norm)
    row.update(step_metrics(parts, device), lr=peaks[0] * warm)  # lr: --lr, or under LoRA the adapters'
    row["train_seconds"] = time.perf_counter() - t0

    # ---- the weight sync: the engine samples the next step with the new weights ----
    t0 = time.perf_counter()
    sync_weights(llm, full_weights(model, dtype))
    row["sync_seconds"] = time.perf_counter() - t0

    # ---- logging ----
    row.update(stats, tokens_per_s=stats["generated_tokens"] / row["rollout_seconds"])  # all 2G rollouts
    # The kept rollouts' reward is what the gradient saw, where the accuracy counts every rollout.
    row.update(kept=len(kept), kept_reward=sum(t.reward for t in kept) / max(len(kept), 1),
               **counts, dropped_group_share=counts["dropped_groups"] / max(len(groups), 1),
               step_seconds=time.perf_counter() - t_step)
    alarms = collapse_alarms(history, row)
    history.append(row)
    last = step + 1 == args.steps
    if master:
        idle = "" if kept else (f"\n  nothing to train: every group of the {row['drawn_problems']} problems "
                                f"drawn was all right, all wrong or failed by the sandbox")
        print(f"step {step + 1:4d}/{args.steps} | acc {row['accuracy']:.3f} | rew {row['kept_reward']:.3f} | "
              f"drop {row['dropped_group_share']:.2f} | mixed {row['mixed_groups']}/{row['drawn_problems']} "
              f"drawn | len {row['response_length']:6.1f} | "
              f"tools {row['tool_calls']:.2f} (err {row['tool_error_ratio']:.3f}, "
              f"pos {row['tool_error_ratio_pos']:.3f}) | loss {row['loss']:+.4f} | "
              f"entropy {row['entropy']:.3f} | "
              + (f"kl_ref {row['kl_ref']:.2e} | " if args.kl_coef else "") +
              f"gnorm {row['grad_norm']:.3f} | mismatch {row['logprob_mismatch']:.1e} | "
              f"rollout {row['rollout_seconds']:.1f}s train {row['train_seconds']:.1f}s "
              f"sync {row['sync_seconds']:.1f}s" + idle
              + "".join(f"\n  ALARM (collapse?): {a}" for a in alarms))
        metrics_file.write(json.dumps(dict(row, collapse_alarms=alarms)) + "\n")
        if wandb_run:
            wandb_run.log(dict(row, collapse_alarm=len(alarms)), step=step + 1)
        if last or (args.sample_every and (step + 1) % args.sample_every == 0):
            own = [t for t in trajs if t.rank == rank]  # only this rank holds its own rollouts' text
            for t in own[:: max(1, len(own) // 3)][:3]:
                samples_file.write(f"===== step {step + 1} problem {t.index} sample {t.sample} "
                                   f"reward {t.reward} ({t.finish_reason}) =====\n{t.text}\n")

    # ---- checkpoints: every --save-every steps and always at the last (the next stage starts there) ----
    if last or (args.save_every and (step + 1) % args.save_every == 0):
        meta = dict(position=position, stream_start=stream_start, config=config)
        save_checkpoint(model, optimizer, ckpt_root, step + 1, meta)
    if last or (args.export_every and (step + 1) % args.export_every == 0):  # final/: the newest export
        export, final = os.path.join(args.out_dir, f"hf_step_{step + 1}"), os.path.join(args.out_dir, "final")
        save_hf_checkpoint(model, tokenizer, export, dtype=dtype, latest=final)

# -----------------------------------------------------------------------------
# Cleanup: the engine stops first (infra/engine.py's shutdown leaves the process group alone), then
# every rank waits for the others (a rank that tears gloo down while another talks to it can abort),
# then the process group goes, once.

sandbox.close()
shutdown(llm)
dist.barrier(group=cpu_group())
dist.destroy_process_group()
