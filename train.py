"""rStar2-Agent RL: GRPO-RoC on multi-turn Python-tool rollouts (paper §2-§4).

    python train.py --preset toy                                       # the toy world, on a CPU
    torchrun --nproc_per_node=8 train.py --stage 1 --model runs/sft --data data/rl.jsonl
    torchrun --nproc_per_node=8 train.py --stage 2 --model runs/sft --init-from runs/stage1/checkpoints
    torchrun --nproc_per_node=8 train.py --stage 3 --model runs/sft --init-from runs/stage2/checkpoints
    python train.py --stage 1 --model Qwen3-14B --plan                  # the memory plan per GPU, then exit

One RL step, as the step loop at the bottom of this file runs it (what comes before sets it up):
- The problems: the next ones (a seeded shuffle per epoch; the position is saved in checkpoints).
- The rollouts: 2G samples per problem with the colocated vLLM engine and the sandbox, through the
  load-balanced scheduler; graded, rewarded. Every rank gets every rollout's numbers.
- GRPO-RoC (grpo_roc.py): leave out what the sandbox failed, drop all-equal groups, down-sample
  each group to G, advantages.
- The policy update, in the loop: --mini-batches optimizer steps (one, as in the paper), each on
  micro-batches (infra/update.py deals them across ranks by token count and packs them): the log-probs,
  GRPO-RoC's token-level clipped loss over the step's loss tokens on every rank, so any split gives
  the gradient of one big batch; backward; the clip and AdamW.
- The weight sync: the new weights into the engine.
Stages hand over through --init-from: the model, the optimizer (not in stage 3) and the data
stream's position (the same file goes on where the earlier stage stopped; a new one starts afresh).
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

from infra import memory_plan
from infra.batch import ProblemQueue, ProblemStream, mixed_groups
from conversation import pad_token_id, prompt_ids
from infra.engine import (add_engine_flags, full_weights, kv_capacity_tokens, make_engine, model_eos_ids, sleep,
                    sync_weights, wake_for_rollout)
from grpo_roc import (DOWNSAMPLER_SETTINGS, DOWNSAMPLERS, EPS_HIGH, EPS_LOW, MISMATCH_MODES,
                      drop_sandbox_failures, filter_void_turns, group_advantages, mismatch_correction,
                      policy_loss)
from infra.logprobs import token_logprobs
from infra.lora import add_lora_flags, describe, lora_settings, param_groups, peak_lr, trains_adapters_only
from infra.offload import trainer_offloaded
from report import collapse_alarms
from rollout import (STAGE_ROLLOUTS, add_rollout_flags, drop_long_prompts, read_problems, rollout_config,
                     trajectory_metrics)
from sandbox import Sandbox
from scheduler import rollout_lockstep, rollout_scheduled
from infra.training import (DIST_TIMEOUT_MINUTES, check_shared_dir, cpu_group, init_distributed, load_sharded_model,
                      save_checkpoint, save_hf_checkpoint, start_point)
from infra.update import Policy, mini_batches, step_metrics

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
                lora_train="lm_head"),
}

parser = argparse.ArgumentParser(description="GRPO-RoC training with multi-turn Python tool use.")
run = parser.add_argument_group("the run")
run.add_argument("--stage", type=int, choices=sorted(STAGES), help="the paper's RL stage: budget, T, steps")
run.add_argument("--preset", choices=sorted(PRESETS), help="a named set of defaults (toy: the toy world)")
run.add_argument("--model", default="runs/sft", help="HF checkpoint to start from (the SFT model)")
run.add_argument("--data", default="data/rl.jsonl", help='JSONL of {"question", "answer"} problems')
run.add_argument("--out-dir", default="runs/rl",
                 help="checkpoints, HF exports, metrics.jsonl, samples.txt (shared by all nodes)")
run.add_argument("--steps", type=int, default=300, help="RL steps of this run")
run.add_argument("--init-from", default=None,
                 help="an earlier stage's checkpoints folder: its latest model, optimizer, data position")
run.add_argument("--reset-optimizer", type=int, default=0,
                 help="1: with --init-from, a fresh optimizer (stage 3); the old one is not even read")
run.add_argument("--resume", type=int, default=0,
                 help="1: continue from the latest complete checkpoint in --out-dir")
run.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and down-sampling")

recipe = parser.add_argument_group("the paper's recipe: GRPO-RoC")
recipe.add_argument("--problems-per-step", type=int, default=512, help="problems per RL step, over all ranks")
recipe.add_argument("--rollouts-per-problem", type=int, default=32, help="2G: rollouts sampled per problem")
recipe.add_argument("--group-size", type=int, default=16, help="G: rollouts kept per problem (down-sampling)")
recipe.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant after warm-up)")
recipe.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
recipe.add_argument("--downsample", choices=sorted(DOWNSAMPLERS), default="roc",
                    help="2G -> G: roc (Resample-on-Correct) or uniform (the plain-GRPO ablation)")
recipe.add_argument("--downsample-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the down-sampler, repeatable (a JSON value, else a string), e.g. "
                         "positive_weight=roc (each one's: grpo_roc.DOWNSAMPLER_SETTINGS)")
recipe.add_argument("--dynamic-sampling", action="store_true",
                    help="drop groups whose rollouts are all right or all wrong and draw more problems until "
                         "the step holds --problems-per-step mixed groups (DAPO's dynamic sampling)")
recipe.add_argument("--max-draws", type=int, default=4,
                    help="with --dynamic-sampling: a step draws at most this many times --problems-per-step")
recipe.add_argument("--eps-low", type=float, default=EPS_LOW, help="PPO clip below")
recipe.add_argument("--eps-high", type=float, default=EPS_HIGH, help="PPO clip above (Clip-Higher)")

rollouts = add_rollout_flags(parser, top_p=False)  # (stage 1's budget and turns, training's temperature)
rollouts.add_argument("--max-prompt", type=int, default=2048,
                      help="longest prompt in tokens (sizes the engine's context; longer ones are dropped)")
rollouts.add_argument("--tool-timeout", type=float, default=5.0, help="seconds per tool call")

optimization = parser.add_argument_group("optimization")
optimization.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
optimization.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm")
optimization.add_argument("--mini-batches", type=int, default=1,
                          help="optimizer steps per RL step (K > 1: the PPO clip acts from the second)")
optimization.add_argument("--micro-batch-tokens", type=int, default=8192,
                          help="tokens per forward pass, rows packed without padding (the memory plan "
                               "assumes it)")
add_lora_flags(optimization)  # --lora-rank and its alpha, dropout, targets and learning-rate scale (infra/lora.py)

guards = parser.add_argument_group("guards beyond the paper (off by default; see grpo_roc.py)")
guards.add_argument("--mismatch-correction", choices=MISMATCH_MODES, default="none",
                    help="sampler/trainer mismatch: tis weights tokens by min(ratio, k); mask drops tokens "
                         "whose ratio is outside [1/k, k]; seq-mask drops whole trajectories by the "
                         "geometric mean of their ratios")
guards.add_argument("--mismatch-threshold", type=float, default=2.0,
                    help="k of --mismatch-correction")
guards.add_argument("--kl-coef", type=float, default=0.0,
                    help="beta of GRPO's KL penalty to --model, the initial policy (0: none, as the paper)")
guards.add_argument("--filter-void-turns", action="store_true",
                    help="leave out trajectories with a turn that has neither a tool call nor an answer")

infra = parser.add_argument_group("infrastructure")
add_engine_flags(infra, memory_fraction="auto")  # --memory-fraction (auto: the plan's), --kv-cache-tokens
memory_plan.add_plan_flags(infra)  # --offload-trainer, --plan, --gpu-memory, --plan-gpus
infra.add_argument("--driver", choices=["scheduler", "lockstep"], default="scheduler",
                   help="rollout driver (lockstep: the simple baseline)")
infra.add_argument("--kv-overcommit", type=float, default=1.0,
                   help="the scheduler admits rollouts while what they hold fits this times the KV cache")
infra.add_argument("--dist-timeout-minutes", type=float, default=DIST_TIMEOUT_MINUTES,
                   help="how long a rank may wait for the others (their rollouts) before the job fails")
infra.add_argument("--save-every", type=int, default=10,
                   help="sharded checkpoint (model, optimizer, data position) every N steps; the last "
                        "step is always saved (0: only the last)")
infra.add_argument("--keep-checkpoints", type=int, default=3,
                   help="keep the newest N checkpoints (a 14B one is ~170 GB); 0: keep all")
infra.add_argument("--export-every", type=int, default=50, help="HF-format export every N steps and the last")
infra.add_argument("--sample-every", type=int, default=10, help="write trajectories to samples.txt every N")
infra.add_argument("--wandb", default="", help="a wandb project name to log to (needs wandb installed)")

# -----------------------------------------------------------------------------
# The settings, resolved once. Each one is its default above, unless the --stage sets it, unless the
# --preset sets it, unless the command line gives it. `config` is the result: printed when the run
# starts, saved with each checkpoint, logged. The down-sampler's settings (--downsample-setting NAME=VALUE,
# a JSON value or else a string) come from it, checked here, before anything slow starts.

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

# -----------------------------------------------------------------------------
# The memory plan (infra/memory_plan.py): --plan prints it and exits; on GPUs it sets the engine's share.

plan_settings = dict(gpu_gib=args.gpu_memory, micro_batch_tokens=args.micro_batch_tokens,
                     rollout_tokens=args.max_prompt + args.max_response,
                     rollouts_per_step=args.problems_per_step * args.rollouts_per_problem,
                     lora_rank=args.lora_rank, lora_head="lm_head" in args.lora_train.split(","),
                     reference=args.kl_coef > 0)
if args.plan:
    uncounted = [m for m in args.lora_train.split(",") if m and m != "lm_head"] if args.lora_rank else []
    if uncounted:
        print(f"(the plan counts a trained lm_head, not {','.join(uncounted)}: 14 bytes a parameter more)")
    raise SystemExit(memory_plan.report(args.model, args.plan_gpus or int(os.environ.get("WORLD_SIZE", 8)),
                                        offload=args.offload_trainer, **plan_settings))
problems = read_problems(args.data)  # a bad file fails here, before anything slow starts

# -----------------------------------------------------------------------------
# Compute: torchrun's environment or one process; NCCL on GPUs, gloo on CPUs; a gloo group for waits.

rank, local_rank, world_size, device = init_distributed(args.dist_timeout_minutes)
master = rank == 0
log = print if master else (lambda *a, **k: None)
if args.problems_per_step % world_size:
    raise SystemExit(f"--problems-per-step {args.problems_per_step} does not divide across {world_size} "
                     f"ranks\n---> HINT: use a multiple of {world_size}")
if args.group_size > args.rollouts_per_problem:
    raise SystemExit(f"--group-size {args.group_size} > --rollouts-per-problem {args.rollouts_per_problem}\n"
                     f"---> HINT: RoC keeps G of 2G rollouts; the paper samples 32 and keeps 16")
# on GPUs the plan, printed, says what is auto: the engine's share and whether the trainer offloads
memory_fraction, offload = memory_plan.gpu_settings(args.memory_fraction, args.offload_trainer, device,
                                                    args.model, world_size, log, **plan_settings)
log(json.dumps(config, indent=2) + f"\nworld size {world_size}, device {device.type}")
check_shared_dir(args.out_dir)

# -----------------------------------------------------------------------------
# The model: FSDP2, fp32 master weights that rank 0 reads (with --lora-rank, a frozen base and fp32
# adapters: infra/lora.py); bf16 compute and activation checkpointing on GPUs. Then the checkpoint it
# continues, if any, while the engine does not hold its memory yet.

model = load_sharded_model(args.model, device, activation_checkpointing=device.type == "cuda",
                           lora=lora_settings(args)).train()
log(f"model: {describe(model)}; learning rate {peak_lr(args):.2e}")
# With --kl-coef, the policy the penalty pulls toward: --model as loaded here, whatever checkpoint the
# run continues. Under LoRA with only adapters training, the policy itself with its adapters off;
# otherwise a frozen copy, loaded as the policy is (rank 0 reads it), in the base's dtype.
reference = None
if args.kl_coef:
    reference = model if trains_adapters_only(model) else load_sharded_model(args.model, device, frozen=True)
tokenizer = AutoTokenizer.from_pretrained(args.model)
eos_ids = model_eos_ids(args.model)  # where vLLM ends a turn besides <|im_end|>
problems, n_long = drop_long_prompts(problems, tokenizer, args.max_prompt, args.tools)
log(f"data: {len(problems)} problems from {args.data}; "
    f"dropped {n_long} with a prompt over {args.max_prompt} tokens")
groups = param_groups(model, args)  # under LoRA two groups: the adapters, then what trains in full
peaks = [group["lr"] for group in groups]  # taken before a loaded optimizer state could change them
optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay,
                              fused=device.type == "cuda")  # one kernel per step on GPUs

# Where the run starts: its own newest checkpoint (--resume), an earlier stage's (--init-from), or
# the beginning. The data stream's `position` counts problems taken; `stream_start` is where this run
# began in it (it enters the sampling seeds, so a continued stream never repeats an earlier stage's).
ckpt_root = os.path.join(args.out_dir, "checkpoints")
start = start_point(model, optimizer, ckpt_root, args.resume, args.init_from, args.reset_optimizer, args.data)
start_step, position, stream_start = start["step"], start["position"], start["stream_start"]
log(start["message"])
stream = ProblemStream(problems, args.seed)

# -----------------------------------------------------------------------------
# Rollout engine and sandbox: one vLLM engine per rank on its own GPU (colocated), asleep while the
# trainer runs, its weights the trainer's (it never reads the checkpoint); a sandbox pool per rank
# sized to its share of the node's cores. A rank whose pool cannot start raises: the job stops.

frozen = (reference,) if reference is not None and reference is not model else ()  # offloaded with the model
with trainer_offloaded(model, optimizer, device, offload, frozen):  # vLLM wants its whole share free at start
    llm = make_engine(args.model, max_model_len=args.max_prompt + args.max_response, seed=args.seed,
                      memory_fraction=memory_fraction, kv_cache_tokens=args.kv_cache_tokens,
                      external_launcher=world_size > 1, weights=False, rank=rank)  # a seed of its own
    sleep(llm)  # the sync below wakes its weights, and the first rollout its KV cache
kv_budget = int(kv_capacity_tokens(llm.llm_engine) * args.kv_overcommit)
rollout_settings = rollout_config(args, kv_budget=kv_budget, eos_ids=eos_ids)  # each draw: its own seed
sandbox = Sandbox(timeout=args.tool_timeout)
roll_out = rollout_scheduled if args.driver == "scheduler" else rollout_lockstep
sync_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
sync_weights(llm, full_weights(model, sync_dtype))  # the engine started without the checkpoint's weights
wandb_run = None
if args.wandb and master:
    import wandb  # optional: only when asked for
    wandb_run = wandb.init(project=args.wandb, config=config)

# -----------------------------------------------------------------------------
# What the policy update's infrastructure (infra/update.py) needs of this model. Prompts start alike (the
# system prompt): on CPUs that runs once per micro-batch, these probes say how far.

probes = [prompt_ids(tokenizer, question, args.tools) for question in ("1", "What")]
policy = Policy(model, pad_token_id(tokenizer), device, args.temperature, args.micro_batch_tokens, rank,
                world_size, probes, reference)

# -----------------------------------------------------------------------------
# The step loop.

metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "a", buffering=1) if master else None
samples_file = open(os.path.join(args.out_dir, "samples.txt"), "a", buffering=1) if master else None
history = []  # this run's earlier rows, for the collapse alarm
for step in range(start_step, args.steps):
    t_step = time.perf_counter()
    row = {"step": step + 1}
    step_seed = args.seed * 1_000_003 + stream_start + step

    # ---- problems and rollouts: 2G per problem, graded and rewarded; every rank gets all their numbers ----
    # With --dynamic-sampling a step draws problems again while it holds fewer mixed groups (some
    # rollouts right, some wrong) than --problems-per-step: an all-right or all-wrong group has zero
    # advantages and teaches nothing. Each draw's problems get their own indices, so groups stay apart.
    t0 = time.perf_counter()
    trajs, timing, drawn = [], defaultdict(float), 0
    with trainer_offloaded(model, optimizer, device, offload, frozen):  # when the plan gives the engine room
        wake_for_rollout(llm)
        while True:
            batch = stream.take(position, args.problems_per_step)
            position += args.problems_per_step
            draw = drawn // args.problems_per_step  # the first draw samples as a run without the flag
            cfg = dataclasses.replace(rollout_settings, seed=step_seed + 100_003 * draw)
            problem_queue = ProblemQueue(key=f"{args.out_dir}/{step}/{draw}", distributed=world_size > 1,
                                         group=cpu_group())
            new, stats = roll_out(llm.llm_engine, tokenizer, sandbox, batch, args.rollouts_per_problem, cfg,
                                  problem_queue)
            for t in new:
                t.index += drawn
            trajs += new
            drawn += len(batch)
            for key in ("gen_seconds", "tool_wait_seconds"):
                timing[key] += stats.get(key, 0.0)
            n_mixed = len(mixed_groups(trajs))
            if draw == 0:
                row["mixed_first_draw"] = n_mixed  # what a step without --dynamic-sampling would train
            if not args.dynamic_sampling or n_mixed >= args.problems_per_step or \
                    drawn >= args.max_draws * args.problems_per_step:
                break
        sleep(llm)
    row["rollout_seconds"] = time.perf_counter() - t0
    stats = dict(stats, **trajectory_metrics(trajs), **timing)  # counted over every draw of the step
    if args.dynamic_sampling:  # train the first --problems-per-step mixed groups, in the order drawn
        keep = set(sorted(mixed_groups(trajs))[:args.problems_per_step])
        trajs = [t for t in trajs if t.index in keep]
    row.update(drawn_problems=drawn, mixed_groups=n_mixed,
               mixed_share=len(mixed_groups(trajs)) / args.problems_per_step)

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
    parts = mini_batches(policy, kept, advantages, problem_queue, args.mini_batches)  # (the exchange)
    for part in parts:
        for micro in part:
            logp, entropy = token_logprobs(model, micro.input_ids, micro.attention_mask, args.temperature,
                                           prefix=micro.prefix, recompute=device.type == "cuda", packed=True,
                                           entropy=True)                                   # (B, T-1) each
            old_logp = logp.detach() if micro.old_logp is None else micro.old_logp  # the first: ratio 1
            # The sampler drew these tokens, not the trainer: an optional correction (grpo_roc.py (11)).
            weights, loss_mask, mismatch = mismatch_correction(old_logp, micro.sampler_logp, micro.loss_mask,
                                                            part.n_loss_tokens, args.mismatch_correction,
                                                            args.mismatch_threshold)
            loss, metrics = policy_loss(logp, old_logp, micro.advantages, loss_mask, part.n_loss_tokens,
                                        args.eps_low, args.eps_high, token_weights=weights,
                                        ref_logp=micro.reference_logprobs(), kl_coef=args.kl_coef,
                                        entropy=entropy, n_rollouts=part.n_rollouts)
            micro.backward(loss)
            part.record(logp, micro, dict(metrics, **mismatch, loss=loss.item()))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if kept:  # a step where every group was dropped changes nothing
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        part.record_grad_norm(grad_norm)
    row.update(step_metrics(parts, device), lr=peaks[0] * warm)  # lr: --lr, or under LoRA the adapters'
    row["train_seconds"] = time.perf_counter() - t0

    # ---- the weight sync: the engine samples the next step with the new weights ----
    t0 = time.perf_counter()
    sync_weights(llm, full_weights(model, sync_dtype))
    row["sync_seconds"] = time.perf_counter() - t0

    # ---- logging ----
    row.update(stats, tokens_per_s=stats["generated_tokens"] / row["rollout_seconds"])  # all 2G rollouts
    # The kept rollouts' reward is what the gradient saw, where the accuracy counts every rollout.
    row.update(kept=len(kept), kept_reward=sum(t.reward for t in kept) / max(len(kept), 1),
               **counts, dropped_group_share=counts["dropped_groups"] / len(groups),
               step_seconds=time.perf_counter() - t_step)
    alarms = collapse_alarms(history, row)
    history.append(row)
    if master:
        print(f"step {step + 1:4d}/{args.steps} | acc {row['accuracy']:.3f} | rew {row['kept_reward']:.3f} | "
              f"drop {row['dropped_group_share']:.2f} | mixed {row['mixed_groups']}/{row['drawn_problems']} "
              f"drawn | len {row['response_length']:6.1f} | "
              f"tools {row['tool_calls']:.2f} (err {row['tool_error_ratio']:.3f}, "
              f"pos {row['tool_error_ratio_pos']:.3f}) | loss {row['loss']:+.4f} | "
              f"entropy {row['entropy']:.3f} | "
              + (f"kl_ref {row['kl_ref']:.2e} | " if args.kl_coef else "") +
              f"gnorm {row['grad_norm']:.3f} | mismatch {row['logprob_mismatch']:.1e} | "
              f"rollout {row['rollout_seconds']:.1f}s train {row['train_seconds']:.1f}s "
              f"sync {row['sync_seconds']:.1f}s" + "".join(f"\n  ALARM (collapse?): {a}" for a in alarms))
        metrics_file.write(json.dumps(dict(row, collapse_alarms=alarms)) + "\n")
        if wandb_run:
            wandb_run.log(dict(row, collapse_alarm=len(alarms)), step=step + 1)
        if args.sample_every and (step + 1) % args.sample_every == 0:
            own = [t for t in trajs if t.rank == rank]  # only this rank holds its own rollouts' text
            for t in own[:: max(1, len(own) // 3)][:3]:
                samples_file.write(f"===== step {step + 1} problem {t.index} sample {t.sample} "
                                   f"reward {t.reward} ({t.finish_reason}) =====\n{t.text}\n")

    # ---- checkpoints: every --save-every steps and always at the last (the next stage starts there) ----
    last = step + 1 == args.steps
    if last or (args.save_every and (step + 1) % args.save_every == 0):
        meta = dict(position=position, stream_start=stream_start, config=config)
        save_checkpoint(model, optimizer, ckpt_root, step + 1, meta, keep=args.keep_checkpoints)
    if last or (args.export_every and (step + 1) % args.export_every == 0):  # final/: the newest export
        export, final = os.path.join(args.out_dir, f"hf_step_{step + 1}"), os.path.join(args.out_dir, "final")
        save_hf_checkpoint(model, tokenizer, export, dtype=sync_dtype, latest=final)

# -----------------------------------------------------------------------------
# Cleanup: the engine goes before the process group, or its finalizer complains.

sandbox.close()
del llm
if dist.is_initialized():  # vLLM may have torn the process group down with the engine
    dist.barrier(group=cpu_group())  # (a rank that tears gloo down while another talks to it can abort)
    dist.destroy_process_group()
