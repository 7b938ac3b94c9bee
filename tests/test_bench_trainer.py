"""bench/trainer_gpu.py, tiny on a CPU: the benchmark a user runs on a GPU before a real run."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_trainer_benchmark_runs_tiny_on_a_cpu_and_ends_with_its_ratio(tmp_path):
    """Both ways' phases, the padding it measures, offload rounds that move the plan's 12 bytes per
    parameter, and the last line's ratio is the two rates it prints."""
    tiny = ["--model", "tiny", "--rollouts", "4", "--group-size", "2", "--prompt-tokens", "24",
            "--min-tokens", "8", "--max-tokens", "64", "--micro-batch-tokens", "128", "--rounds", "2",
            "--offload-rounds", "2"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trainer_gpu.py"), *tiny,
                          "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    params = float(re.search(r"\(([\d.]+)M parameters", lines[0]).group(1)) * 1e6
    positions, tokens = map(int, re.search(r"runs (\d+) positions for (\d+) tokens", out.stdout).groups())
    assert positions > tokens, "the tiny batch's rollouts differ in length: padding must show"
    for way in ("padded", "packed"):
        for phase in ("old log-probs", "training", "optimizer step"):
            row = rf"^\s*{way}\s+{phase}\s+[\d.]+\s+\d+"
            assert re.search(row, out.stdout, re.M), f"no {way} {phase} row"
    moved = [float(x) * 1e6 for x in re.findall(r"offload round \d: ([\d.]+) MB out", out.stdout)]
    assert len(moved) == 2 and all(abs(m - 12 * params) <= 0.02 * 12 * params for m in moved), \
        f"offload moved {moved} bytes, not the fp32 weights and two moments of {params:.0f} parameters"
    packed, padded, ratio = map(float, re.fullmatch(r"trainer: packed (\d+) tokens/s, padded (\d+) tokens/s: "
                                                    r"([\d.]+)x", lines[-1]).groups())
    assert abs(ratio - packed / padded) <= 0.01 * ratio + 0.01, "the ratio is not the two rates' quotient"


def test_the_trainer_benchmark_with_lora_trains_the_adapters_alone(tmp_path):
    """--lora-rank 4 (train.py's flag): the update trains the adapters alone, and the offload moves every
    weight (the frozen base in fp32 on a CPU) and two moments of the adapters only."""
    tiny = ["--model", "tiny", "--rollouts", "4", "--group-size", "2", "--prompt-tokens", "24",
            "--min-tokens", "8", "--max-tokens", "64", "--micro-batch-tokens", "128", "--rounds", "1",
            "--offload-rounds", "1", "--lora-rank", "4"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trainer_gpu.py"), *tiny,
                          "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    trained, total = (int(x.replace(",", "")) for x in
                      re.search(r"([\d,]+) trainable of ([\d,]+) parameters", out.stdout).groups())
    assert 0 < trained < total / 10, "LoRA at rank 4 trains a few per cent of the weights"
    moved = float(re.search(r"offload round 1: ([\d.]+) MB out", out.stdout).group(1)) * 1e6
    expected = 4 * total + 8 * trained
    assert abs(moved - expected) <= 0.05e6, f"offload moved {moved} bytes, not {expected}"  # (printed in 0.1 MB)
    assert re.fullmatch(r"trainer: packed \d+ tokens/s, padded \d+ tokens/s: [\d.]+x",
                        out.stdout.strip().splitlines()[-1])
