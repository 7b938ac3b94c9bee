"""The policy update on a tiny random Qwen3 model: no vLLM; one process, and two ranks under torchrun.

`update` below is train.py's policy update (its calls, in its order: a test checks it), run on hand-made
trajectories whose prompts share a start (like the system prompt), so the shared-prefix path and the
micro-batch plan of infra/update.py run too."""
import ast
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from grpo_roc import EPS_HIGH, EPS_LOW, mismatch_correction, policy_loss
from rollout import TOKENS, Trajectory
from infra.update import METRICS, SUMMED, Policy, mini_batches, old_logprobs, step_metrics

VOCAB, SHARED_START = 64, [1, 2, 3, 4, 5, 6]
PROBES = [SHARED_START + [7, 8], SHARED_START + [9, 10]]


@pytest.fixture(scope="module", autouse=True)
def group_of_one():
    from infra.training import init_distributed
    init_distributed()  # (a process group of one, as train.py makes without torchrun)


def tiny_model(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return Qwen3ForCausalLM(config).train()


# train.py's defaults, but no gradient clipping and every row of these tests in one micro-batch
DEFAULTS = dict(temperature=1.0, eps_low=EPS_LOW, eps_high=EPS_HIGH, mismatch_correction="none", kl_coef=0.0,
                mini_batches=1, grad_clip=1e9, micro_batch_tokens=4096)


def rollouts(n=6, seed=0):
    """n scored trajectories: a shared prompt start, then a sampled turn, a tool turn, a sampled turn."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        turns = [(rng.integers(11, VOCAB, rng.integers(2, 6)), m) for m in (1, 0, 1)]
        t = Trajectory(index=i // 2, sample=i % 2, prompt_ids=SHARED_START + list(rng.integers(11, VOCAB, 2 + i)),
                       response_ids=[int(x) for ids, _ in turns for x in ids],
                       loss_mask=[m for ids, m in turns for _ in ids],
                       logprobs=[-3.0 * m for ids, m in turns for _ in ids])
        for name, dtype in TOKENS.items():  # (as rollout.score leaves them)
            setattr(t, name, np.asarray(getattr(t, name), dtype))
        trajs.append(t)
    return trajs


def update(model, optimizer, kept, advantages, probes=(), reference=None, **changes):
    """train.py's policy update on this process's ranks (one, or torchrun's), its flags `args` (DEFAULTS
    and `changes`): the metrics."""
    args, device = SimpleNamespace(**dict(DEFAULTS, **changes)), torch.device("cpu")
    world_size = dist.get_world_size()
    mismatch_mode, _, k = args.mismatch_correction.partition(":")
    mismatch_threshold = float(k or 2.0)
    policy = Policy(model, 0, device, args.temperature, args.micro_batch_tokens, dist.get_rank(), world_size,
                    probes=list(probes), reference=reference)
    parts = mini_batches(policy, kept, advantages, args.mini_batches)
    for part in parts:
        for micro in part:
            logp, entropy = micro.logprobs()
            old_logp = logp.detach() if micro.old_logp is None else micro.old_logp
            weights, loss_mask, mismatch = mismatch_correction(old_logp, micro.sampler_logp, micro.loss_mask,
                                                            part.n_loss_tokens, mismatch_mode,
                                                            mismatch_threshold)
            loss, metrics = policy_loss(logp, old_logp, micro.advantages, loss_mask, part.n_loss_tokens,
                                        args.eps_low, args.eps_high, token_weights=weights,
                                        ref_logp=micro.reference_logprobs(), kl_coef=args.kl_coef,
                                        entropy=entropy)
            (loss * world_size).backward()
            part.record(logp, micro, dict(metrics, **mismatch, loss=loss.item()))
        part.finish()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if kept:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        part.record_grad_norm(grad_norm)
    return step_metrics(parts, device)


def calls(source: str) -> list[str]:
    """The functions and methods a piece of code calls, in the order they appear."""
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    return [ast.unparse(n.func).split(".")[-1] for n in nodes]


def test_these_tests_run_train_py_s_update_as_it_is_written():
    """`update` is train.py's policy update: the same calls from mini_batches to record_grad_norm, in order."""
    def loop(source):  # from the loop over the mini-batches to its last line
        return textwrap.dedent(source[source.index("    for part in parts:"):
                                      source.index("part.record_grad_norm(grad_norm)") + 32])
    train_py = (Path(__file__).resolve().parent.parent / "train.py").read_text()
    assert calls(loop(train_py)) == calls(loop(inspect.getsource(update))), \
        "train.py's update changed: change `update` here the same way"


def test_one_update_on_a_tiny_model_moves_the_weights_on_policy_and_reports_every_metric():
    model, kept = tiny_model(), rollouts()
    before = [p.detach().clone() for p in model.parameters()]
    row = update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), kept, [1.0, -1.0] * 3, PROBES)
    reported = set(METRICS) - {"ess_sum_w", "ess_sum_w2", "ess_n"} | {"ess", "optimizer_steps"}
    assert set(row) == reported, f"the update must report each metric of METRICS once, got {sorted(row)}"
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["optimizer_steps"] == 1
    assert math.isclose(row["ratio_mean"], 1.0, abs_tol=1e-6), "one step per RL step: the ratio is 1"
    assert row["clip_frac_low"] == row["clip_frac_high"] == 0, "nothing is clipped at ratio 1"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "the step moved nothing"


def test_the_update_scores_exactly_the_sampled_tokens():
    """Sampler log-probs set to the trainer's own: the mismatch must vanish (each token at its position)."""
    model, kept = tiny_model(), rollouts()
    policy = Policy(model, 0, torch.device("cpu"), 1.0, 4096, probes=PROBES)
    logp = old_logprobs(policy, kept, [list(range(len(kept)))])[0]                       # (B, T-1)
    for row, t in enumerate(kept):
        response = logp[row, len(t.prompt_ids) - 1:len(t.prompt_ids) - 1 + len(t.response_ids)]
        t.logprobs = (response.numpy() * t.loss_mask).astype(np.float32)
    row = update(model, torch.optim.SGD(model.parameters(), lr=0.0), kept, [1.0, -1.0] * 3, PROBES)
    assert row["logprob_mismatch_max"] < 1e-5, f"trainer and sampler disagree by {row['logprob_mismatch_max']}"


@pytest.mark.parametrize("micro_batch_tokens, probes", [(24, PROBES), (24, ()), (40, PROBES)])
def test_the_step_does_not_depend_on_how_it_is_cut_into_micro_batches(micro_batch_tokens, probes):
    """One micro-batch for all against many (each row alone at 24 tokens), with and without the shared
    prefix: the same gradient (SGD: the same weights) and every summed metric the same."""
    kept, advantages = rollouts(), [0.5, -1.5, 1.0, -1.0, 2.0, 0.0]
    rows, weights = [], []
    for tokens, prefix_probes in [(4096, ()), (micro_batch_tokens, probes)]:
        model = tiny_model()
        rows.append(update(model, torch.optim.SGD(model.parameters(), lr=1.0), kept, advantages, prefix_probes,
                           micro_batch_tokens=tokens))
        weights.append([p.detach() for p in model.parameters()])
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg="the gradient depends on the micro-batches")
    for key in [k for k in SUMMED if not k.startswith("ess_")] + ["ess"]:  # (the ess sums become "ess")
        assert math.isclose(rows[0][key], rows[1][key], rel_tol=1e-4, abs_tol=1e-7), \
            f"{key} must be summed over every micro-batch, not taken from one"


def test_several_mini_batches_step_from_the_policy_before_the_first():
    model, kept = tiny_model(), rollouts(8)
    row = update(model, torch.optim.AdamW(model.parameters(), lr=5e-2), kept, [1.0, -1.0] * 4, PROBES,
                 mini_batches=2)
    assert row["optimizer_steps"] == 2
    assert not math.isclose(row["ratio_mean"], 1.0, abs_tol=1e-6), \
        "the second step's ratio must be against the policy before the first step"


# -- two ranks against one -----------------------------------------------------------------------
# Every option a GPU run combines, each as train.py loads it (load_sharded_model, load_reference,
# param_groups) and updates it (`update`), two optimizer steps of 5 rollouts in micro-batches of one
# rollout each: a mini-batch of 3 on two ranks leaves one rank a pass of padding beside a data pass.
OPTIONS = {
    "kl to a frozen copy, tis": dict(kl_coef=0.1, mismatch_correction="tis:2"),
    "lora and the head, kl to a frozen copy": dict(kl_coef=0.1, lora=["train=lm_head"]),
    "lora alone, kl to the adapters off": dict(kl_coef=0.1, lora=[]),
    "mask, no kl": dict(mismatch_correction="mask:1.5"),
}


@pytest.mark.slow
def test_two_ranks_with_passes_of_padding_update_like_one(tmp_path):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks that both ranks call the same collectives with
    the same shapes (the reference's forward after the padding's policy forward once hung or, under
    LoRA, paired collectives of another size); a collective that waits half a minute fails the run."""
    tiny_model().save_pretrained(tmp_path / "base")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1",
               TORCH_DISTRIBUTED_DEBUG="DETAIL")
    from conftest import torchrun
    for nproc, launcher in ((1, [sys.executable]), (2, torchrun(2))):
        proc = subprocess.run([*launcher, __file__, str(tmp_path), str(nproc)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{nproc} rank(s):\n{proc.stderr[-4000:]}"
    for name in OPTIONS:
        one, two = (json.loads((tmp_path / f"{name}-{n}.json").read_text()) for n in (1, 2))
        assert two["padding_passes"] > 0 and one["padding_passes"] == 0, f"{name}: no pass of padding"
        assert one["optimizer_steps"] == 2 and (one["kl_ref"] > 0) == ("kl" in name.replace("no kl", ""))
        for key in ("loss", "kl_ref", "clip_frac_low", "clip_frac_high", "masked_frac", "grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), f"{name}: {key} differs, two ranks"
        diff = max(abs(a - b) for a, b in zip(one["weights"], two["weights"]))
        assert diff < 1e-4, f"{name}: two ranks end {diff:.2e} away from one"


def _two_ranks_main(folder: str, nproc: str):
    """The ranks of the test above: every option in turn, its metrics and weights to `folder`."""
    from infra.batch import without_payload
    from infra.lora import lora_settings, param_groups
    from infra.training import init_distributed, load_reference, load_sharded_model
    rank, _, world_size, device = init_distributed(timeout_minutes=0.5)
    for name, option in OPTIONS.items():
        flags = SimpleNamespace(lora_rank=4 if "lora" in option else 0, lora_setting=option.get("lora", []),
                                lr=1e-2, seed=0)
        model = load_sharded_model(f"{folder}/base", device, lora=lora_settings(flags)).train()
        reference = load_reference(model, f"{folder}/base", device) if option.get("kl_coef") else None
        optimizer = torch.optim.AdamW(param_groups(model, flags))
        kept = rollouts(5)  # (each rank holds the tokens of the rollouts it "rolled out", as after gather)
        kept = [t if i % world_size == rank else without_payload(t) for i, t in enumerate(kept)]
        changes = {k: v for k, v in option.items() if k != "lora"}
        row = update(model, optimizer, kept, [1.0, -1.0, 0.5, -0.5, 1.5], PROBES, reference, mini_batches=2,
                     micro_batch_tokens=1, **changes)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        weights = torch.cat([state[k].float().flatten() for k in sorted(state)]).tolist()
        if rank == 0:
            with open(f"{folder}/{name}-{nproc}.json", "w") as f:
                json.dump(dict(row, weights=weights), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _two_ranks_main(sys.argv[1], sys.argv[2])
