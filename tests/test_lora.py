"""LoRA (infra/lora.py, train.py --lora-rank) on a tiny random Qwen3: one process, no vLLM, no torchrun.

The update trains the adapters alone; the merged weights the engine and the export get are the model
the trainer scores; checkpoints hold the adapters and their optimizer and load back exactly. The sync
into a real engine is tests/test_train.py's (slow)."""
import argparse
import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from infra.lora import DEFAULTS, add_lora_flags, hf_name, lora_settings, merged_weights, param_groups, trainable
from infra.logprobs import token_logprobs
from test_update import rollouts, tiny_model, update
from infra.training import init_distributed, load_sharded_model, save_checkpoint, save_hf_checkpoint, start_point

RANK = 4


@pytest.fixture(scope="module", autouse=True)
def group_of_one():
    init_distributed()  # (a process group of one, as train.py makes without torchrun)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Qwen3 as an HF folder, the --model of these tests."""
    out = tmp_path_factory.mktemp("tiny_base")
    tiny_model().save_pretrained(out)
    return out


def lora_flags(*argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)  # (train.py's and sft.py's: the adapters' init)
    add_lora_flags(parser)
    return parser.parse_args(["--lora-rank", str(RANK), *argv])


def lora_model(base_dir, *argv):
    model = load_sharded_model(str(base_dir), torch.device("cpu"), lora=lora_settings(lora_flags(*argv)))
    return model.train()


def trained_lora_model(base_dir, steps=2):
    """A LoRA model after `steps` policy updates (its B no longer zero), and its optimizer."""
    model = lora_model(base_dir)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    kept = rollouts()
    for _ in range(steps):
        update(model, optimizer, kept, [1.0, -1.0] * 3)
    return model, optimizer


def scores(model, ids):
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)              # (1, T-1)


def plain_with(state: dict):
    """A plain tiny Qwen3 holding `state` (HF names): what the engine or eval.py runs."""
    model = tiny_model(seed=1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, f"names the base model does not have: {unexpected}"
    assert set(missing) <= {"lm_head.weight"} or not missing, f"weights the merge left out: {missing}"
    return model.eval()


IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 20, 31, 42, 17, 9, 60, 33]])                         # (1, T)


def test_the_update_trains_the_adapters_alone_and_adamw_holds_moments_for_them_only(base_dir):
    base = tiny_model().state_dict()
    model, optimizer = trained_lora_model(base_dir)
    names = {id(p): name for name, p in model.named_parameters()}
    trained = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), \
        f"AdamW must train the adapters alone, it holds {[n for n in trained if '.lora_' not in n][:3]}"
    assert all(len(optimizer.state[p]) for group in optimizer.param_groups for p in group["params"])
    for name, tensor in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor.full_tensor(), base[hf_name(name)]), f"the frozen base {name} changed"
    b = [t.full_tensor() for n, t in model.state_dict().items() if ".lora_B." in n]
    assert all(t.abs().max() > 0 for t in b), "B starts at zero: an update must move it"


def test_the_adapters_init_is_the_runs_seed_whatever_drew_random_numbers_before(base_dir):
    """A rerun of a LoRA run must start from the same adapters, though torch 2.13 seeds a process's random
    stream at random and train.py does not seed it; another --seed gives another A. The caller's stream
    is left as it was."""
    def adapter_a(*argv):
        model = lora_model(base_dir, *argv)
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}
    first = adapter_a("--seed", "3")
    torch.rand(1000)  # (what an engine's start or anything else may draw)
    after = torch.get_rng_state()
    again = adapter_a("--seed", "3")
    assert torch.equal(torch.get_rng_state(), after), "the adapters' init must not move the process's stream"
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    other = adapter_a("--seed", "4")
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_the_merged_weights_are_the_model_the_trainer_scores_and_merging_twice_changes_nothing(base_dir):
    model, _ = trained_lora_model(base_dir)
    trainer = scores(model, IDS)
    first = dict(merged_weights(model, torch.float32))
    second = dict(merged_weights(model, torch.float32))
    assert all(torch.equal(first[k], second[k]) for k in first), \
        "a second merge differs: the merge wrote into the trainer's base weights"
    assert torch.allclose(scores(model, IDS), trainer), "merging changed the trainer's model"
    engine = scores(plain_with(first), IDS)
    assert (engine - trainer).abs().max() < 1e-5, \
        f"the merged weights score {(engine - trainer).abs().max():.2e} away from the trainer: the engine " \
        f"would sample another policy than the one trained"
    base = scores(plain_with(tiny_model().state_dict()), IDS)
    assert (base - trainer).abs().max() > 1e-3, "the adapters did not change the model (the test is vacuous)"


def test_merged_weights_cast_after_the_sum_in_bf16(base_dir):
    model, _ = trained_lora_model(base_dir)
    fp32, bf16 = dict(merged_weights(model, torch.float32)), dict(merged_weights(model, torch.bfloat16))
    rounded_once = [bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].to(torch.bfloat16))
                    for k in fp32]
    assert all(rounded_once), "the bf16 sync must be the fp32 merge rounded once"


def test_a_lora_checkpoint_holds_adapters_and_optimizer_and_resume_restores_both(base_dir, tmp_path):
    model, optimizer = trained_lora_model(base_dir)
    root = tmp_path / "checkpoints"
    meta = dict(position=16, stream_start=0, config={"data": "d", "lora_rank": RANK})
    save_checkpoint(model, optimizer, str(root), 2, meta)
    saved = FileSystemReader(str(root / "step_2")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), \
        f"a LoRA checkpoint must leave the frozen base out (it is --model): {model_keys[:3]}"
    assert any(k.startswith("optim.state.") for k in saved), "the adapters' AdamW moments are not saved"

    fresh = lora_model(base_dir)
    fresh_optimizer = torch.optim.AdamW(trainable(fresh), lr=1e-2)
    start = start_point(fresh, fresh_optimizer, str(root), None, False, "d")
    assert start["step"] == 2 and start["position"] == 16
    assert torch.equal(scores(fresh, IDS), scores(model, IDS)), "resume did not restore the adapters"
    moments = [(optimizer.state[p]["exp_avg"].full_tensor(),
                fresh_optimizer.state[q]["exp_avg"].full_tensor())
               for p, q in zip(trainable(model), trainable(fresh))]
    assert all(torch.equal(a, b) for a, b in moments), "resume did not restore the adapters' AdamW moments"

    reset = lora_model(base_dir)
    reset_optimizer = torch.optim.AdamW(trainable(reset), lr=1e-2)
    start = start_point(reset, reset_optimizer, str(tmp_path / "elsewhere"), str(root), True, "d")
    assert torch.equal(scores(reset, IDS), scores(model, IDS)), "--init-from did not load the adapters"
    assert not reset_optimizer.state, "--reset-optimizer must start AdamW afresh"


def test_the_lora_export_is_a_plain_hf_model_of_the_merged_weights(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    model, _ = trained_lora_model(base_dir)
    out = tmp_path / "hf"
    save_hf_checkpoint(model, _Tokenizer(), str(out))
    assert not (out / "adapter_config.json").exists(), "final/ must be a merged model, not an adapter"
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert (scores(exported, IDS) - scores(model, IDS)).abs().max() < 1e-5, \
        "the export does not score as the trained LoRA model does"


class _Tokenizer:
    """What save_hf_checkpoint asks of a tokenizer (the tiny model has none)."""
    chat_template = None

    def save_pretrained(self, out):
        pass


def test_a_checkpoint_of_another_rank_says_what_to_do(base_dir, tmp_path):
    model, optimizer = trained_lora_model(base_dir, steps=1)
    meta = dict(position=8, stream_start=0, config={"data": "d", "lora_rank": RANK})
    save_checkpoint(model, optimizer, str(tmp_path), 1, meta)
    full = load_sharded_model(str(base_dir), torch.device("cpu")).train()
    with pytest.raises(SystemExit, match="trained with --lora-rank 4, this run has --lora-rank 0"):
        start_point(full, torch.optim.AdamW(full.parameters()), str(tmp_path / "new"), str(tmp_path), False,
                    "d")


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_lora_train_trains_the_head_in_full_at_the_unscaled_lr_and_the_merge_carries_it(base_dir):
    """--lora-setting train=lm_head: AdamW's groups are the adapters at --lr x scale and the head (fp32) at --lr;
    an update changes those alone; the merged weights hold the trained head and score as the trainer."""
    args = lora_flags("--lora-setting", "train=lm_head")
    args.lr = 1e-3
    model = load_sharded_model(str(base_dir), torch.device("cpu"), lora=lora_settings(args)).train()
    groups = param_groups(model, args)
    head = model.base_model.model.lm_head.weight
    assert [group["lr"] for group in groups] == [1e-3 * DEFAULTS["lr_scale"], 1e-3]
    assert groups[1]["params"] == [head] and head.dtype == torch.float32 and head.requires_grad
    before = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(groups)
    kept = rollouts()
    for _ in range(2):
        update(model, optimizer, kept, [1.0, -1.0] * 3)
    changed = {name for name, p in model.named_parameters() if not torch.equal(full(p), before[name])}
    assert "base_model.model.lm_head.weight" in changed and any(".lora_B." in n for n in changed)
    assert all(".lora_" in n or n == "base_model.model.lm_head.weight" for n in changed), \
        f"frozen weights changed: {sorted(n for n in changed if '.lora_' not in n)[:3]}"
    merged = dict(merged_weights(model, torch.float32))
    assert torch.equal(merged["lm_head.weight"], full(head))
    assert (scores(plain_with(merged), IDS) - scores(model, IDS)).abs().max() < 1e-5


def test_a_checkpoint_with_the_head_trained_resumes_both_groups(base_dir, tmp_path):
    """--lora-setting train=lm_head: the checkpoint holds the adapters and the head and both groups' moments; a
    resume restores them, and each group keeps its own learning rate."""
    def trained(steps):
        args = lora_flags("--lora-setting", "train=lm_head")
        args.lr = 1e-3
        model = load_sharded_model(str(base_dir), torch.device("cpu"), lora=lora_settings(args)).train()
        optimizer = torch.optim.AdamW(param_groups(model, args))
        for _ in range(steps):
            update(model, optimizer, rollouts(), [1.0, -1.0] * 3)
        return model, optimizer
    model, optimizer = trained(2)
    meta = dict(position=16, stream_start=0, config={"data": "d", "lora_rank": RANK})
    save_checkpoint(model, optimizer, str(tmp_path), 2, meta)
    fresh, fresh_optimizer = trained(0)
    start_point(fresh, fresh_optimizer, str(tmp_path), None, False, "d")
    # (the sharded head AdamW holds: after a forward FSDP2 leaves the root's weights unsharded on the module)
    head, fresh_head = model.base_model.model.lm_head.weight, fresh.base_model.model.lm_head.weight
    moments = full(optimizer.state[head]["exp_avg"]), full(fresh_optimizer.state[fresh_head]["exp_avg"])
    assert torch.equal(*moments), "resume did not restore the head's AdamW moments"
    assert torch.equal(scores(fresh, IDS), scores(model, IDS)), "resume did not restore the adapters and head"
    assert [g["lr"] for g in fresh_optimizer.param_groups] == [1e-3 * DEFAULTS["lr_scale"], 1e-3]


def test_a_checkpoint_of_other_trained_modules_says_what_to_do(base_dir, tmp_path):
    model, optimizer = trained_lora_model(base_dir, steps=1)
    meta = dict(position=8, stream_start=0, config={"data": "d", "lora_rank": RANK})
    save_checkpoint(model, optimizer, str(tmp_path), 1, meta)
    with_head = lora_model(base_dir, "--lora-setting", "train=lm_head")
    with pytest.raises(SystemExit, match="other trained weights .*lm_head"):
        start_point(with_head, torch.optim.AdamW(trainable(with_head)), str(tmp_path / "new"), str(tmp_path),
                    False, "d")


def test_offloading_a_lora_trainer_holds_the_base_and_the_adapters_moments_alone(base_dir):
    """offload.trainer_offloaded's host buffers, from the first offload (before AdamW has moments): every
    weight (the frozen base too) and two moments for each adapter weight, none for the base (at 14B on
    one GPU that would pin 59 GB of host memory the plan does not count)."""
    from infra.offload import trainer_offloaded
    model = lora_model(base_dir)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 * sum(p.numel() * p.element_size() for p in trainable(model))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    kept = rollouts()
    for round in range(2):
        with trainer_offloaded(model, optimizer) as host:
            held = sum(buffer.numel() for buffer in host)
        assert held == weights + moments + buffers, f"round {round}: {held} bytes held on the host"
        update(model, optimizer, kept, [1.0, -1.0] * 3)


@pytest.mark.parametrize("train", [[], ["--lora-setting", "train=lm_head"]], ids=["adapters", "adapters-and-head"])
def test_the_gpu_layout_a_bf16_base_and_fp32_adapters_shard_and_train_under_bf16_mixed_precision(train):
    """What load_sharded_model builds on GPUs (engine.engine_dtype), sharded as shard_model does there (bf16
    compute, fp32 reduce), here on gloo: FSDP2 takes the mixed dtypes, the adapters (and the train setting's
    head, cast to fp32) alone get fp32 gradients, AdamW steps, and the merge is the fp32 sum rounded once
    to the base's bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from infra.lora import add_lora
    model = add_lora(tiny_model().to(torch.bfloat16), lora_settings(lora_flags(*train)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model(input_ids=IDS).logits.float().sum().backward()
    grads = [p.grad for p in trainable(model)]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.grad is None and p.dtype == torch.bfloat16 for p in frozen)
    torch.optim.AdamW(trainable(model), lr=1e-2).step()
    merged = dict(merged_weights(model, torch.bfloat16))
    up = model.base_model.model.model.layers[0].mlp.up_proj
    a, b = up.lora_A["default"].weight.full_tensor(), up.lora_B["default"].weight.full_tensor()
    by_hand = (up.base_layer.weight.full_tensor().float() + up.scaling["default"] * b @ a).to(torch.bfloat16)
    assert b.abs().max() > 0 and torch.equal(merged["model.layers.0.mlp.up_proj.weight"], by_hand)
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    head = model.base_model.model.lm_head.weight
    assert head.requires_grad == bool(train) and head.dtype == (torch.float32 if train else torch.bfloat16)
    assert torch.equal(merged["lm_head.weight"], head.full_tensor().to(torch.bfloat16))
