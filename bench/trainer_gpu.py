"""Benchmark: the trainer on your GPU before a real run. The policy update the way train.py runs it,
on a random-weight Qwen3 of published dims (nothing is downloaded), padded against packed.

    python bench/trainer_gpu.py --model Qwen3-1.7B --rollouts 64   # one H100 80GB: a few minutes
    python bench/trainer_gpu.py --model Qwen3-4B --rollouts 16
    python bench/trainer_gpu.py --model Qwen3-8B --rollouts 16 --lora-rank 32   # LoRA, as train.py's flag
    python bench/trainer_gpu.py --model tiny --rollouts 8 --min-tokens 16 --max-tokens 64  # a CPU, seconds

1. The model: Qwen3 of the dims the hub publishes (QWEN3 below), random bf16 weights written once to
   --work-dir, loaded by training.load_sharded_model as train.py loads it: fp32 master weights, FSDP2
   over one rank, bf16 compute and activation checkpointing on GPUs. With --lora-rank (and train.py's
   other LoRA flags: infra/lora.py) a frozen bf16 base and fp32 adapters, AdamW over the adapters alone.
2. The batch: an RL step's, --rollouts rollouts (2G per problem) of --min-tokens to --max-tokens
   response tokens after a shared --prompt-tokens prompt; tool outputs every few hundred tokens,
   masked out of the loss as rollout.py masks them; random rewards and tool failures; GRPO-RoC keeps
   G of each group (grpo_roc.resample_on_correct; a group of equal rewards keeps its first G at
   advantage 0, so every step has the same work).
3. The update, each way in turn, --rounds times (the first of each way a warm-up, not counted):
   old log-probs (no gradient), training (forward and backward of grpo_roc.policy_loss over the
   micro-batches of batch.plan_micro_batches), the optimizer step (clip, AdamW). padded: rows
   padded to the longest of their micro-batch, foreach AdamW (train.py before); packed: rows back to
   back (logprobs.token_logprobs(packed=True)), fused AdamW on GPUs (train.py now).
4. Per way and phase: seconds, tokens/s (the rollouts' tokens, no padding), MFU (6PN for training,
   2PN for old log-probs; 4PN for LoRA's training, which computes no weight gradient of the base;
   over --peak-tflops), the allocated and reserved peak beside the memory
   plan's figure for the trainer (memory_plan.plan at 1 GPU, without the engine and the context).
5. --offload-rounds rounds of offload.trainer_offloaded: the weights and moments out to host buffers
   and back, seconds and GB/s each way.
The last line: `trainer: packed <x> tokens/s, padded <y> tokens/s: <r>x`.
"""
import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from infra import memory_plan  # noqa: E402
from infra.offload import trainer_offloaded  # noqa: E402
from infra.lora import add_lora_flags, describe, lora_settings, trainable  # noqa: E402
from grpo_roc import group_advantages, policy_loss, resample_on_correct  # noqa: E402
from infra.logprobs import right_pad, token_logprobs, trajectory_tensors  # noqa: E402
from rollout import Trajectory  # noqa: E402
from infra.batch import plan_micro_batches  # noqa: E402
from infra.training import init_distributed, load_sharded_model  # noqa: E402

QWEN3_COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
QWEN3 = {  # the hub's config.json values
    "Qwen3-0.6B": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **QWEN3_COMMON),
    "Qwen3-1.7B": dict(num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **QWEN3_COMMON),
    "Qwen3-4B": dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **QWEN3_COMMON),
    "Qwen3-8B": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, **QWEN3_COMMON),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=4096,
                 max_position_embeddings=4096),  # (the fast test's, on a CPU)
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16

parser = argparse.ArgumentParser(description="The policy update's speed and memory on this GPU, padded "
                                             "against packed.")
parser.add_argument("--model", choices=sorted(QWEN3), default="Qwen3-1.7B", help="published dims to build")
parser.add_argument("--rollouts", type=int, default=64, help="kept rollouts of the step (G per problem)")
parser.add_argument("--group-size", type=int, default=16, help="G; 2G are sampled per problem")
parser.add_argument("--prompt-tokens", type=int, default=300, help="the prompt every rollout shares")
parser.add_argument("--min-tokens", type=int, default=1000, help="the shortest response")
parser.add_argument("--max-tokens", type=int, default=8000, help="the longest response")
parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="train.py's default")
parser.add_argument("--rounds", type=int, default=2, help="updates per way, the first a warm-up")
parser.add_argument("--offload-rounds", type=int, default=3, help="trainer_offloaded rounds (0: none)")
parser.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak for MFU (default: known from its name, else none)")
parser.add_argument("--work-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "rstar2-agent",
                                                       "bench-models"), help="where the random models are")
parser.add_argument("--seed", type=int, default=0, help="the weights', the batch's and the adapters' seed")
add_lora_flags(parser)  # --lora-rank r: the update of LoRA adapters on a frozen base (infra/lora.py)
args = parser.parse_args()


def random_model_dir() -> str:
    """The random-weight model in bf16, written once (a few GB for the real dims)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    path = os.path.join(args.work_dir, f"{args.model}-random-{args.seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(args.seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (initialised where it is fast)
            model = Qwen3ForCausalLM._from_config(Qwen3Config(**QWEN3[args.model]), dtype=torch.bfloat16)
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def rl_batch(vocab: int) -> tuple[list, list]:
    """(2) The kept rollouts of a step and their advantages."""
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab) for _ in range(args.prompt_tokens - 20)]
    kept, advantages = [], []
    for index in range(-(-args.rollouts // args.group_size)):
        prompt, group = system + [rng.randrange(vocab) for _ in range(20)], []
        for sample in range(2 * args.group_size):
            length, mask, calls = rng.randint(args.min_tokens, args.max_tokens), [], 0
            while len(mask) < length:  # a turn the policy samples, then a tool output (masked)
                mask += [1] * rng.randint(100, 600) + [0] * rng.randint(20, 200)
                calls += 1
            mask = mask[:length]
            group.append(Trajectory(index=index, sample=sample, prompt_ids=prompt,
                                    response_ids=[rng.randrange(vocab) for _ in mask], loss_mask=mask,
                                    logprobs=[-rng.random() * m for m in mask], num_turns=calls,
                                    tool_calls=calls, tool_failures={"error": rng.randint(0, calls)},
                                    num_answers=1, reward=float(rng.random() < 0.5)))
        chosen = resample_on_correct(group, args.group_size, rng)[0] or group[:args.group_size]
        kept += chosen
        advantages += group_advantages([t.reward for t in chosen]).tolist()
    return kept[:args.rollouts], advantages[:args.rollouts]


class Phase:
    """Seconds and the allocated and reserved peaks (GiB) of one phase on `device`."""

    def __init__(self, device):
        self.device, self.seconds, self.allocated, self.reserved = device, 0.0, None, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.allocated = torch.cuda.max_memory_allocated() / memory_plan.GiB
            self.reserved = torch.cuda.max_memory_reserved() / memory_plan.GiB
        self.seconds = time.perf_counter() - self.t0


def update(model, optimizer, kept, advantages, packed: bool, device) -> dict:
    """(3) One RL step's update, as update.old_logprobs and train.py's policy update run it (their steps apart,
    for each phase's memory peak); its phases."""
    fused = packed and device.type == "cuda"  # (as train.py: fused AdamW on GPUs)
    if optimizer.param_groups[0]["fused"] != fused:
        optimizer.state.clear()  # (fused AdamW keeps its step counts on the GPU: a fresh state for it)
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, not fused
    lengths = [t.prompt_length + t.response_length for t in kept]
    plan = plan_micro_batches(lengths, args.micro_batch_tokens, 1, packed=packed)[0]
    n_loss_tokens = max(1, sum(t.num_loss_tokens for t in kept))
    phases, old = {name: Phase(device) for name in ("old log-probs", "training", "optimizer step")}, {}
    recompute = device.type == "cuda"
    with phases["old log-probs"], torch.no_grad():
        for micro_batch in plan:
            tensors = trajectory_tensors([kept[i] for i in micro_batch], 0, device)
            logp = token_logprobs(model, *tensors[:2], recompute=recompute, packed=packed)     # (B, T-1)
            for row, i in enumerate(micro_batch):
                old[i] = logp[row, :lengths[i] - 1].cpu()
    with phases["training"]:
        for micro_batch in plan:
            _, attention_mask, loss_mask, _ = tensors = trajectory_tensors([kept[i] for i in micro_batch], 0,
                                                                            device)
            logp = token_logprobs(model, *tensors[:2], recompute=recompute, packed=packed)     # (B, T-1)
            old_logp = right_pad([old[i].tolist() for i in micro_batch], 0.0).to(device)       # (B, T-1)
            adv = torch.tensor([advantages[i] for i in micro_batch], device=device)            # (B,)
            loss, _ = policy_loss(logp, old_logp, adv, loss_mask, n_loss_tokens)
            loss.backward()
    with phases["optimizer step"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return phases


def show(x, width: int, spec: str = ".2f") -> str:
    return f"{x:{width}{spec}}" if x is not None else " " * (width - 1) + "-"


def offload_rounds(model, optimizer, device) -> list[tuple[float, float, int]]:
    """(5) (seconds out, seconds back, bytes) of each round of offload.trainer_offloaded."""
    rounds = []
    for _ in range(args.offload_rounds):
        block = trainer_offloaded(model, optimizer)
        t0 = time.perf_counter()
        host = block.__enter__()
        t1 = time.perf_counter()
        block.__exit__(None, None, None)
        rounds.append((t1 - t0, time.perf_counter() - t1, sum(buffer.numel() for buffer in host)))
    return rounds


def main():
    _, _, _, device = init_distributed()
    on_gpu = device.type == "cuda"
    model = load_sharded_model(random_model_dir(), device, activation_checkpointing=on_gpu,
                               lora=lora_settings(args)).train()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-6, weight_decay=0.01)
    config = QWEN3[args.model]
    kept, advantages = rl_batch(config["vocab_size"])
    params = sum(p.numel() for p in model.parameters())
    tokens = sum(t.prompt_length + t.response_length for t in kept)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / memory_plan.GiB if on_gpu else 80
    plan = memory_plan.plan(config, ranks=1, gpu_gib=gpu_gib, micro_batch_tokens=args.micro_batch_tokens,
                            rollout_tokens=args.prompt_tokens + args.max_tokens, offload="off",
                            lora_rank=args.lora_rank)
    print(f"trainer: {args.model} ({params / 1e6:.3f}M parameters, random weights; {describe(model)}) "
          f"on {name}; {len(kept)} kept rollouts, {tokens} tokens ({min(t.response_length for t in kept)}-"
          f"{max(t.response_length for t in kept)} response tokens each); micro-batches of "
          f"{args.micro_batch_tokens} tokens; {args.rounds} rounds a way, the first a warm-up")
    results = {}
    for way in ("padded", "packed"):
        runs = [update(model, optimizer, kept, advantages, way == "packed", device)
                for _ in range(args.rounds)]
        results[way] = runs[1:] or runs
    padded_tokens = sum(len(mb) * max(kept[i].prompt_length + kept[i].response_length for i in mb)
                        for mb in plan_micro_batches([t.prompt_length + t.response_length for t in kept],
                                                     args.micro_batch_tokens, 1)[0])
    print(f"padding: the padded way runs {padded_tokens} positions for {tokens} tokens "
          f"({1 - tokens / padded_tokens:.1%} padding)")
    print(f"{'way':>6}  {'phase':>14}  {'s':>7}  {'tokens/s':>9}  {'MFU':>6}  {'alloc GiB':>9}  {'plan':>6}  "
          f"{'reserved':>8}  {'plan':>6}")
    # x parameters x tokens: the backward of a frozen weight computes its input's gradient, not its own
    flops = {"old log-probs": 2, "training": 4 if args.lora_rank else 6, "optimizer step": 0}
    rate = {}
    for way, runs in results.items():
        for phase, per_token in flops.items():
            seconds = sum(r[phase].seconds for r in runs) / len(runs)
            mfu = per_token * params * tokens / seconds / (peak * 1e12) if peak and per_token else None
            # the plan's trainer terms (not the engine's, not the context): allocated, then with the reserve
            terms = {k: v for k, v in plan.phases.get(phase, {}).items()
                     if not k.startswith(("engine", "CUDA"))}
            allocated = sum(v for k, v in terms.items() if not k.startswith("allocator")) / memory_plan.GiB
            print(f"{way:>6}  {phase:>14}  {seconds:7.2f}  {tokens / seconds:9.0f}  {show(mfu, 6, '.1%')}  "
                  f"{show(runs[-1][phase].allocated, 9)}  {show(allocated if terms else None, 6)}  "
                  f"{show(runs[-1][phase].reserved, 8)}  "
                  f"{show(sum(terms.values()) / memory_plan.GiB or None, 6)}")
        update_seconds = sum(r[p].seconds for r in runs for p in ("training", "optimizer step")) / len(runs)
        rate[way] = tokens / update_seconds
    for i, (out, back, nbytes) in enumerate(offload_rounds(model, optimizer, device)):
        print(f"offload round {i + 1}: {nbytes / 1e6:.1f} MB out in {out:.2f} s "
              f"({nbytes / out / 1e9:.1f} GB/s), "
              f"back in {back:.2f} s ({nbytes / back / 1e9:.1f} GB/s)")
    print(f"trainer: packed {rate['packed']:.0f} tokens/s, padded {rate['padded']:.0f} tokens/s: "
          f"{rate['packed'] / rate['padded']:.2f}x")


if __name__ == "__main__":
    main()
