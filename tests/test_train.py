"""train.py end to end on the toy world: real vLLM, real sandbox, real FSDP2 (slow).

Each run is a separate process (as users launch it); the runs are small (8 problems x 4 rollouts,
2 steps) so that the whole file takes a few minutes on a CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
SMALL = ["--problems-per-step", "8", "--rollouts-per-problem", "4", "--group-size", "2",
         "--max-response", "256", "--save-every", "1", "--sample-every", "1"]


def train(out, model, data, *flags, nproc=1, stdout=None):
    """Run train.py; its metrics rows (and, with stdout=[], its output is appended there)."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc_per_node", str(nproc)]
    cmd = [*launcher, "train.py", "--preset", "toy", "--model", str(model), "--data", str(data),
           "--out-dir", str(out), *SMALL, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if stdout is not None:
        stdout.append(proc.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(folder):
    from safetensors.torch import load_file
    return load_file(str(Path(folder) / "model.safetensors"))


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, toy_sft_model, toy_world):
    """Two steps in one go with the deterministic lockstep driver (the reference for the others)."""
    out = tmp_path_factory.mktemp("straight")
    rows = train(out, toy_sft_model, toy_world / "train.jsonl", "--steps", "2", "--driver", "lockstep",
                 "--keep-checkpoints", "1")
    return out, rows


def test_two_steps_learn_and_the_engine_samples_with_the_new_weights(tmp_path, toy_sft_model, toy_world):
    rows = train(tmp_path, toy_sft_model, toy_world / "train.jsonl", "--steps", "2")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["kept"] > 0 for r in rows), "the toy SFT model should give mixed groups to learn from"
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert max_diff(weights(tmp_path / "final"), weights(toy_sft_model)) > 0, "training did not change the weights"
    # Step 2 was sampled by the engine after the first sync: its log-probs must be the trainer's.
    assert rows[1]["logprob_mismatch_max"] < 1e-4, f"engine and trainer disagree by {rows[1]['logprob_mismatch_max']:.2e}"
    assert (tmp_path / "checkpoints" / "step_2" / "meta.json").exists()
    assert "<tool_call>" in (tmp_path / "samples.txt").read_text()


def test_resume_continues_exactly_and_a_next_stage_continues_the_data(tmp_path, straight, toy_sft_model, toy_world):
    data = toy_world / "train.jsonl"
    straight_out, straight_rows = straight
    assert os.listdir(straight_out / "checkpoints") == ["step_2"], "--keep-checkpoints 1 keeps the newest only"
    assert all((r["ratio_mean"], r["clip_frac_low"], r["clip_frac_high"], r["optimizer_steps"]) == (1.0, 0, 0, 1)
               for r in straight_rows), "one optimizer step per RL step: the ratio is 1 and nothing is clipped"
    train(tmp_path, toy_sft_model, data, "--steps", "1", "--driver", "lockstep")
    broken = tmp_path / "checkpoints" / "step_9.tmp"          # a crash in the middle of writing step 9
    broken.mkdir()
    (broken / "half.distcp").write_bytes(b"\0" * 100)
    no_meta = tmp_path / "checkpoints" / "step_7"               # a folder without its meta.json
    no_meta.mkdir()
    rows = train(tmp_path, toy_sft_model, data, "--steps", "2", "--driver", "lockstep", "--resume", "1")
    assert [r["step"] for r in rows] == [1, 2], "the resumed run must continue at step 2"
    assert rows[1]["accuracy"] == straight_rows[1]["accuracy"], "step 2 rolled out differently after resume"
    diff = max_diff(weights(tmp_path / "final"), weights(straight_out / "final"))
    assert diff < 1e-5, f"resumed run ends {diff:.2e} away from the straight run"
    # the next stage starts from the last checkpoint and goes on in the same data stream
    printed = []
    train(tmp_path / "next", toy_sft_model, data, "--steps", "1", "--init-from", str(straight_out / "checkpoints"),
          stdout=printed)
    assert "initialised from" in printed[0] and "step_2" in printed[0] and "data position 16" in printed[0]


def test_several_optimizer_steps_clip_and_two_ranks_train_like_one(tmp_path, toy_sft_model, toy_world):
    flags = ["--steps", "1", "--driver", "lockstep", "--mini-batches", "2", "--lr", "2e-3"]
    one = train(tmp_path / "one", toy_sft_model, toy_world / "train.jsonl", *flags)
    two = train(tmp_path / "two", toy_sft_model, toy_world / "train.jsonl", *flags, nproc=2)
    assert one[0]["optimizer_steps"] == 2 and one[0]["clip_frac_low"] + one[0]["clip_frac_high"] > 0, \
        "from the second optimizer step the policy has moved: the clip must act at this learning rate"
    assert [r["accuracy"] for r in one] == [r["accuracy"] for r in two], \
        "seeded rollouts must not depend on which rank samples them"
    for key in ("loss", "clip_frac_low", "clip_frac_high", "approx_kl"):  # global denominators
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-3, abs=1e-6), f"{key} differs on two ranks"
    diff = max_diff(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"))
    assert diff < 1e-4, f"2-rank FSDP2 training ends {diff:.2e} away from 1 rank on the same batch"


def test_no_roc_at_temperature_0_7_drops_long_prompts_and_checkpoints_the_last_step(tmp_path, toy_sft_model,
                                                                                      toy_world):
    lines = (toy_world / "train.jsonl").read_text().splitlines()[:40]
    too_long = json.dumps({"question": "What is " + "1" * 600 + " + 1?", "answer": "2"})  # > --max-prompt 512
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines + [too_long]) + "\n")
    printed = []
    rows = train(tmp_path, toy_sft_model, data, "--steps", "1", "--no-roc", "--temperature", "0.7",
                 "--save-every", "10", stdout=printed)
    assert rows[0]["kept"] > 0 and (tmp_path / "final" / "model.safetensors").exists()
    assert "40 problems" in printed[0] and "dropped 1 with a prompt over 512 tokens" in printed[0]
    assert (tmp_path / "checkpoints" / "step_1" / "meta.json").exists(), "the last step is always checkpointed"
    assert rows[0]["logprob_mismatch_max"] < 1e-4, \
        "at temperature 0.7 the sampler's log-probs must be those the trainer computes (logits / 0.7)"


def test_errors_say_what_to_do(tmp_path, toy_sft_model, toy_world):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "What is 2 + 2?"}\n')
    one = [sys.executable]
    two = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    for launcher, flags, hint in [(one, ["--data", str(tmp_path / "missing.jsonl")], "prepare_rl.py"),
                                  (one, ["--model", str(tmp_path / "no-model")], "sft.py --preset toy"),
                                  (one, ["--data", str(bad)], "bad.jsonl:2"),
                                  (two, ["--problems-per-step", "3"], "does not divide across 2 ranks")]:
        proc = subprocess.run([*launcher, "train.py", "--preset", "toy", "--model", str(toy_sft_model),
                               "--data", str(toy_world / "train.jsonl"), "--out-dir", str(tmp_path / "o"), *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and hint in out and "HINT" in out, f"{flags}: no helpful error in\n{out[-2000:]}"
