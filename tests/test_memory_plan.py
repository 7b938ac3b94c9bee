"""infra/memory_plan.py against numbers worked out by hand, and train.py --plan (no weights, no GPU)."""
import subprocess
import sys
from pathlib import Path

import pytest

from infra.memory_plan import (CONTEXT, CUDA_GRAPHS, ENGINE_BUFFERS, HOST_LINK_BYTES_PER_S, MARGIN, PROCESS_HOST,
                         SANDBOX_SLOT, GiB, MiB, describe, gpu_settings, pinned_bytes, plan,
                         weight_allocations)
from infra.memory_plan import KNOWN, Shape

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(num_hidden_layers=2, hidden_size=4, intermediate_size=8, num_attention_heads=2,
            num_key_value_heads=1, head_dim=2, vocab_size=10, tie_word_embeddings=False)
STAGE1 = dict(ranks=8, gpu_gib=80, micro_batch_tokens=8192, rollout_tokens=2048 + 8192)


def test_the_shape_by_hand():
    # per layer: q and o 2 x 4 x (2 x 2) = 32, k and v 2 x 4 x (1 x 2) = 16, MLP 3 x 4 x 8 = 96, norms 8: 152
    # embeddings and head 2 x 10 x 4 = 80, final norm 4: P = 2 x 152 + 80 + 4 = 388
    s = Shape.of(TINY)
    assert (s.layer_params, s.embedding_params, s.params) == (152, 80, 388)
    tied = Shape.of(dict(TINY, tie_word_embeddings=True))
    assert tied.params == 388 - 40, "a tied head is not counted twice"
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2  # keys and values, layers, KV heads, head size, bf16
    # a layer's activations per token: 30 per hidden unit, 18 per query unit (4), 16 per key/value unit (2),
    # 12 per MLP unit: 120 + 72 + 32 + 96
    assert s.layer_activation_bytes == 320
    # the reload: 4 x module + 2 x its last tensor (gathered in bf16). Embeddings (40): 160 + 80; qkv
    # (16 + 8 + 8): 128 + 16; gate_up (32 + 32): 256 + 64 = 320; o_proj (16): 96; down_proj (32): 192.
    assert s.reload_peak_bytes == 320
    # at 14B the embeddings (or the head): 6 bytes x V x h
    big = Shape.of(KNOWN["Qwen3-14B"])
    assert big.reload_peak_bytes == 6 * 151936 * 5120


def test_pinned_host_memory_is_counted_in_powers_of_two_per_allocation():
    """torch's pinned allocator rounds each request up to a power of two and keeps the block; a level-1
    sleep backs up each of vLLM's weight allocations into one pinned tensor of its own."""
    assert [pinned_bytes(n) for n in (0, 1, 3, MiB, MiB + 1, 70 * MiB)] == [0, 1, 4, MiB, 2 * MiB, 128 * MiB]
    # Qwen3-14B in bf16, per layer: qkv 5120 x 7168 x 2 = 70 MiB, o 50 MiB, gate_up 340 MiB, down 170 MiB;
    # embeddings and head 151936 x 5120 x 2 = 1483.75 MiB each (1484 in 2 MiB steps); the norms packed in
    # one 20 MiB segment. Pinned: 128 + 64 + 512 + 256 = 960 MiB a layer, 2048 MiB each for the two ends.
    s = Shape.of(KNOWN["Qwen3-14B"])
    assert sorted(weight_allocations(s)) == sorted([70 * MiB, 50 * MiB, 340 * MiB, 170 * MiB] * 40
                                                   + [1484 * MiB] * 2 + [20 * MiB])
    pinned = sum(map(pinned_bytes, weight_allocations(s)))
    assert pinned == (40 * 960 + 2 * 2048 + 32) * MiB, "41.5 GiB of pinned memory for 27.5 GiB of weights"
    level = {n: plan(KNOWN["Qwen3-14B"], **STAGE1, sleep_level=n).host["engines asleep: pinned backups"]
             for n in (1, 2)}
    assert level == {2: 8 * 512 * MiB, 1: 8 * (512 + 40 * 960 + 2 * 2048 + 32) * MiB}, \
        "node 0's 8 engines: their runtime pools, and at level 1 every weight allocation rounded up"
    tiny = plan(TINY, ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, sleep_level=1)
    assert tiny.host["engines asleep: pinned backups"] == 2 * (512 + 32) * MiB  # TINY's weights: one 20 MiB


def test_every_phase_by_hand():
    p = plan(TINY, ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, offload="off",
             rollouts_per_step=4, cores_per_node=6)
    gpu = 10 * GiB
    # vLLM's defaults under 70 GiB: 8192 batched tokens, 256 sequences. Buffers that stay while it sleeps:
    # inputs_embeds 8192 x 4 x 2, the Triton sampler buffer 304 x 10 x 4, the rest
    buffers = 8192 * 4 * 2 + 304 * 10 * 4 + ENGINE_BUFFERS
    # the profile: a forward of 8192 tokens x (8 x 4 + 6 x 8) = 655,360; the sampler 256 x 10 x 18 + the
    # hidden states 8192 x 4 x 2 = 111,616: the forward is the peak
    engine = 2 * 388 + CUDA_GRAPHS + buffers + 655_360
    share = gpu - MARGIN - CONTEXT - 12 * 388 // 2
    graphs = "engine: CUDA graphs (on the GPU asleep too)"
    assert p.phases["rollout"] == {
        "trainer: fp32 weights, AdamW moments": 2328, "CUDA context, NCCL": CONTEXT,
        "engine: bf16 weights": 776, graphs: CUDA_GRAPHS, "engine: buffers": buffers,
        "engine: profile's transient peak": 655_360, "engine: KV cache": share - engine}
    assert p.memory_fraction == share / gpu and p.peaks["rollout"] == gpu - MARGIN
    assert p.kv_cache == share - engine
    assert p.rollouts_at_once == (share - engine) // (16 * 1000)
    # training: the 1000-token rollout is a micro-batch alone. The peak is a layer's backward (1,127,296 +
    # the rest) over the log-prob chunks' (1,014,464: the final hidden states 12 x 1000 x 4, a chunk
    # 16 x 1000 x 10, the head's gradient and its temporary 2 x 10 x 4 each, instead of the layer's terms)
    assert p.phases["training"] == {
        "trainer: fp32 weights, gradients, AdamW moments": 16 * 388 // 2, "root gathered (bf16)": 2 * 80,
        "each layer's input (checkpoints)": 2 * 2 * 1000 * 4, "padding mask": 3 * 512 * 512,
        "two layers gathered (bf16)": 2 * 2 * 152, "a layer's bf16 gradients, fp32 reduce copy": 6 * 152,
        "a layer's activations recomputed": 1000 * 320, "head's bf16 gradient": 2 * 10 * 4,
        "allocator: reserved beyond allocated": 112_729,
        graphs: CUDA_GRAPHS, "engine: buffers": buffers, "CUDA context, NCCL": CONTEXT}
    # (vLLM keeps the CUDA graphs on the GPU while it sleeps: sleep_mode_offload_cudagraph is off)
    asleep = CUDA_GRAPHS + buffers
    # the allocator's reserve: a tenth of the trainer's tensors (expandable segments)
    assert p.peaks["training"] == 1_127_296 + 112_729 + asleep + CONTEXT
    # fused AdamW: weights, gradients, moments and no temporary (16P/N), and a tenth of them reserved
    assert p.peaks["optimizer step"] == 16 * 388 // 2 + 310 + asleep + CONTEXT
    # resume: the optimizer state initialised (16P/N = 3104) is more than loading (4P/N + 4 x 152 = 1384)
    assert p.peaks["resume"] == 3104 + asleep + CONTEXT
    assert p.peaks["sync"] == 2328 + 776 + asleep + 320 + CONTEXT
    # host, 2 GPUs on the node: 4 rollouts x 1000 tokens, each rank its own half at 90 bytes a token
    # (lists while they grow) and 1 KiB of numbers for each of the 4; sandbox: (6 // 2 - 1) slots a rank.
    # The engines sleep at level 2: only their runtime pools (ENGINE_BUFFERS, 512 MiB) in pinned memory
    assert p.host == {"engines asleep: pinned backups": 2 * 512 * MiB,
                      "trainer offloaded: pinned weights, moments": 0,
                      "trajectories: each rank's own, every one's numbers": 2 * (4000 // 2 * 90 + 4 * 1024),
                      "rank 0's HF export: fp32 state dict, bf16 copy": 6 * 388,
                      "sandbox workers": 4 * SANDBOX_SLOT, "processes": 2 * PROCESS_HOST}
    assert (p.offload, p.offload_bytes_per_step, p.offload_seconds) == (False, 0, 0.0)
    assert p.fits

    on = plan(TINY, ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, offload="on",
              rollouts_per_step=4, cores_per_node=6)
    assert "trainer: fp32 weights, AdamW moments" not in on.phases["rollout"]
    assert on.kv_cache == p.kv_cache + 2328 and on.memory_fraction == (share + 2328) / gpu
    assert on.host["trainer offloaded: pinned weights, moments"] == 2 * 2328
    assert on.offload_bytes_per_step == 2 * 2328 and on.offload_seconds == 2 * 2328 / HOST_LINK_BYTES_PER_S
    assert on.peaks["sync"] == p.peaks["sync"], "the trainer offloads after the sync"


def test_a_frozen_reference_is_counted_beside_the_trainer_and_offloaded_with_it():
    common = dict(ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, rollouts_per_step=4,
                  cores_per_node=6)
    off, ref = plan(TINY, offload="off", **common), plan(TINY, offload="off", reference=True, **common)
    # a bf16 copy of P = 388 parameters sharded over 2 GPUs: 2 x 388 / 2 = 388 bytes a GPU, in every phase
    term = "reference: frozen bf16 weights"
    assert {phase: terms.get(term) for phase, terms in ref.phases.items()} == dict.fromkeys(ref.phases, 388)
    for phase in ("resume", "optimizer step", "sync"):
        assert ref.peaks[phase] == off.peaks[phase] + 388, f"{phase}: counted once, no reserve"
    # in training the copy's root stays gathered through the micro-batches: embeddings and head, 2 x 80
    assert ref.phases["training"]["reference: root gathered (bf16)"] == 2 * 80
    assert ref.peaks["training"] == off.peaks["training"] + 388 + 160
    # without the offload the engine's share gives the reference its room: 388 bytes less KV cache
    share = 10 * GiB - MARGIN - CONTEXT - 12 * 388 // 2
    assert ref.kv_cache == off.kv_cache - 388 and ref.memory_fraction == (share - 388) / (10 * GiB)
    assert ref.host == off.host, "nothing is offloaded, nothing more is pinned"
    # offloaded, the reference goes to the host with the trainer's 12P/N = 2328 bytes and comes back
    on = plan(TINY, offload="on", reference=True, **common)
    assert term not in on.phases["rollout"] and on.phases["sync"][term] == 388
    assert on.kv_cache == plan(TINY, offload="on", **common).kv_cache
    assert on.host["trainer offloaded: pinned weights, moments"] == 2 * (2328 + 388)
    assert on.offload_bytes_per_step == 2 * (2328 + 388)
    assert "a frozen reference" in describe(ref) and "reference" not in describe(off)


def test_train_py_gpu_settings_pass_the_reference_to_the_plan():
    import torch
    from types import SimpleNamespace
    printed = []
    flags = SimpleNamespace(model="Qwen3-14B", memory_fraction="auto", offload_trainer="off", kl_coef=0.01,
                            micro_batch_tokens=8192, max_prompt=2048, max_response=8192, problems_per_step=512,
                            rollouts_per_problem=32, lora_rank=0, lora_setting=[])
    fraction, offload = gpu_settings(flags, torch.device("cuda"), 8, printed.append)
    expected = plan(KNOWN["Qwen3-14B"], 8, gpu_gib=80, offload="off", reference=True, micro_batch_tokens=8192,
                    rollout_tokens=10240)
    assert (fraction, offload) == (expected.memory_fraction, False)
    assert "reference: frozen bf16 weights" in printed[0]


def test_the_other_moments_of_the_backward_and_the_load():
    # a vocabulary of 1000: a log-prob chunk's 16 x 1000 x 1000 makes the chunks' backward the peak
    big_vocab = plan(dict(TINY, vocab_size=1000), ranks=2, gpu_gib=10, micro_batch_tokens=512,
                     rollout_tokens=1000)
    terms = big_vocab.phases["training"]
    assert terms["a log-prob chunk's logits and gradients"] == 16 * 1000 * 1000
    assert terms["final hidden states and norm"] == 12 * 1000 * 4
    assert terms["head's bf16 gradient"] == terms["a chunk's head-gradient temporary"] == 2 * 1000 * 4
    assert "a layer's activations recomputed" not in terms
    # h = 16, V = 1000, 2-token rows: the root's reduce at the end (6 x 32,000) is the peak: the chunks'
    # moment adds 162,956 (root 64,000, head gradient and temporary 32,000 each, a chunk 16 x 2 x 1000, ...)
    wide = dict(TINY, hidden_size=16, vocab_size=1000)
    # P = 2 x (2 x 16 x 4 + 2 x 16 x 2 + 3 x 16 x 8 + 2 x 16) + 2 x 1000 x 16 + 16 = 2 x 608 + 32,016 = 33,232
    end = plan(wide, ranks=2, gpu_gib=10, micro_batch_tokens=2, rollout_tokens=2)
    assert {k: v for k, v in end.phases["training"].items() if k.startswith(("trainer", "root"))} == {
        "trainer: fp32 weights, gradients, AdamW moments": 16 * 33232 // 2,
        "root's bf16 gradients, fp32 reduce copy": 6 * 32000}
    # over 64 GPUs, moving the root (4 x 32,000) whole onto one GPU at start-up is more than 20P/N (10,385)
    load = plan(wide, ranks=64, gpu_gib=10, micro_batch_tokens=2, rollout_tokens=2)
    assert load.phases["resume"]["trainer: fp32 shards"] == 4 * 33232 // 64
    assert load.phases["resume"]["a module in full (fp32)"] == 4 * 32000


def test_the_offload_decision_at_its_boundary():
    # Qwen3-14B stage 1 on 8 GPUs: P = 40 x (2 x 5120 x 5120 + 2 x 5120 x 1024 + 3 x 5120 x 17408 + 2 x 5120)
    # + 2 x 151936 x 5120 + 5120; a rollout at its longest holds R = 160 KiB x 10240 tokens; the trainer's
    # state S = 12P/8 is 13.2 R.
    p14 = 40 * (2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 17408 + 2 * 5120) + 2 * 151936 * 5120 + 5120
    assert Shape.of(KNOWN["Qwen3-14B"]).params == p14
    r = 160 * 1024 * 10240
    trainer = 12 * p14 // 8
    # The engine but its KV cache (16384 batched tokens, 1024 sequences): the sampler's 1024 x 151936 x 18
    # plus the hidden states 16384 x 5120 x 2 beat the forward's 16384 x (8 x 5120 + 6 x 17408)
    engine = (2 * p14 + CUDA_GRAPHS + 16384 * 5120 * 2 + 304 * 151936 * 4 + ENGINE_BUFFERS
              + 1024 * 151936 * 18 + 16384 * 5120 * 2)

    def gpu_gib(kv_if_offloaded):  # the GPU whose share leaves that KV cache when the trainer offloads
        return (kv_if_offloaded + engine + CONTEXT + MARGIN) / GiB

    stage1 = dict(ranks=8, micro_batch_tokens=8192, rollout_tokens=10240)
    # 28 R: 28 rollouts offloaded, (28 R - S) // R = 14 without: doubled, so auto offloads
    doubled = plan(KNOWN["Qwen3-14B"], gpu_gib=gpu_gib(28 * r), **stage1)
    assert (28 * r - trainer) // r == 14
    assert doubled.rollouts_with_offload == {True: 28, False: 14}
    assert doubled.offload and doubled.rollouts_at_once == 28
    # a byte less: 27 offloaded, still 14 without: not doubled, so it does not
    short = plan(KNOWN["Qwen3-14B"], gpu_gib=gpu_gib(28 * r - 1), **stage1)
    assert short.rollouts_with_offload == {True: 27, False: 14}
    assert not short.offload and short.rollouts_at_once == 14
    assert "trainer: fp32 weights, AdamW moments" in short.phases["rollout"]
    assert plan(KNOWN["Qwen3-14B"], gpu_gib=gpu_gib(28 * r - 1), offload="on", **stage1).offload
    # 256K-token rollouts (R' = 40 GiB), room for one when offloaded and none without: that doubles too
    long = dict(stage1, rollout_tokens=262144)
    one = plan(KNOWN["Qwen3-14B"], gpu_gib=gpu_gib(160 * 1024 * 262144), **long)
    assert one.rollouts_with_offload == {True: 1, False: 0} and one.offload and one.rollouts_at_once == 1
    with pytest.raises(ValueError, match="HINT"):
        plan(TINY, ranks=1, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, offload="yes")


def test_the_targets_of_the_gpu_node():
    """14B stage 1 on 8 x 80 GiB offloads and admits at least 24 rollouts per GPU at their longest, every
    phase fitting; 7B keeps its trainer on the GPU and admits at least 60; 32B does not fit there."""
    p = plan(KNOWN["Qwen3-14B"], **STAGE1)
    assert p.offload and p.rollouts_at_once >= 24 and p.fits
    assert p.rollouts_with_offload[False] < 14, "counted in full, 14B holds fewer than 14 without offloading"
    assert all(peak <= 80 * GiB - MARGIN for peak in p.peaks.values()), p.peaks
    assert set(p.peaks) == {"resume", "rollout", "training", "optimizer step", "sync"}
    assert p.offload_bytes_per_step == 2 * 12 * p.params // 8  # 41 GiB per GPU: under 2 s at 25 GB/s
    assert p.offload_seconds < 2
    seven = plan(KNOWN["Qwen2.5-7B"], **STAGE1)
    assert not seven.offload and seven.rollouts_at_once >= 60 and seven.fits
    assert not plan(KNOWN["Qwen2.5-32B"], **STAGE1).fits
    assert plan(KNOWN["Qwen2.5-32B"], **dict(STAGE1, gpu_gib=192)).fits


@pytest.mark.parametrize("lora_rank", [0, 32])
def test_describe_prints_every_phase_and_term(lora_rank):
    p = plan(KNOWN["Qwen3-14B"], **STAGE1, lora_rank=lora_rank)
    text = describe(p)
    for phase, terms in p.phases.items():
        assert f"  {phase}: peak {sum(terms.values()) / GiB:.1f}" in text
        for name in terms:
            assert name in text
    for name in p.host:
        assert name in text
    assert f"trainer offload: {'on' if p.offload else 'off'}" in text and "fits: yes" in text
    assert f"{p.rollouts_at_once} at once" in text and ("LoRA rank 32" in text) == bool(lora_rank)
    assert max(len(line) for line in text.splitlines()) <= 110


def test_train_plan_prints_and_exits_without_loading_weights(toy_world):
    def run(*flags):
        cmd = [sys.executable, "train.py", "--plan", *flags]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    big = run("8x80", "--stage", "1", "--model", "Qwen3-14B")
    assert big.returncode == 0, big.stdout + big.stderr
    assert "at once" in big.stdout and "fits: yes" in big.stdout, big.stdout
    too_big = run("--stage", "1", "--model", "Qwen2.5-32B")  # (8 GPUs of 80 GiB: --plan's default)
    assert too_big.returncode == 1 and "fits: NO" in too_big.stdout
    toy = run("1", "--preset", "toy", "--model", str(toy_world / "init_model"))
    assert toy.returncode == 0 and "fits: yes" in toy.stdout, "the toy preset's plan must fit"


def test_lora_adapters_are_counted_as_peft_makes_them():
    """all-linear, rank 2, by hand: r x (inputs + outputs) for q (4 + 4), k and v (4 + 2), o (4 + 4), gate and
    up (4 + 8), down (8 + 4): 2 x 64 = 128 a layer; and peft's own count on the same shape of Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from infra.lora import add_lora
    assert Shape.of(TINY).adapter_params(2) == 128
    model = add_lora(Qwen3ForCausalLM(Qwen3Config(**TINY)),
                     dict(r=2, lora_alpha=32.0, lora_dropout=0.0, target_modules="all-linear"))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 128


def test_a_lora_plan_by_hand():
    """--lora-rank 2: the base frozen in bf16 (2P/N), the adapters with fp32 weights, gradients and moments
    (16A/N); no gradient for the head or the embeddings; the export is the merged bf16 state dict."""
    settings = dict(ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, offload="off",
                    rollouts_per_step=4, cores_per_node=6)
    full, lora = plan(TINY, **settings), plan(TINY, **settings, lora_rank=2)
    adapters = 2 * 128
    assert lora.phases["optimizer step"]["trainer: bf16 frozen base"] == 2 * 388 // 2
    assert lora.phases["optimizer step"]["trainer: fp32 adapters, gradients, AdamW moments"] == 16 * adapters // 2
    assert lora.phases["rollout"]["trainer: fp32 adapters, AdamW moments"] == 12 * adapters // 2
    training = lora.phases["training"]
    assert training["a layer's bf16 gradients, fp32 reduce copy"] == 6 * 128
    assert training["head's bf16 gradient"] == 0, "the head is frozen: no gradient of its own"
    assert lora.phases["sync"]["merge: a weight in bf16, fp32, bf16"] == 8 * 4 * 8
    assert lora.host["rank 0's HF export: fp32 state dict, bf16 copy"] == 2 * 388
    assert lora.kv_cache == full.kv_cache + 12 * 388 // 2 - (2 * 388 + 12 * adapters) // 2


def test_a_lora_plan_with_the_head_trained_by_hand():
    """--lora-setting train=lm_head: the head (V x H = 10 x 4 here) leaves the bf16 base (2 bytes a parameter) for
    fp32 weights, gradients and moments (16), and its gradient terms return in training."""
    settings = dict(ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000, offload="off",
                    rollouts_per_step=4, cores_per_node=6, lora_rank=2)
    lora, head = plan(TINY, **settings), plan(TINY, **settings, lora_head=True)
    step = head.phases["optimizer step"]
    assert step["trainer: bf16 frozen base"] == 2 * (388 - 40) // 2
    assert step["trainer: fp32 head, gradients, AdamW moments"] == 16 * 40 // 2
    assert head.phases["rollout"]["trainer: fp32 head, AdamW moments"] == 12 * 40 // 2
    assert "trainer: fp32 head, gradients, AdamW moments" not in lora.phases["optimizer step"]
    gradient_terms = ("head's bf16 gradient", "root's bf16 gradients, fp32 reduce copy")
    gradients = [sum(p.phases["training"].get(term, 0) for term in gradient_terms) for p in (lora, head)]
    assert gradients[0] == 0 < gradients[1], "the trained head's gradient is not counted"


def test_lora_puts_14b_stage_1_on_one_gpu():
    """The plan's target for --lora-rank 32: Qwen3-14B's stage 1 (rollouts of 2K + 8K tokens) on one 80 GiB
    GPU with at least 8 rollouts at their longest; full fine-tuning does not fit there."""
    one_gpu = dict(STAGE1, ranks=1)
    p = plan(KNOWN["Qwen3-14B"], **one_gpu, lora_rank=32)
    assert p.fits and p.rollouts_at_once >= 8, (p.fits, p.rollouts_at_once, p.peaks)
    assert not plan(KNOWN["Qwen3-14B"], **one_gpu).fits
