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

from conftest import torchrun

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
SMALL = ["--problems-per-step", "8", "--rollouts-per-problem", "4", "--group-size", "2",
         "--max-response", "256", "--save-every", "1"]


def train(out, model, data, *flags, nproc=1, stdout=None):
    """Run train.py; its metrics rows (and, with stdout=[], its output is appended there). On two ranks
    torch checks that every rank calls the same collectives with the same shapes, and fails at once
    where they differ (TORCH_DISTRIBUTED_DEBUG=DETAIL); a collective that waits a minute fails the run."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    cmd = [*launcher, "train.py", "--preset", "toy", "--model", str(model), "--data", str(data),
           "--out-dir", str(out), *SMALL, "--timeout-minutes", "1", *flags]
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL") if nproc > 1 else None
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
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
    rows = train(out, toy_sft_model, toy_world / "train.jsonl", "--steps", "2", "--driver", "lockstep")
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


def test_lora_the_engine_samples_the_merged_policy_and_final_is_a_plain_model(tmp_path, toy_sft_model,
                                                                              toy_world):
    """The toy preset trains the head in full beside the adapters (--lora-setting train=lm_head): the sync, the
    export and the checkpoint carry it too."""
    rows = train(tmp_path, toy_sft_model, toy_world / "train.jsonl", "--steps", "2", "--lora-rank", "8")
    # Step 2 was sampled after the first sync of the merged weights W + (alpha/r) B A: the trainer's policy.
    mismatch = rows[1]["logprob_mismatch_max"]
    assert mismatch < 1e-4, f"engine and trainer disagree by {mismatch:.2e}"
    final, base = weights(tmp_path / "final"), weights(toy_sft_model)
    changed = {k for k in base if not torch.equal(final[k], base[k])}
    assert "lm_head.weight" in changed and any(k.endswith("proj.weight") for k in changed)
    assert all(k.endswith("proj.weight") or k == "lm_head.weight" for k in changed), \
        f"final/ must be the base with the adapted linear layers merged and the head: {sorted(changed)[:4]}"
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(tmp_path / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k or k.endswith("lm_head.weight") for k in model_keys), \
        "a LoRA checkpoint holds the adapters and the head alone"


def test_resume_continues_exactly_and_logs_each_step_once(tmp_path, straight, toy_sft_model, toy_world):
    data = toy_world / "train.jsonl"
    straight_out, straight_rows = straight
    assert sorted(os.listdir(straight_out / "checkpoints")) == ["step_1", "step_2"], "the newest three are kept"
    assert all((r["ratio_mean"], r["clip_frac_low"], r["clip_frac_high"], r["optimizer_steps"]) == (1.0, 0, 0, 1)
               for r in straight_rows), "one optimizer step per RL step: the ratio is 1 and nothing is clipped"
    train(tmp_path, toy_sft_model, data, "--steps", "1", "--driver", "lockstep")
    broken = tmp_path / "checkpoints" / "step_9.tmp"          # a crash in the middle of writing step 9
    broken.mkdir()
    (broken / "half.distcp").write_bytes(b"\0" * 100)
    no_meta = tmp_path / "checkpoints" / "step_7"               # a folder without its meta.json
    no_meta.mkdir()
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a step logged, then lost with the crash
        f.write(json.dumps({"step": 2, "lost": True}) + "\n")
    rows = train(tmp_path, toy_sft_model, data, "--steps", "2", "--driver", "lockstep")  # (it goes on)
    assert [r["step"] for r in rows] == [1, 2], "each step must be logged once: rows after the checkpoint go"
    assert "lost" not in rows[1] and rows[1]["accuracy"] == straight_rows[1]["accuracy"], \
        "step 2 rolled out differently after resume"
    diff = max_diff(weights(tmp_path / "final"), weights(straight_out / "final"))
    assert diff < 1e-5, f"resumed run ends {diff:.2e} away from the straight run"


def adam_step_count(checkpoint) -> int:
    """AdamW's step count saved in a checkpoint folder (read back from its shards)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(checkpoint), str(checkpoint) + ".pt")
    state = torch.load(str(checkpoint) + ".pt", weights_only=False)["optim"]["state"]
    steps = {int(s["step"]) for s in state.values()}
    assert len(steps) == 1, f"parameters at different AdamW steps: {steps}"
    return steps.pop()


def test_the_three_stage_recipe_hands_over_model_optimizer_data_and_the_hard_problems(tmp_path, toy_sft_model,
                                                                                      toy_world):
    """SFT model -> stage 1 -> stage 2 (--init-from) -> eval.py --filter-solved -> stage 3 (--init-from,
    a fresh optimizer, the filtered file), each as a command, as docs/gpu.md's recipe runs them."""
    data = toy_world / "train.jsonl"
    printed = []
    one = train(tmp_path / "s1", toy_sft_model, data, "--stage", "1", "--steps", "2", "--save-every", "0")
    two = train(tmp_path / "s2", toy_sft_model, data, "--stage", "2", "--steps", "1", "--save-every", "0",
                "--init-from", str(tmp_path / "s1" / "checkpoints"), stdout=printed)
    assert "step_2" in printed[0] and "data position 16" in printed[0], "stage 2 must go on in stage 1's stream"
    for out, steps in [("s1", 2), ("s2", 1)]:
        assert (tmp_path / out / "checkpoints" / f"step_{steps}" / "meta.json").exists(), "last step not saved"
        assert (tmp_path / out / f"hf_step_{steps}" / "model.safetensors").exists(), "last step not exported"
    assert adam_step_count(tmp_path / "s2" / "checkpoints" / "step_1") == 3, "stage 2 must continue the optimizer"

    lines = data.read_text().splitlines()[:12]
    (tmp_path / "pool.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "eval.py", "--model", str(tmp_path / "s2" / "final"), "--filter-solved",
                           "2", "--data", str(tmp_path / "pool.jsonl"), "--out", str(tmp_path / "hard.jsonl"),
                           "--max-response", "256", "--out-dir", str(tmp_path / "verdicts")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = [json.loads(x) for x in (tmp_path / "verdicts" / "samples.jsonl").read_text().splitlines()]
    solved = [sum(s["correct"] for s in verdicts if s["problem"] == i) for i in range(12)]
    hard = (tmp_path / "hard.jsonl").read_text().splitlines()
    unsolved = [dict(json.loads(x), pass_rate=c / 2) for x, c in zip(lines, solved) if c < 2]
    assert [json.loads(x) for x in hard] == unsolved, "exactly the unsolved, with pass rates"
    assert 0 < len(hard), "the toy model should leave some problems unsolved 2/2"

    printed = []
    three = train(tmp_path / "s3", toy_sft_model, tmp_path / "hard.jsonl", "--stage", "3", "--steps", "1",
                  "--save-every", "0", "--init-from", str(tmp_path / "s2" / "checkpoints"), stdout=printed)
    assert f"data: {len(hard)} problems from {tmp_path / 'hard.jsonl'}" in printed[0]
    assert "(fresh optimizer); data position 0" in printed[0], "stage 3 starts its new file from the top"
    assert adam_step_count(tmp_path / "s3" / "checkpoints" / "step_1") == 1, "stage 3's optimizer was not fresh"
    assert (tmp_path / "s3" / "final" / "model.safetensors").exists()
    assert [len(one), len(two), len(three)] == [2, 1, 1]


def test_two_ranks_with_passes_of_padding_train_like_one(tmp_path, toy_sft_model, toy_world):
    """train.py with a KL penalty to a frozen copy, the mismatch correction and dynamic sampling, on two
    ranks against one (every option on its own: tests/test_update.py). An optimizer step per kept
    rollout: each step's rollout is one rank's to train, and the other runs a pass of padding beside it;
    from the second step the policy has moved, so the clip acts and the penalty is not zero. Before the
    passes of padding ran a data pass's calls, two ranks hung here at the first pass with nothing."""
    flags = ["--steps", "1", "--driver", "lockstep", "--mini-batches", "64", "--lr", "5e-4",
             "--micro-batch-tokens", "64", "--kl-coef", "0.1", "--mismatch-correction", "tis",
             "--dynamic-sampling", "2"]
    one = train(tmp_path / "one", toy_sft_model, toy_world / "train.jsonl", *flags)[0]
    two = train(tmp_path / "two", toy_sft_model, toy_world / "train.jsonl", *flags, nproc=2)[0]
    assert two["padding_passes"] > 0 and one["padding_passes"] == 0, "a rank must run a pass of padding"
    assert one["optimizer_steps"] == one["kept"] > 2 and one["clip_frac_low"] + one["clip_frac_high"] > 0, \
        "from the second optimizer step the policy has moved: the clip must act at this learning rate"
    assert one["kl_ref"] > 0, "the policy moved from the reference at the first optimizer step"
    assert one["accuracy"] == two["accuracy"], "seeded rollouts must not depend on which rank samples them"
    for key in ("loss", "kl_ref", "clip_frac_low", "clip_frac_high", "approx_kl", "masked_frac"):
        assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), f"{key} differs on two ranks"
    diff = max_diff(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"))
    assert diff < 1e-4, f"2-rank FSDP2 training ends {diff:.2e} away from 1 rank on the same batch"


def test_a_dynamic_sampling_step_with_no_mixed_group_trains_nothing_and_says_why(tmp_path, toy_sft_model,
                                                                               toy_world):
    """Every gold answer wrong: no group is mixed after every draw, and the step goes on to the next."""
    lines = [json.loads(line) for line in (toy_world / "train.jsonl").read_text().splitlines()[:16]]
    data = tmp_path / "wrong.jsonl"
    data.write_text("".join(json.dumps(dict(p, answer=str(int(p["answer"]) + 1))) + "\n" for p in lines))
    printed = []
    rows = train(tmp_path / "out", toy_sft_model, data, "--steps", "2", "--driver", "lockstep",
                 "--dynamic-sampling", "2", stdout=printed)
    assert [(r["mixed_groups"], r["drawn_problems"], r["kept"]) for r in rows] == [(0, 16, 0)] * 2
    assert printed[0].count("nothing to train") == 2 and rows[0]["dropped_group_share"] == 0
    assert max_diff(weights(tmp_path / "out" / "final"), weights(toy_sft_model)) == 0, "nothing trained"


def test_uniform_at_temperature_0_7_with_a_kl_penalty_drops_long_prompts_and_checkpoints_the_last_step(
        tmp_path, toy_sft_model, toy_world):
    lines = (toy_world / "train.jsonl").read_text().splitlines()[:40]
    too_long = json.dumps({"question": "What is " + "1" * 600 + " + 1?", "answer": "2"})  # > --max-prompt 512
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines + [too_long]) + "\n")
    printed = []
    rows = train(tmp_path, toy_sft_model, data, "--steps", "1", "--downsample", "uniform", "--temperature", "0.7",
                 "--kl-coef", "0.01", "--save-every", "10", stdout=printed)
    assert rows[0]["kept"] > 0 and (tmp_path / "final" / "model.safetensors").exists()
    assert "40 problems" in printed[0] and "dropped 1 with a prompt over 512 tokens" in printed[0]
    assert (tmp_path / "checkpoints" / "step_1" / "meta.json").exists(), "the last step is always checkpointed"
    assert rows[0]["logprob_mismatch_max"] < 1e-4, \
        "at temperature 0.7 the sampler's log-probs must be those the trainer computes (logits / 0.7)"
    assert rows[0]["kl_ref"] < 1e-6 and "kl_ref" in printed[0], \
        "the first step's policy is --model, the reference: no penalty yet, and the step line shows it"


def test_errors_say_what_to_do(tmp_path, toy_sft_model, toy_world):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "What is 2 + 2?"}\n')
    one = [sys.executable]
    two = torchrun(2)
    for launcher, flags, hint in [(one, ["--data", str(tmp_path / "missing.jsonl")], "prepare_rl.py"),
                                  (one, ["--model", str(tmp_path / "no-model")], "sft.py --preset toy"),
                                  (one, ["--data", str(bad)], "bad.jsonl:2"),
                                  (two, ["--problems-per-step", "3"], "does not divide across 2 ranks"),
                                  (one, ["--mismatch-correction", "clip"], "one of"),
                                  (one, ["--mismatch-correction", "tis:1"], "must be > 1")]:
        proc = subprocess.run([*launcher, "train.py", "--preset", "toy", "--model", str(toy_sft_model),
                               "--data", str(toy_world / "train.jsonl"), "--out-dir", str(tmp_path / "o"), *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and hint in out and "HINT" in out, f"{flags}: no helpful error in\n{out[-2000:]}"
        assert "model: " not in out, f"{flags}: found only after the model loaded"
