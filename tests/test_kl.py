"""The KL penalty to a reference policy (train.py --kl-coef, grpo_roc.py (12)) on a tiny random Qwen3: one
process, no vLLM, no download. The reference is the run's --model: a frozen copy, or under LoRA the policy
with its adapters off (lora.trains_adapters_only)."""
import argparse

import pytest
import torch

from grpo_roc import policy_loss
from infra.logprobs import token_logprobs
from infra.lora import adapters_off, add_lora_flags, lora_settings, trainable, trains_adapters_only
from test_update import PROBES, rollouts, tiny_model, update
from infra.training import init_distributed, load_sharded_model

CPU = torch.device("cpu")
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 20, 31, 42, 17, 9, 60, 33]])                         # (1, T)


@pytest.fixture(scope="module", autouse=True)
def group_of_one():
    init_distributed()  # a process group of one, as train.py makes without torchrun


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Qwen3 as an HF folder: the --model of these tests."""
    out = tmp_path_factory.mktemp("tiny_base")
    tiny_model().save_pretrained(out)
    return out


def scores(model, ids=IDS):
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))                              # (1, T-1)


def hand_k3(logp, ref_logp):
    """GRPO's estimate of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1                                # (B, T)


def toy_tokens(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3                   # (B, T)
    ref_logp = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3               # (B, T)
    loss_mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 0]])            # (B, T)
    return logp, ref_logp, loss_mask


def test_the_penalty_is_beta_times_k3_per_loss_token_over_the_losses_denominator():
    logp, ref_logp, loss_mask = toy_tokens()
    no_advantage = torch.zeros(3, dtype=torch.float64)  # the clipped term is then 0: the loss is the penalty
    loss, metrics = policy_loss(logp, logp, no_advantage, loss_mask, 10, ref_logp=ref_logp, kl_coef=0.3)
    by_hand = (hand_k3(logp, ref_logp) * loss_mask).sum()
    assert loss.item() == pytest.approx(0.3 * by_hand.item() / 10), "not beta x k3 / n_loss_tokens"
    assert metrics["kl_ref"] == pytest.approx(by_hand.item() / 10), "kl_ref: per loss token, without beta"
    assert by_hand > 0 and (hand_k3(logp, ref_logp) >= 0).all(), "k3 is never negative"
    _, without = policy_loss(logp, logp, no_advantage, loss_mask, 10)
    assert without["kl_ref"] == 0.0, "without a reference there is no penalty to report"


def test_the_penalty_gradient_is_autograds_of_the_hand_formula():
    logp, ref_logp, loss_mask = toy_tokens(1)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    beta, n_loss_tokens = 0.2, int(loss_mask.sum())
    ours = logp.clone().requires_grad_()
    loss, _ = policy_loss(ours, logp, advantages, loss_mask, n_loss_tokens, ref_logp=ref_logp, kl_coef=beta)
    loss.backward()
    theirs = logp.clone().requires_grad_()
    plain, _ = policy_loss(theirs, logp, advantages, loss_mask, n_loss_tokens)
    (plain + beta * (hand_k3(theirs, ref_logp) * loss_mask).sum() / n_loss_tokens).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, msg="the penalty's gradient is not k3's")
    assert not torch.equal(ours.grad, plain_gradient(logp, advantages, loss_mask, n_loss_tokens)), \
        "the penalty must change the gradient where policy and reference differ"


def plain_gradient(logp, advantages, loss_mask, n_loss_tokens):
    logp = logp.clone().requires_grad_()
    policy_loss(logp, logp.detach(), advantages, loss_mask, n_loss_tokens)[0].backward()
    return logp.grad


def test_the_penalty_is_zero_at_the_first_step_and_grows_as_the_policy_moves(base_dir):
    model = load_sharded_model(str(base_dir), CPU).train()
    assert not trains_adapters_only(model), "without LoRA the reference is a frozen copy"
    reference = load_sharded_model(str(base_dir), CPU, frozen=True)  # as train.py loads it
    assert not any(p.requires_grad for p in reference.parameters())
    frozen = {name: p.detach().full_tensor().clone() for name, p in reference.named_parameters()}  # sharded
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kept = rollouts()
    rows = [update(model, optimizer, kept, [1.0, -1.0] * 3, PROBES, reference, kl_coef=0.1) for _ in range(4)]
    assert rows[0]["kl_ref"] < 1e-9, f"at the first step the policy is the reference: {rows[0]['kl_ref']}"
    assert 0 < rows[1]["kl_ref"] < rows[3]["kl_ref"], f"the penalty must grow as the policy moves: {rows}"
    for name, p in reference.named_parameters():
        assert torch.equal(p.detach().full_tensor(), frozen[name]), f"the reference's {name} moved"
    torch.testing.assert_close(scores(reference), scores(tiny_model()), msg="the reference is not --model")


def test_a_larger_beta_holds_the_policy_closer_to_the_reference(base_dir):
    """The same four AdamW steps with beta 0 (the penalty reported, not applied) and with beta 10."""
    kl = {}
    for beta in (0.0, 10.0):
        model = load_sharded_model(str(base_dir), CPU).train()
        reference = load_sharded_model(str(base_dir), CPU, frozen=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(4):
            row = update(model, optimizer, rollouts(), [1.0, -1.0] * 3, PROBES, reference, kl_coef=beta)
        kl[beta] = row["kl_ref"]
    assert kl[10.0] < kl[0.0] / 10, f"the penalty does not pull the policy back: {kl}"


def lora_model(base_dir, *argv):
    parser = argparse.ArgumentParser()
    add_lora_flags(parser)
    flags = parser.parse_args(["--lora-rank", "4", *argv])
    return load_sharded_model(str(base_dir), CPU, lora=lora_settings(flags)).train()


def test_lora_reference_is_the_base_with_the_adapters_off_and_no_copy(base_dir):
    model = lora_model(base_dir)
    assert trains_adapters_only(model), "under LoRA the reference is the policy itself, no second copy"
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    kept = rollouts()
    rows = [update(model, optimizer, kept, [1.0, -1.0] * 3, PROBES, model, kl_coef=0.1) for _ in range(3)]
    base = scores(tiny_model())
    assert rows[0]["kl_ref"] < 1e-9 and rows[2]["kl_ref"] > 0, f"the adapters must move the policy: {rows}"
    assert (scores(model) - base).abs().max() > 1e-4, "three steps must move the LoRA policy off its base"
    with adapters_off(model):
        torch.testing.assert_close(scores(model), base, msg="adapters off, the policy is not the base")
    assert (scores(model) - base).abs().max() > 1e-4, "leaving adapters_off must switch the adapters back on"


@pytest.mark.parametrize("probes", [PROBES, ()], ids=["shared prefix", "whole prompts"])
def test_the_lora_references_pass_leaves_the_policys_update_as_it_was(base_dir, probes):
    """Switching the adapters off and on between the policy's pass and its backward must not change the
    gradient: with beta 0, two SGD steps with the reference end where two steps without it end."""
    weights = []
    for with_reference in (False, True):
        model = lora_model(base_dir)
        optimizer = torch.optim.SGD(trainable(model), lr=1.0)
        for _ in range(2):
            update(model, optimizer, rollouts(), [1.0, -1.0] * 3, probes, model if with_reference else None)
        weights.append({n: p.detach().full_tensor() for n, p in model.named_parameters() if ".lora_" in n})
    assert all(weights[1][n].abs().max() > 0 for n in weights[1] if ".lora_B." in n), "no adapter trained"
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"the reference's pass changed {name}"


def test_lora_with_a_module_trained_in_full_gets_a_frozen_copy_of_the_base(base_dir):
    """With --lora-setting train=lm_head the head trains too: with the adapters off it would still be trained."""
    model = lora_model(base_dir, "--lora-setting", "train=lm_head")
    assert not trains_adapters_only(model), "with a trained head, adapters_off would still run it trained"
    reference = load_sharded_model(str(base_dir), CPU, frozen=True)
    torch.testing.assert_close(scores(reference), scores(tiny_model()), msg="the copy is not the base")


@pytest.mark.parametrize("lora", [[], ["--lora-rank", "4"],
                                  ["--lora-rank", "4", "--lora-setting", "train=lm_head"]],
                         ids=["full", "adapters", "adapters-and-head"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_the_memory_plan_counts_a_reference_copy_exactly_where_training_loads_one(base_dir, lora, kl_coef):
    """train.py loads its reference with training.load_reference; the plan decides from the flags alone
    (memory_plan.run_settings). They must agree in every LoRA / KL combination: a copy under LoRA with
    the head trained in full was once loaded and not counted (about 28 GB more at 14B)."""
    from infra.memory_plan import plan, run_settings
    from infra.training import load_reference
    parser = argparse.ArgumentParser()
    add_lora_flags(parser)
    flags = parser.parse_args(lora)
    flags.__dict__.update(kl_coef=kl_coef, micro_batch_tokens=512, max_prompt=100, max_response=400,
                          problems_per_step=2, rollouts_per_problem=2)
    model = load_sharded_model(str(base_dir), CPU, lora=lora_settings(flags)).train()
    reference = load_reference(model, str(base_dir), CPU) if kl_coef else None
    loads_a_copy = reference is not None and reference is not model
    settings = run_settings(flags)
    counted = plan(tiny_model().config, 1, 10, **settings).phases["training"]
    plans_a_copy = "reference: frozen bf16 weights" in counted
    assert plans_a_copy == loads_a_copy, f"the plan counts a copy: {plans_a_copy}, train.py loads one: {loads_a_copy}"
    adapters_alone = lora == ["--lora-rank", "4"]
    assert loads_a_copy == (kl_coef > 0 and not adapters_alone), "a copy: with the penalty, unless adapters alone train"
