"""demo.py end to end on the cached toy world and SFT'd toy model, shortened to 2 RL steps: its
stages skip what exists, the table is read from the evaluations, the ablation adds its column,
and the plot is a PNG."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from report import paired_gain

pytestmark = pytest.mark.slow


def run_demo(cwd, *flags):
    out = subprocess.run([sys.executable, "demo.py", "--steps", "2", "--samples", "2", *flags], cwd=cwd,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"demo.py {' '.join(flags)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table_line(stdout, label):
    return [line for line in stdout.splitlines() if line.startswith(label)][0].split()[len(label.split()):]


def test_demo_runs_the_recipe_and_the_ablation_adds_a_column(tmp_path, toy_world, toy_sft_model):
    # A working copy whose toy world and SFT model already exist (the cached ones).
    for f in ROOT.glob("*.py"):
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy").symlink_to(toy_world)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "toy_sft").symlink_to(toy_sft_model)

    stdout = run_demo(tmp_path)
    assert "1/5 toy world" in stdout and "already done" in stdout, "an existing stage was not skipped"
    sft = json.loads((tmp_path / "runs/demo/eval_sft/table.json").read_text())["table"][0]
    rl = json.loads((tmp_path / "runs/demo/eval_roc/table.json").read_text())["table"][0]
    assert sft["samples"] == rl["samples"] == 2 * sft["problems"]
    accuracy = table_line(stdout, "accuracy (avg@2, %)")
    assert accuracy == [f"{100 * sft['avg_pass@1']:.1f}", f"{100 * rl['avg_pass@1']:.1f}"], "table != table.json"
    gain, se, n = paired_gain(str(tmp_path / "runs/demo/eval_sft"), str(tmp_path / "runs/demo/eval_roc"))
    assert n == sft["problems"]
    assert (f"RL (RoC): held-out accuracy {100 * gain:+.1f} points over the SFT model (paired standard error "
            f"{100 * se:.1f} over {n} problems") in stdout, "the gain printed is not the evaluations' paired gain"
    metrics = [json.loads(line) for line in (tmp_path / "runs/toy_rl/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    png = (tmp_path / "runs/demo/rl_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, "no plot"

    stdout = run_demo(tmp_path, "--no-roc")
    assert "evaluate the SFT model on the held-out problems: already done" in stdout
    header = [line for line in stdout.splitlines() if "RL (RoC)" in line and "SFT" in line][0]
    assert header.split() == ["SFT", "RL", "(RoC)", "RL", "(no", "RoC)"], header
    assert len(table_line(stdout, "tool-use rate (%)")) == 3
    assert '"downsample": "uniform"' in stdout, "the ablation did not reach train.py as --downsample uniform"
    assert (tmp_path / "runs/toy_rl_noroc/final/model.safetensors").exists()
