"""Benchmark: can a real pretrained model run the loop on this CPU? Training and generation throughput
of one model (SmolLM2-135M-Instruct is the one the tests build), on the project's own format.

    python bench/real_model.py --model ~/.cache/rstar2-agent/real-artefacts-*/smollm2-135m-instruct
    python bench/real_model.py --model DIR --data toy/test.jsonl --sft-data toy/sft.jsonl

1. Training (first: vLLM's CPU worker takes over torch's thread count once the engine exists):
   the HF model in fp32, AdamW, micro-batches of conversations rendered by
   conversation.render_messages (up to --micro-batch-tokens tokens, padding included), each one
   a forward, a backward through logprobs.token_logprobs (the loss sft.py and train.py use) and an
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

3. --rl-step (instead of 1 and 2): one RL step of train.py's work (16 x 8 rollouts, GRPO-RoC to
   G = 4, one optimizer step, the weight sync) the way train.py ran it before and the way it runs
   now, in one process on one engine, phase by phase, each phase of both ways run back to back so
   that both see about the same load on a shared machine:
     rollouts  rollout_scheduled through the sandbox. Before: a seed per turn (vLLM then samples
               request by request); now: one engine seed (RolloutConfig.deterministic).
     update    one AdamW step on the kept trajectories of the first way's rollouts (train.py's
               down-sampling; the same work and the same starting weights for both). Before: FSDP2
               over one rank, the whole prompts run, --before-micro-batch-tokens (train.py's
               default), each chunk's head recomputed in the backward; now: as train.py runs on CPUs
               (the prompts' shared prefix run once, logprobs.SharedPrefix; --micro-batch-tokens
               2048, rows packed without padding; the head's logits kept).
     sync      the new weights into the engine (engine.sync_weights).
   Each phase: wall and process CPU seconds. The last line: `rl step speedup: <x>` (wall).
4. --packing (instead of 1 and 2): one batch of rollouts as in 3, then the update the way train.py
   runs it on CPUs, its micro-batches padded (rows x the longest row <= --micro-batch-tokens) and
   packed (the rows back to back, their tokens <= the budget: logprobs.token_logprobs(packed=True)),
   from the same weights and AdamW state, alternately, --rounds times each. The last line: `packed
   update speedup: <x> (padding share <s>)`, the padding share being what the padded forward ran
   beyond the packed one's tokens.
5. --lora R (instead of 1 and 2): one batch of rollouts as in 3, then the update and the sync the way
   train.py runs them on CPUs, by two trainers of the same weights: full fine-tuning, and LoRA of rank R
   (train.py --lora-rank R: infra/lora.py's defaults; the sync merges). Alternately, --rounds times each.
   Memory: the trainer's state (weights and AdamW moments: tensor bytes) and what an update adds to
   the process's peak RSS (reset before it: /proc/self/clear_refs). The last line: `lora rl step:
   update <x> s full, <y> s LoRA (<r> x), sync <a> / <b> s, trainer state <c> / <d> GB, update peak
   +<e> / +<f> GB`.
"""
import argparse
import contextlib
import copy
import json
import operator
import os
import random
import resource
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

SET_THREADS = torch.set_num_threads  # (vLLM's CPU worker replaces torch.set_num_threads with a no-op)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conversation import prompt_ids, render_messages  # noqa: E402
from infra.engine import CPU_BLOCK, kv_capacity_tokens, make_engine  # noqa: E402
from infra.logprobs import SharedPrefix, right_pad, shared_prefix_length, token_logprobs  # noqa: E402
from infra.batch import plan_micro_batches  # noqa: E402

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
rl = parser.add_argument_group("--rl-step: one RL step, before and now")
rl.add_argument("--rl-step", action="store_true", help="time one RL step both ways (3), then exit")
rl.add_argument("--problems", type=int, default=16, help="problems per step")
rl.add_argument("--rollouts", type=int, default=8, help="rollouts per problem (2G)")
rl.add_argument("--group-size", type=int, default=4, help="G, rollouts kept per problem")
rl.add_argument("--max-response", type=int, default=256, help="response budget in tokens")
rl.add_argument("--max-turns", type=int, default=4, help="assistant turns per rollout")
rl.add_argument("--kv-cache-tokens", type=int, default=32768, help="the engine's KV cache")
rl.add_argument("--before-micro-batch-tokens", type=int, default=8192,
                help="the update's micro-batch budget before (train.py's default)")
rl.add_argument("--fast-threads", type=int, default=0,
                help="torch threads of the phases now (0: the process's, as before)")
rl.add_argument("--packing", action="store_true",
                help="time the update padded and packed (4) on one batch of rollouts, then exit")
rl.add_argument("--rounds", type=int, default=2, help="--packing, --lora: timed updates per way")
rl.add_argument("--lora", type=int, default=0, metavar="R",
                help="time the update and the sync with full fine-tuning and rank-R LoRA (5), then exit")
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
# One RL step (3), before and now.


class Clock:
    """Wall and CPU seconds of one way's phases, added up by name."""

    def __init__(self):
        self.wall, self.cpu = defaultdict(float), defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name):
        t0, cpu0 = time.perf_counter(), time.process_time()
        yield
        self.wall[name] += time.perf_counter() - t0
        self.cpu[name] += time.process_time() - cpu0


def step_problems():
    """train.py's first step on --data (its seeded epoch order), or toy problems made here."""
    if not args.data:
        return [toy_problem() for _ in range(args.problems)]
    from infra.batch import ProblemStream
    from rollout import read_problems
    return ProblemStream(read_problems(args.data), args.seed).take(0, args.problems)


def keep(trajs):
    """train.py's GRPO-RoC down-sampling to G per problem, with the group advantages; a group it drops
    (all correct or all wrong) keeps its first G, advantage 0 (the same work, no gradient), so that an
    untrained model's step still times an update."""
    from grpo_roc import group_advantages, resample_on_correct
    groups = defaultdict(list)
    for t in trajs:
        groups[t.index].append(t)
    down_rng, kept, advantages = random.Random(args.seed), [], []
    for index in sorted(groups):
        group, _ = resample_on_correct(groups[index], args.group_size, down_rng)
        group = group or groups[index][:args.group_size]
        kept += group
        advantages += group_advantages([t.reward for t in group]).tolist() if group else []
    return kept, advantages


def update(model, optimizer, kept, advantages, pad_id, now, clock, packed=None):
    """One optimizer step of train.py's policy loss on `kept` (one rank, one mini-batch); `packed`
    (default: `now`) runs each micro-batch's rows back to back without padding. Returns the tokens the
    forward ran (padding included)."""
    packed = now if packed is None else packed
    from grpo_roc import policy_loss
    from infra.logprobs import trajectory_tensors
    n_loss_tokens = max(1, sum(t.num_loss_tokens for t in kept))
    shared = shared_prefix_length([t.prompt_ids for t in kept]) if now else 0
    lengths = [t.prompt_length + t.response_length - shared for t in kept]
    budget = args.micro_batch_tokens if now else args.before_micro_batch_tokens
    prefix, tokens_run = None, shared
    if shared:
        with clock.phase("forward"):
            prefix = SharedPrefix(model, torch.as_tensor(kept[0].prompt_ids[:shared]))
    for micro_batch in plan_micro_batches(lengths, budget, 1, packed=packed)[0]:
        input_ids, attention_mask, loss_mask, _ = trajectory_tensors([kept[i] for i in micro_batch], pad_id,
                                                                     torch.device("cpu"))
        adv = torch.tensor([advantages[i] for i in micro_batch])                               # (B,)
        tokens_run += int((attention_mask.sum() if packed else input_ids.numel()) - len(micro_batch) * shared)
        with clock.phase("forward"):
            logp = token_logprobs(model, input_ids, attention_mask, args.temperature, prefix=prefix,
                                  recompute=not now, packed=packed)                           # (B, T-1)
            loss, _ = policy_loss(logp, logp.detach(), adv, loss_mask, n_loss_tokens)
        with clock.phase("backward"):
            loss.backward()
    with clock.phase("backward"):
        if prefix is not None:
            prefix.backward()
    with clock.phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tokens_run


def trainer_and_engine(problems):
    """train.py's pieces in one process: a group of one, the engine (the first weight sync untimed),
    the FSDP2 model in fp32 and AdamW."""
    from infra.engine import full_weights, sync_weights
    from infra.training import init_distributed, load_sharded_model
    init_distributed()  # a group of one, as train.py makes it, for FSDP2
    max_len = max(len(prompt_ids(tok, p["question"])) for p in problems) + args.max_response
    llm = make_engine(args.model, max_model_len=max_len, seed=args.seed, kv_cache_tokens=args.kv_cache_tokens)
    model = load_sharded_model(args.model, torch.device("cpu")).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sync_weights(llm, full_weights(model, torch.float32))
    return llm, model, optimizer


def update_start(model, optimizer):
    """AdamW's state made (untimed: a zero gradient at lr 0 allocates it); returns a function that puts
    the weights and that state back, so that every timed update starts from the same point."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None  # (a LoRA base: frozen)
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer.param_groups[0]["lr"] = args.lr
    start = [param.detach().clone() for param in model.parameters()]
    optimizer_start = copy.deepcopy(optimizer.state_dict())

    def restore():
        with torch.no_grad():
            for param, value in zip(model.parameters(), start):
                param.copy_(value)
        optimizer.load_state_dict(optimizer_start)
    return restore


def rl_step():
    """(3): both ways' phases, back to back; the table, then `rl step speedup: x`."""
    from infra.batch import ProblemQueue
    from infra.engine import full_weights, model_eos_ids, sync_weights
    from rollout import RolloutConfig
    from sandbox import Sandbox
    from scheduler import rollout_scheduled
    problems = step_problems()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    llm, model, optimizer = trainer_and_engine(problems)
    ways = {"before": False, "now": True}
    clocks = {name: Clock() for name in ways}
    threads = {"before": torch.get_num_threads(), "now": args.fast_threads or torch.get_num_threads()}
    print(f"rl step: {len(problems)} problems x {args.rollouts} rollouts, G = {args.group_size}, up to "
          f"{args.max_response} tokens and {args.max_turns} turns; torch threads before {threads['before']}, "
          f"now {threads['now']}")

    sandbox, batches, generated = Sandbox(timeout=5.0), {}, {}
    for name, now in ways.items():  # the same problems and weights, each way's sampling seeds
        cfg = RolloutConfig(max_turns=args.max_turns, max_response=args.max_response,
                            temperature=args.temperature, seed=args.seed, deterministic=not now,
                            eos_ids=model_eos_ids(args.model))
        SET_THREADS(threads[name])
        llm.reset_prefix_cache()  # (each way pays for its own prefill of the system prompt)
        with clocks[name].phase("rollout"):
            batches[name], stats = rollout_scheduled(llm.llm_engine, tok, sandbox, problems, args.rollouts,
                                                     cfg, ProblemQueue())
        generated[name] = sum(t.num_loss_tokens for t in batches[name])
    sandbox.close()

    # the update: both ways on the first way's kept trajectories, from the same weights and AdamW state
    kept, advantages = keep(batches["before"])
    restore, tokens_run = update_start(model, optimizer), {}
    for name, now in ways.items():
        restore()
        SET_THREADS(threads[name])
        with clocks[name].phase("update"):
            tokens_run[name] = update(model, optimizer, kept, advantages, pad_id, now, clocks[name])
        with clocks[name].phase("sync"):
            sync_weights(llm, full_weights(model, torch.float32))

    print(f"kept {len(kept)} of {len(batches['before'])} trajectories, "
          f"{sum(t.prompt_length for t in kept)} prompt + {sum(t.response_length for t in kept)} response "
          f"tokens; the forward ran {tokens_run['before']} tokens before, {tokens_run['now']} now (padding "
          f"included; the shared prefix of {shared_prefix_length([t.prompt_ids for t in kept])} once)")
    print(f"sampled tokens: before {generated['before']}, now {generated['now']}")
    print(f"{'phase':>11}  {'before s':>8}  {'cpu s':>7}  {'now s':>8}  {'cpu s':>7}  {'ratio':>6}")
    for phase in ["rollout", "update", "forward", "backward", "optimizer", "sync"]:
        before, now = clocks["before"], clocks["now"]
        indent = "  " if phase in ("forward", "backward", "optimizer") else ""
        print(f"{indent + phase:>11}  {before.wall[phase]:8.1f}  {before.cpu[phase]:7.1f}  "
              f"{now.wall[phase]:8.1f}  {now.cpu[phase]:7.1f}  "
              f"{before.wall[phase] / max(now.wall[phase], 1e-9):6.2f}")
    wall = {name: sum(c.wall[p] for p in ("rollout", "update", "sync")) for name, c in clocks.items()}
    cpu = {name: sum(c.cpu[p] for p in ("rollout", "update", "sync")) for name, c in clocks.items()}
    print(f"{'step':>11}  {wall['before']:8.1f}  {cpu['before']:7.1f}  {wall['now']:8.1f}  "
          f"{cpu['now']:7.1f}  {wall['before'] / wall['now']:6.2f}   (load {load():.1f})")
    print(f"rl step speedup: {wall['before'] / wall['now']:.2f}")


def one_batch():
    """The trainer and the engine, and one batch of rollouts of train.py's first step kept by GRPO-RoC:
    (llm, model, optimizer, kept, advantages, pad_id)."""
    from infra.batch import ProblemQueue
    from infra.engine import model_eos_ids
    from rollout import RolloutConfig
    from sandbox import Sandbox
    from scheduler import rollout_scheduled
    problems = step_problems()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    llm, model, optimizer = trainer_and_engine(problems)
    cfg = RolloutConfig(max_turns=args.max_turns, max_response=args.max_response,
                        temperature=args.temperature, seed=args.seed, eos_ids=model_eos_ids(args.model))
    with Sandbox(timeout=5.0) as sandbox:
        trajs, _ = rollout_scheduled(llm.llm_engine, tok, sandbox, problems, args.rollouts, cfg,
                                     ProblemQueue())
    kept, advantages = keep(trajs)
    return llm, model, optimizer, kept, advantages, pad_id


def packing():
    """(4): one batch of rollouts, then its update padded and packed from the same weights and AdamW
    state, alternately, --rounds times each; the table, then `packed update speedup: x`."""
    llm, model, optimizer, kept, advantages, pad_id = one_batch()
    restore, clocks, tokens_run, results = update_start(model, optimizer), {}, {}, {}
    lengths = [t.prompt_length + t.response_length for t in kept]
    print(f"packing: {len(kept)} kept trajectories of {min(lengths)}-{max(lengths)} tokens, micro-batches of "
          f"{args.micro_batch_tokens} tokens, the shared prefix once, {args.rounds} rounds")
    for _ in range(args.rounds):
        for name in ("padded", "packed"):
            restore()
            clock = clocks.setdefault(name, Clock())
            with clock.phase("update"):
                tokens_run[name] = update(model, optimizer, kept, advantages, pad_id, True, clock,
                                          packed=name == "packed")
            results[name] = [param.detach().clone() for param in model.parameters()]
    drift = max((a - b).abs().max().item() for a, b in zip(results["padded"], results["packed"]))
    share = 1 - tokens_run["packed"] / tokens_run["padded"]
    print(f"the forward ran {tokens_run['padded']} tokens padded, {tokens_run['packed']} packed (padding "
          f"{share:.1%}); the weights after the step differ by {drift:.1e} at most")
    print(f"{'phase':>11}  {'padded s':>8}  {'cpu s':>7}  {'packed s':>8}  {'cpu s':>7}  {'ratio':>6}")
    for phase in ["update", "forward", "backward", "optimizer"]:
        padded, packed = clocks["padded"], clocks["packed"]
        print(f"{phase:>11}  {padded.wall[phase]:8.1f}  {padded.cpu[phase]:7.1f}  {packed.wall[phase]:8.1f}  "
              f"{packed.cpu[phase]:7.1f}  {padded.wall[phase] / max(packed.wall[phase], 1e-9):6.2f}")
    speedup = clocks["padded"].wall["update"] / clocks["packed"].wall["update"]
    print(f"packed update speedup: {speedup:.2f} (padding share {share:.1%}, load {load():.1f})")


def state_bytes(model, optimizer) -> int:
    """The trainer's state in memory: its weights (a LoRA model's frozen base too) and AdamW's moments."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (FSDP2's shards)
    tensors = [*model.parameters(), *(v for st in optimizer.state.values() for v in st.values())]
    return sum(local(t).numel() * local(t).element_size() for t in tensors if torch.is_tensor(t))


def rss_gb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in GB."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kb * 1024 / 1e9


def lora_step():
    """(5): one batch of rollouts; the update and the sync of full fine-tuning and of rank --lora LoRA,
    alternately, --rounds times each; the table, then `lora rl step: ...`."""
    from infra.engine import full_weights, sync_weights
    from types import SimpleNamespace
    from infra.lora import describe, lora_settings, trainable
    from infra.training import load_sharded_model
    llm, model, optimizer, kept, advantages, pad_id = one_batch()
    settings = lora_settings(SimpleNamespace(lora_rank=args.lora, lora_setting=[]))  # (lora.DEFAULTS)
    lora_model = load_sharded_model(args.model, torch.device("cpu"), lora=settings).train()
    lora_optimizer = torch.optim.AdamW(trainable(lora_model), lr=args.lr, weight_decay=0.01)
    trainers = {"full": (model, optimizer), "lora": (lora_model, lora_optimizer)}
    restores = {name: update_start(*trainer) for name, trainer in trainers.items()}
    state = {name: state_bytes(*trainer) / 1e9 for name, trainer in trainers.items()}
    print(f"lora: {len(kept)} kept trajectories; LoRA rank {args.lora}: {describe(lora_model)}; "
          f"{args.rounds} rounds")
    clocks, peak = {name: Clock() for name in trainers}, defaultdict(float)
    for _ in range(args.rounds):
        for name, (trainer, trainer_optimizer) in trainers.items():
            restores[name]()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # (the peak RSS starts again from the RSS now)
            before = rss_gb("VmRSS")
            with clocks[name].phase("update"):
                update(trainer, trainer_optimizer, kept, advantages, pad_id, True, clocks[name])
            peak[name] = max(peak[name], rss_gb("VmHWM") - before)
            with clocks[name].phase("sync"):
                sync_weights(llm, full_weights(trainer, torch.float32))
    print(f"{'phase':>11}  {'full s':>8}  {'cpu s':>7}  {'LoRA s':>8}  {'cpu s':>7}  {'ratio':>6}")
    full, lora = clocks["full"], clocks["lora"]
    for phase in ["update", "forward", "backward", "optimizer", "sync"]:
        print(f"{phase:>11}  {full.wall[phase]:8.1f}  {full.cpu[phase]:7.1f}  {lora.wall[phase]:8.1f}  "
              f"{lora.cpu[phase]:7.1f}  {full.wall[phase] / max(lora.wall[phase], 1e-9):6.2f}")
    print(f"lora rl step: update {full.wall['update']:.1f} s full, {lora.wall['update']:.1f} s LoRA "
          f"({full.wall['update'] / lora.wall['update']:.2f} x), sync {full.wall['sync']:.1f} / "
          f"{lora.wall['sync']:.1f} s, trainer state {state['full']:.2f} / {state['lora']:.2f} GB, "
          f"update peak +{peak['full']:.2f} / +{peak['lora']:.2f} GB (load {load():.1f})")


if args.rl_step:
    rl_step()
    sys.exit(0)
if args.lora:
    lora_step()
    sys.exit(0)
if args.packing:
    packing()
    sys.exit(0)

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
