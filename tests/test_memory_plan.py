"""memory_plan.py against numbers worked out by hand, and train.py --plan (no weights, no GPU)."""
import subprocess
import sys
from pathlib import Path

from memory_plan import CONTEXT, ENGINE_BUFFERS, GiB, KNOWN, MARGIN, Shape, plan

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(num_hidden_layers=2, hidden_size=4, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            head_dim=2, vocab_size=10, tie_word_embeddings=False)


def test_a_small_config_by_hand():
    # per layer: q and o 2 x 4 x (2 x 2) = 32, k and v 2 x 4 x (1 x 2) = 16, MLP 3 x 4 x 8 = 96, norms 8: 152
    # embeddings and head 2 x 10 x 4 = 80, final norm 4: P = 2 x 152 + 80 + 4 = 388
    s = Shape.of(TINY)
    assert (s.layer_params, s.embedding_params, s.params) == (152, 80, 388)
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2  # keys and values, layers, KV heads, head size, bf16
    assert Shape.of(dict(TINY, tie_word_embeddings=True)).params == 388 - 40, "a tied head is not counted twice"
    p = plan(TINY, ranks=2, gpu_gib=10, micro_batch_tokens=512, rollout_tokens=1000)
    assert p.trainer_resident == 12 * 388 // 2 and p.engine_weights == 2 * 388
    share = 10 * GiB - 2328 - CONTEXT - MARGIN
    assert p.memory_fraction == share / (10 * GiB)
    assert p.kv_cache == share - 776 - ENGINE_BUFFERS
    assert p.rollouts_at_once == p.kv_cache // (16 * 1000)
    # training: 16P/2 = 3104; root 6 x 80; two layers 4 x 152; micro-batch = the 1000-token rollout:
    # checkpoints 2 x 2 x 1000 x 4, one layer recomputed 2 x 1000 x (6 x 4 + 4 x 8), log-probs 12 x 1000 x 10
    assert p.training_peak == 3104 + 480 + 608 + 16_000 + 112_000 + 120_000 + CONTEXT
    assert p.sync_peak == 2328 + 776 + 6 * max(10 * 4, 4 * 8) + CONTEXT
    assert p.fits


def test_the_targets_of_the_gpu_node():
    """14B stage 1 on 8 x 80 GiB admits at least 12 rollouts per GPU, 7B at least 60; 32B does not fit there."""
    stage1 = dict(ranks=8, gpu_gib=80, micro_batch_tokens=8192, rollout_tokens=2048 + 8192)
    assert plan(KNOWN["Qwen3-14B"], **stage1).rollouts_at_once >= 12
    assert plan(KNOWN["Qwen2.5-7B"], **stage1).rollouts_at_once >= 60
    assert not plan(KNOWN["Qwen2.5-32B"], **stage1).fits
    assert plan(KNOWN["Qwen2.5-32B"], **dict(stage1, gpu_gib=192)).fits


def test_train_plan_prints_and_exits_without_loading_weights(toy_world):
    def run(*flags):
        cmd = [sys.executable, "train.py", "--plan", *flags]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    big = run("--stage", "1", "--model", "Qwen3-14B", "--gpu-memory", "80", "--plan-gpus", "8")
    assert big.returncode == 0 and "at once" in big.stdout and "fits: yes" in big.stdout, big.stdout + big.stderr
    too_big = run("--stage", "1", "--model", "Qwen2.5-32B", "--gpu-memory", "80")
    assert too_big.returncode == 1 and "fits: NO" in too_big.stdout
    toy = run("--preset", "toy", "--model", str(toy_world / "init_model"), "--plan-gpus", "1")
    assert toy.returncode == 0 and "fits: yes" in toy.stdout, "the toy preset's plan must fit"
