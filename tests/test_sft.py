"""sft.py: the loss counts assistant tokens only, any split of a step gives the
same update, FSDP2 on two ranks matches one process, bad input fails clearly."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sft  # noqa: E402
from conftest import torchrun  # noqa: E402
from conversation import USER_PREFIX, render_messages, render_tool_call  # noqa: E402
from infra.batch import plan_micro_batches  # noqa: E402


def make_conversation(a, b, with_tool=True):
    messages = [{"role": "system", "content": "Solve it."},
                {"role": "user", "content": f"What is {a} * {b}?"}]
    if with_tool:
        messages += [{"role": "assistant", "content": "Let me compute.</reason>",
                      "tool_call": {"code": f"print({a} * {b})", "input": ""}},
                     {"role": "tool", "content": str(a * b)}]
    messages += [{"role": "assistant", "content": f"Done.</reason><answer>\\boxed{{{a * b}}}</answer>"}]
    return {"messages": messages}


def make_tokenizer(texts):
    """A byte-level BPE tokenizer with the ChatML specials, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny random Qwen2 model + tokenizer saved like a hub model, and a JSONL of conversations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    d = tmp_path_factory.mktemp("sft")
    rows = [make_conversation(17 + 31 * i, 3 + 7 * i, with_tool=i % 3 != 0) for i in range(11)]
    with open(d / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    texts = [json.dumps(r) + USER_PREFIX + render_tool_call("print(1)") + "<|im_start|>system\nuser\nassistant\n<reason>"
             "</reason><tool_response></tool_response>" for r in rows]
    tokenizer = make_tokenizer(texts)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(d / "model")
    tokenizer.save_pretrained(d / "model")
    return dict(dir=d, data=str(d / "sft.jsonl"), model_dir=str(d / "model"), model=model, tokenizer=tokenizer, rows=rows)


def rendered(world, i):
    ids, loss_mask = render_messages(world["tokenizer"], world["rows"][i]["messages"])
    return torch.tensor([ids]), torch.tensor([loss_mask])


# -----------------------------------------------------------------------------
# The loss

def test_loss_is_the_sum_over_assistant_tokens_only(world):
    input_ids, loss_mask = rendered(world, 1)  # (1, T)
    assert 0 < loss_mask.sum() < loss_mask.numel(), "render_messages should mask the prompt and the tool turn"
    logits = world["model"](input_ids=input_ids).logits.detach()  # (1, T, V)
    logp = torch.log_softmax(logits[0].float(), -1)
    by_hand = -sum(logp[t, input_ids[0, t + 1]] for t in range(input_ids.shape[1] - 1) if loss_mask[0, t + 1])
    sample = (input_ids[0].tolist(), loss_mask[0].tolist())
    got = sft.assistant_nll_sum(world["model"], [sample], world["tokenizer"].pad_token_id, "cpu").detach()
    assert torch.allclose(got, by_hand, atol=1e-4), "the loss must sum -log p over exactly the assistant tokens"


def test_masked_positions_get_no_gradient(world):
    model, pad_id = world["model"], world["tokenizer"].pad_token_id
    input_ids, loss_mask = rendered(world, 1)
    captured = []

    def keep_hidden(module, inputs, hidden):  # the final norm's output at t feeds only the prediction at t
        hidden.retain_grad()
        captured.append(hidden)

    hook = model.get_decoder().norm.register_forward_hook(keep_hidden)
    try:
        sft.assistant_nll_sum(model, [(input_ids[0].tolist(), loss_mask[0].tolist())], pad_id, "cpu").backward()
    finally:
        hook.remove()
        model.zero_grad()
    grad_norm_per_position = captured[0].grad[0, :-1].norm(dim=-1)  # position t predicts token t+1
    predicts_masked = loss_mask[0, 1:] == 0
    assert grad_norm_per_position[predicts_masked].max() == 0, "prompt/tool tokens leaked into the loss"
    assert (grad_norm_per_position[~predicts_masked] > 0).all(), "some assistant token got no gradient"


def test_padding_and_micro_batch_split_give_the_same_gradient(world):
    model, pad_id = world["model"], world["tokenizer"].pad_token_id
    samples = [render_messages(world["tokenizer"], world["rows"][i]["messages"]) for i in range(4)]
    n_loss_tokens = sum(sum(mask) for _, mask in samples)

    def grads(micro_batches):
        model.zero_grad()
        for mb in micro_batches:
            (sft.assistant_nll_sum(model, [samples[i] for i in mb], pad_id, "cpu") / n_loss_tokens).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads([[0, 1, 2, 3]]), grads([[0], [1, 2], [3]])):
        assert torch.allclose(a, b, atol=1e-5), "gradient depends on padding or on the micro-batch split"
    model.zero_grad()


def test_a_micro_batch_runs_its_tokens_and_no_padding(world):
    model, pad_id = world["model"], world["tokenizer"].pad_token_id
    samples = [render_messages(world["tokenizer"], world["rows"][i]["messages"]) for i in range(4)]
    assert len({len(ids) for ids, _ in samples}) > 1, "the rows must differ in length for padding to show"
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.shape[:2]))
    try:
        sft.assistant_nll_sum(model, samples, pad_id, "cpu")
    finally:
        hook.remove()
    assert [tuple(s) for s in seen] == [(1, sum(len(ids) for ids, _ in samples))], \
        "the rows must run back to back (packed), not padded to the longest"


def test_micro_batches_fit_the_budget_cover_every_sequence_and_balance_ranks():
    lengths = [5, 30, 12, 7, 30, 1, 19]
    (batches,) = plan_micro_batches(lengths, budget=40, world_size=1)
    assert sorted(i for mb in batches for i in mb) == list(range(len(lengths)))
    for mb in batches:
        assert len(mb) * max(lengths[i] for i in mb) <= 40, f"micro-batch {mb} is over the token budget"
    assert plan_micro_batches([10, 10, 10], budget=30, world_size=1) == [[[0, 1, 2]]]
    # two ranks, longest first to the lighter one (ties to rank 0): 30 | 30, 19 (49) | 12, 7 (49), 5 (54) | 1
    plan = plan_micro_batches(lengths, budget=40, world_size=2)
    assert [sorted(i for mb in p for i in mb) for p in plan] == [[0, 1, 6], [2, 3, 4, 5]]
    assert len(plan[0]) == len(plan[1]), "every rank must run as many passes"
    assert plan_micro_batches([8], budget=40, world_size=2) == [[[0]], [[]]], "a rank with nothing gets an empty pass"


def test_packed_micro_batches_count_tokens_not_padding_and_need_fewer_passes():
    lengths = [5, 30, 12, 7, 30, 1, 19, 9]
    (packed,) = plan_micro_batches(lengths, budget=40, world_size=1, packed=True)
    (padded,) = plan_micro_batches(lengths, budget=40, world_size=1)
    assert sorted(i for mb in packed for i in mb) == list(range(len(lengths))), "a sequence was lost"
    for mb in packed:
        assert sum(lengths[i] for i in mb) <= 40, f"packed micro-batch {mb} is over the token budget"
    # first fit, longest first: 30+9+1 | 30+7 | 19+12+5 (the 9 fills the first one's room, not a fourth)
    assert packed == [[1, 7, 5], [4, 3], [6, 2, 0]]
    assert len(packed) < len(padded), "packing must need fewer passes than padding here"
    assert plan_micro_batches([50, 3], budget=40, world_size=1, packed=True) == [[[0], [1]]], \
        "a sequence over the budget goes alone"

def test_lr_warms_up_linearly_then_decays_by_cosine():
    lr = lambda s: sft.lr_at(s, total_steps=100, warmup_steps=4, lr=1.0)  # noqa: E731
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(4) == pytest.approx(1.0) and lr(52) == pytest.approx(0.5) and lr(100) == pytest.approx(0.0)
    assert sft.lr_at(0, total_steps=3, warmup_steps=0, lr=1.0) == 1.0


# -----------------------------------------------------------------------------
# The script, in process (a process group of one)

def run_sft(world, out, *flags):
    return sft.main(["--model", world["model_dir"], "--data", world["data"], "--out-dir", str(out), "--lr", "1e-3",
                     "--batch-size", "4", "--max-len", "512", "--micro-batch-tokens", "512", "--grad-checkpointing", "0",
                     *flags])


def final_weights(out):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(out).state_dict()


def test_script_trains_logs_and_saves_a_loadable_checkpoint(world, tmp_path):
    run_sft(world, tmp_path / "a", "--epochs", "1")
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3], "11 conversations at 4 per step is 3 steps per epoch"
    assert rows[-1]["epoch"] == 1.0
    assert [r["tokens"] - r["tokens_run"] for r in rows] == [(n - 1) * r["shared_prefix"] for n, r in
                                                             zip([4, 4, 3], rows)], "the prefix runs once a step"
    assert sum(r["n_loss_tokens"] for r in rows) == sum(sum(render_messages(world["tokenizer"], r["messages"])[1])
                                                        for r in world["rows"]), "an epoch must see every assistant token once"
    assert json.load(open(tmp_path / "a" / "sft_config.json"))["batch_size"] == 4
    trained, init = final_weights(tmp_path / "a"), world["model"].state_dict()
    assert trained.keys() == init.keys()
    assert any(not torch.equal(trained[k], init[k]) for k in init), "training did not change the weights"
    # the split into micro-batches does not change the update (one sequence per forward pass here)
    run_sft(world, tmp_path / "b", "--epochs", "1", "--micro-batch-tokens", "230", "--max-len", "230")
    again = final_weights(tmp_path / "b")
    for k in trained:
        assert torch.allclose(trained[k], again[k], atol=1e-5), f"{k}: micro-batch split changed the update"


def test_lora_sft_trains_the_adapted_layers_alone_and_exports_a_plain_merged_model(world, tmp_path):
    run_sft(world, tmp_path / "lora", "--epochs", "1", "--lora-rank", "4", "--lora-setting", "targets=q_proj,v_proj")
    trained, init = final_weights(tmp_path / "lora"), world["model"].state_dict()
    assert trained.keys() == init.keys(), "the export must be the base model's names, adapters merged"
    changed = {k for k in init if not torch.equal(trained[k], init[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), \
        f"only the adapted layers may change (the base is frozen): {sorted(changed)[:4]}"
    rows = [json.loads(line) for line in open(tmp_path / "lora" / "metrics.jsonl")]
    assert rows[0]["lr"] == pytest.approx(1e-3 * 10), "LoRA's peak rate is --lr x --lora-lr-scale (10)"


def test_checkpoint_keeps_the_dtype_and_class_it_came_in(world, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(world["model_dir"], dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    world["tokenizer"].save_pretrained(tmp_path / "bf16")
    sft.main(["--model", str(tmp_path / "bf16"), "--data", world["data"], "--out-dir", str(tmp_path / "out"),
              "--max-steps", "1", "--max-len", "512", "--micro-batch-tokens", "512", "--grad-checkpointing", "0"])
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.dtype == torch.bfloat16, "config.json must name the dtype of the saved tensors (vLLM reads it)"
    assert config.architectures == ["Qwen2ForCausalLM"], "the FSDP wrapper class leaked into config.json"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_explicit_flags_beat_the_preset():
    args = sft.get_args(["--preset", "toy", "--lr", "0.5"])
    assert args.lr == 0.5 and args.data == sft.PRESETS["toy"]["data"]
    assert sft.get_args([]).lr == 5e-6 and sft.get_args([]).batch_size == 128


# -----------------------------------------------------------------------------
# Bad input

def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(make_conversation(2, 3)) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not a JSON object(.|\n)*HINT"):
        sft.load_conversations(str(path))
    path.write_text(json.dumps(make_conversation(2, 3)) + '\n{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        sft.load_conversations(str(path))


def test_empty_dataset_says_what_to_do(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"no conversations(.|\n)*---> HINT"):
        sft.load_conversations(str(path))
    with pytest.raises(FileNotFoundError, match=r"prepare_toy"):
        sft.load_conversations(str(tmp_path / "missing.jsonl"))


def test_too_long_conversation_says_what_to_do(world):
    conversations = sft.load_conversations(world["data"])
    with pytest.raises(ValueError, match=r"longer than --max-len 20 (.|\n)*---> HINT: pass --max-len \d+"):
        sft.tokenize_conversations(world["tokenizer"], conversations, world["data"], max_len=20)


def test_unrenderable_conversation_names_file_and_line(world, tmp_path):
    path = tmp_path / "roles.jsonl"
    path.write_text(json.dumps(make_conversation(2, 3)) + "\n" + json.dumps({"messages": [{"role": "tool", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"roles\.jsonl:2: cannot render"):
        sft.tokenize_conversations(world["tokenizer"], sft.load_conversations(str(path)), str(path), max_len=512)


# -----------------------------------------------------------------------------
# FSDP2 across two processes

@pytest.mark.slow
def test_two_rank_fsdp_matches_one_process(world, tmp_path):
    # 5 conversations per step: ranks get 3 and 2, and with one sequence per forward pass the
    # second rank runs an empty pass, so the uneven path is exercised too.
    flags = ["--model", world["model_dir"], "--data", world["data"], "--lr", "1e-3", "--batch-size", "5",
             "--epochs", "2", "--max-len", "230", "--micro-batch-tokens", "230", "--grad-checkpointing", "1"]
    cmd = [*torchrun(2), os.path.join(ROOT, "sft.py"), *flags, "--out-dir", str(tmp_path / "two")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sft.main([*flags, "--out-dir", str(tmp_path / "one")])
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl")] for run in ("one", "two")]
    assert len(losses[0]) == 6 and losses[0] == pytest.approx(losses[1], rel=1e-4), "per-step losses differ"
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), f"{k}: two-rank FSDP2 weights differ from one process"


# What a step of a CPU run does to the allocator: tensors of many sizes made and freed while small
# ones stay alive between them. glibc's thresholds are set to where its own adjustment takes them
# during a run (freed tensors stay on the heap), so that the test does not depend on when it does.
# Prints the resident MiB before and after sft.return_freed_pages.
FREED_TENSORS = """
import ctypes, sys, psutil, torch
sys.path.insert(0, {root!r})
import sft
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 64 * 2**20)  # M_MMAP_THRESHOLD: the 1-8 MiB tensors come from the heap
libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: free() does not trim the heap's top by itself
kept = []
for round in range(3):
    big = [torch.ones(2**18 * (1 + i % 8)) for i in range(40)]  # 1-8 MiB each, 180 MiB in all
    kept += [torch.ones(64) for _ in range(200)]  # small tensors that live on between the big ones
    del big
before = psutil.Process().memory_info().rss / 2**20
sft.return_freed_pages()
print(before, psutil.Process().memory_info().rss / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_the_pages_of_freed_tensors_go_back_to_the_system_after_a_step():
    out = subprocess.run([sys.executable, "-c", FREED_TENSORS.format(root=ROOT)], capture_output=True,
                         text=True, check=True).stdout.split()
    before, after = float(out[0]), float(out[1])
    assert before - after > 100, f"glibc kept the freed pages: resident {before:.0f} -> {after:.0f} MiB"
