"""infra/logprobs.py and infra/training.py: chunked log-probs (values, gradients, memory), the problem reader, and
loading a model on rank 0 only under torchrun (slow)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import torchrun
from infra.logprobs import SharedPrefix, right_pad, shared_prefix_length, token_logprobs
from rollout import read_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_model(vocab=8192, hidden=32, layers=1, tie=False, seed=0):
    """A small random Qwen3 whose vocabulary dwarfs everything else, so the logits are the largest tensor."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tie,
                         max_position_embeddings=4096)
    return Qwen3ForCausalLM(config)


def reference_logprobs(model, input_ids, temperature):
    """The unchunked computation: the whole (B, T, V) logits, then log-softmax."""
    logits = model(input_ids=input_ids).logits[:, :-1].float() / temperature      # (B, T-1, V)
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def test_chunked_logprobs_and_their_gradients_equal_the_whole_vocabulary_computation():
    model = random_model()
    input_ids = torch.randint(0, 8192, (2, 37))
    attention_mask = torch.ones_like(input_ids)
    weights = torch.rand(2, 36)  # a loss that weighs positions differently, so gradients differ by position

    def values_and_grads(compute):
        model.zero_grad()
        logp = compute()
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = values_and_grads(lambda: reference_logprobs(model, input_ids, 0.7))
    for chunk in (5, 36, 1000):  # chunks that do not divide the positions, one chunk, more than all
        got, got_grads = values_and_grads(lambda: token_logprobs(model, input_ids, attention_mask, 0.7, chunk))
        assert torch.allclose(got, want, atol=1e-5), f"chunk {chunk}: log-probs differ by {(got - want).abs().max()}"
        for a, b in zip(got_grads, want_grads):  # fp32 sums in another order: ~1e-6 of the largest entry
            assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-7, f"chunk {chunk}: gradients differ"


def test_a_shared_prefix_run_once_gives_the_log_probs_and_gradients_of_whole_rows():
    """Rows of different lengths (right-padded) that share 9 tokens, in two micro-batches: the prefix
    runs once, each micro-batch reads it, one backward sends its gradient through the prefix; the
    log-probs after the prefix and the summed gradients are those of running every row whole."""
    model = random_model(tie=True)
    torch.manual_seed(1)
    shared = torch.randint(0, 8192, (9,)).tolist()
    rows = [shared + torch.randint(0, 8192, (n,)).tolist() for n in (12, 3, 7, 1)]
    assert shared_prefix_length(rows) == 9
    assert shared_prefix_length([shared, shared + [5]]) == 8, "a row must keep a token after the prefix"
    weights = [torch.rand(len(row) - 1) for row in rows]  # a loss that weighs every position differently
    micro_batches = [[0, 2], [1, 3]]

    def run(shared_prefix: bool, recompute: bool = True):
        model.zero_grad()
        prefix = SharedPrefix(model, torch.tensor(shared)) if shared_prefix else None
        values = [None] * len(rows)
        for micro_batch in micro_batches:
            batch = [rows[i] for i in micro_batch]
            input_ids = right_pad(batch, 0)                                          # (B, T)
            attention_mask = right_pad([[1] * len(row) for row in batch], 0)          # (B, T)
            logp = token_logprobs(model, input_ids, attention_mask, 0.7, 5, prefix, recompute)  # (B, T-1)
            loss = 0.0
            for j, i in enumerate(micro_batch):  # positions from the prefix's last one: what losses count
                n = len(rows[i]) - 1
                values[i] = logp[j, 8:n].detach()
                loss = loss + (logp[j, 8:n] * weights[i][8:]).sum()
            loss.backward()
        if prefix is not None:
            prefix.backward()
        return values, [p.grad.clone() for p in model.parameters()]

    want, want_grads = run(shared_prefix=False)
    for recompute in (True, False):
        got, got_grads = run(shared_prefix=True, recompute=recompute)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5), f"log-probs differ by {(a - b).abs().max()}"
        for a, b in zip(got_grads, want_grads):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-7, "gradients differ"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_packed_rows_give_the_loss_and_gradients_of_padded_rows(shared_prefix, attention):
    """The policy loss of trajectory-shaped rows (different lengths, a masked tool span, advantages of
    both signs), padded as before and packed back to back, on a 2-layer fp32 model: the same log-probs,
    loss and gradients within float tolerance, with the prompts' shared prefix run once or not. A
    sequence that attended to the one before it, or whose positions ran on, would change them all."""
    from grpo_roc import policy_loss
    model = random_model(tie=True, layers=2)
    model.config._attn_implementation = attention
    torch.manual_seed(2)
    shared = torch.randint(0, 8192, (9,)).tolist()
    rows = [shared + torch.randint(0, 8192, (n,)).tolist() for n in (12, 3, 7, 1, 20)]
    input_ids = right_pad(rows, 0)                                                      # (B, T)
    attention_mask = right_pad([[1] * len(row) for row in rows], 0)                     # (B, T)
    loss_mask = attention_mask[:, 1:].clone()                                           # (B, T-1)
    loss_mask[:, :8] = 0  # the prompt
    loss_mask[4, 12:16] = 0  # a tool turn inside the longest response
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3])                              # (B,)
    old = token_logprobs(model, input_ids, attention_mask, 0.7).detach() - 0.1 * loss_mask  # (B, T-1)

    def run(packed):
        model.zero_grad()
        prefix = SharedPrefix(model, torch.tensor(shared)) if shared_prefix else None
        logp = token_logprobs(model, input_ids, attention_mask, 0.7, 5, prefix, packed=packed)  # (B, T-1)
        loss, _ = policy_loss(logp, old, advantages, loss_mask, int(loss_mask.sum()))
        loss.backward()
        if prefix is not None:
            prefix.backward()
        return logp.detach() * loss_mask, loss.detach(), [p.grad.clone() for p in model.parameters()]

    (want, want_loss, want_grads), (got, got_loss, got_grads) = run(packed=False), run(packed=True)
    assert got.shape == want.shape, "packed log-probs must come back in the padded layout"
    assert torch.allclose(got, want, atol=1e-5), f"packed log-probs differ by {(got - want).abs().max()}"
    assert torch.allclose(got_loss, want_loss, atol=1e-6), f"packed loss {got_loss} != padded {want_loss}"
    for a, b in zip(got_grads, want_grads):  # fp32 sums in another order: ~1e-6 of the largest entry
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-7, "packed gradients differ from padded ones"


def test_a_shared_prefix_is_refused_where_the_model_would_drop_its_cache():
    """transformers drops past_key_values under gradient checkpointing: the prefix would silently vanish."""
    model = random_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="gradient checkpointing(.|\n)*HINT"):
        SharedPrefix(model.train(), torch.tensor([1, 2, 3]))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_largest_tensor_grows_with_the_chunk_not_with_tokens_times_vocabulary():
    model, vocab, tokens, chunk = random_model(), 8192, 512, 64
    input_ids = torch.randint(0, vocab, (1, tokens))

    def largest(chunk_tokens, entropy=False):
        with LargestTensor() as mode:
            logp = token_logprobs(model, input_ids, torch.ones_like(input_ids), 1.0, chunk_tokens,
                                  entropy=entropy)
            (logp[0] if entropy else logp).sum().backward()
        model.zero_grad()
        return mode.largest

    whole = largest(tokens)
    assert whole >= (tokens - 1) * vocab, "the measurement must see the (T, V) logits when there is one chunk"
    for entropy in (False, True):  # the entropy's (chunk, V) temporaries are a chunk's too
        chunked = largest(chunk, entropy)
        assert chunked <= 2 * chunk * vocab, f"largest tensor {chunked:,} elements with {chunk}-token chunks"
        assert chunked < whole / 4


def test_problem_reader_checks_every_line_and_says_what_to_do(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "What is 1 + 1?", "answer": 2, "id": "a"}\n\n{"question": "x", "answer": "3"}\n')
    assert read_problems(str(path)) == [{"question": "What is 1 + 1?", "answer": "2", "id": "a"},
                                        {"question": "x", "answer": "3"}]
    for bad in ['{"question": "x"}', '{"answer": "1"}', "{not json", '["x", "1"]', '{"question": " ", "answer": "1"}']:
        path.write_text('{"question": "ok", "answer": "1"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=r"p\.jsonl:2: a problem needs a question and an answer(.|\n)*HINT"):
            read_problems(str(path))
    with pytest.raises(FileNotFoundError, match="HINT: data/prepare_rl.py writes data/rl.jsonl"):
        read_problems(str(tmp_path / "missing.jsonl"))


# -- loading under torchrun ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-embeddings"])
def test_only_rank_0_holds_the_full_model_and_both_ranks_end_with_its_weights(tmp_path, tie):
    """Two ranks on the CPU: rank 1 builds on the meta device and never holds a full copy (its peak
    RSS grows by its half of the shards and a tensor in flight, where a full copy would add 1.5 models),
    and the gathered weights equal the checkpoint's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=tie)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "model")  # ~70M parameters, ~280 MB in fp32
    cmd = [*torchrun(2), __file__, str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    model_mb = ranks[0]["model_mb"]
    assert ranks[0]["grew_mb"] > 0.9 * model_mb, "rank 0 reads the full model: the measurement must show it"
    assert ranks[1]["grew_mb"] < 0.8 * model_mb, \
        f"rank 1's peak RSS grew by {ranks[1]['grew_mb']:.0f} MB for a {model_mb:.0f} MB model: a full copy"
    assert all(r["max_diff"] == 0.0 for r in ranks), "the sharded weights must equal the checkpoint's exactly"
    assert all(r["timeouts_minutes"] == [30.0, 240.0] for r in ranks), \
        "the training's collectives fail the job in half an hour, the waits for rollouts in four hours"
    assert [r["shared"] for r in ranks] == ["ok", "ok"], "one folder seen by both ranks is shared"
    assert all("ranks [1] do not see" in r["not_shared"] and "HINT" in r["not_shared"] for r in ranks), \
        "when the ranks' folders differ (as on nodes without a shared filesystem) every rank must stop, saying so"


@pytest.mark.slow
def test_a_hung_collective_fails_in_the_timeout_while_a_straggler_is_waited_for(tmp_path):
    """init_distributed(timeout_minutes) bounds the training's collectives (NCCL's on GPUs, gloo's here),
    not the gloo group's waits for other ranks' rollouts: with 1.2 seconds, rank 1 joins a barrier on the
    waits group 3 seconds late and is waited for, then skips an all-reduce, which fails on rank 0."""
    cmd = [*torchrun(2), __file__, str(tmp_path), "timeouts"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=300)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["straggler"] == "waited", "the waits group must outwait the training's timeout"
    assert result["hung"].startswith("failed") and result["seconds"] < 30, \
        f"a collective one rank skips must fail in its timeout: {result}\n{proc.stderr[-2000:]}"


def _timeouts_rank_main(folder: str):
    """One rank of the test above (run by torchrun)."""
    import time
    from infra.training import cpu_group, init_distributed
    rank = init_distributed(timeout_minutes=0.02)[0]
    result = {}
    if rank == 1:
        time.sleep(3)
    torch.distributed.barrier(group=cpu_group())
    result["straggler"] = "waited"
    if rank == 0:
        start = time.monotonic()
        try:
            torch.distributed.all_reduce(torch.ones(1))
            result["hung"] = "returned"
        except RuntimeError as e:
            result["hung"] = f"failed: {e}"[:300]
        result["seconds"] = time.monotonic() - start
        with open(f"{folder}/rank0.json", "w") as f:
            json.dump(result, f)
    else:
        time.sleep(5)  # (alive and silent while rank 0 waits)
    os._exit(0)  # (the group is broken: no teardown to wait for)


@pytest.mark.slow
def test_a_rank_whose_sandbox_cannot_start_stops_the_whole_job(tmp_path):
    """Rank 1's sandbox workers die at start (their Python is /bin/false); rank 0 goes on and waits for
    rank 1 on the gloo group, as train.py's ranks wait for each other's rollouts. The job must end, with
    the sandbox's message, instead of rank 0 waiting for the process group's four-hour timeout."""
    import time
    cmd = [*torchrun(2), __file__, str(tmp_path), "sandbox"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "workers did not start" in proc.stderr and "HINT" in proc.stderr
    assert time.monotonic() - start < 300, "the other rank was left waiting"


def _sandbox_rank_main():
    """One rank of the test above (run by torchrun)."""
    from sandbox import Sandbox
    from infra.training import cpu_group, init_distributed
    rank = init_distributed()[0]
    if rank == 1:
        sys.executable = "/bin/false"
    with Sandbox(workers=1, timeout=2.0):
        torch.distributed.barrier(group=cpu_group())


def _rank_main(folder: str):
    """One rank of the test above (run by torchrun)."""
    import resource
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM  # noqa: F401  (imported before measuring: ~100 MB)
    from infra.training import check_shared_dir, cpu_group, init_distributed, load_sharded_model
    rank, _, _, device = init_distributed()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = load_sharded_model(f"{folder}/model", device)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    saved = load_file(f"{folder}/model/model.safetensors")
    max_diff = max((full[k] - saved[k]).abs().max().item() for k in saved)
    model_mb = sum(t.numel() * 4 for t in saved.values()) / 2**20
    backend = torch.device("cpu")
    timeouts = [g._get_backend(backend).options._timeout.total_seconds() / 60
                for g in (torch.distributed.distributed_c10d._get_default_group(), cpu_group())]
    result = {"grew_mb": grew, "model_mb": model_mb, "max_diff": max_diff, "timeouts_minutes": timeouts}
    check_shared_dir(f"{folder}/out")
    result["shared"] = "ok"
    try:  # each rank its own folder under one name: what nodes without a shared filesystem see
        check_shared_dir(f"{folder}/out-{rank}")
    except SystemExit as e:
        result["not_shared"] = str(e)
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()  # no rank tears gloo down while the other may still be talking to it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:] == ["sandbox"]:
        _sandbox_rank_main()
    elif sys.argv[2:] == ["timeouts"]:
        _timeouts_rank_main(sys.argv[1])
    else:
        _rank_main(sys.argv[1])


# -- what the step leaves behind -----------------------------------------------------------------

class TensorsMade(TorchDispatchMode):
    """Weak references to every tensor an operation produces with at least `numel` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.refs = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.refs.append(weakref.ref(t))
        return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_the_entropy_the_update_logs_is_the_exact_entropy_on_every_path(shared_prefix, packed):
    """Each position's entropy of softmax(logits / T), from the chunked head (chunks of 5 positions),
    padded or packed, with the prompts' shared prefix run once or not, against the whole (B, T, V)
    logits; no gradient, so the log-probs' gradient is the one without it."""
    model = random_model(tie=True, layers=2)
    torch.manual_seed(3)
    shared = torch.randint(0, 8192, (9,)).tolist()
    rows = [shared + torch.randint(0, 8192, (n,)).tolist() for n in (12, 3, 7, 20)]
    input_ids = right_pad(rows, 0)                                                      # (B, T)
    attention_mask = right_pad([[1] * len(row) for row in rows], 0)                     # (B, T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / 0.7
    exact = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)        # (B, T-1)
    scored = attention_mask[:, 1:].bool().clone()                                       # (B, T-1)
    scored[:, :8] = False  # a prefix run once scores none of its own tokens
    for recompute in (True, False):
        prefix = SharedPrefix(model, torch.tensor(shared)) if shared_prefix else None
        logp, entropy = token_logprobs(model, input_ids, attention_mask, 0.7, 5, prefix, recompute,
                                       packed=packed, entropy=True)                     # (B, T-1) each
        assert not entropy.requires_grad and logp.requires_grad
        assert torch.allclose(entropy[scored], exact[scored], atol=1e-4), \
            f"entropy differs by {(entropy[scored] - exact[scored]).abs().max()}"
        if packed:  # (padded rows score their padding too, as their log-probs do: the loss mask drops it)
            assert (entropy[~attention_mask[:, 1:].bool()] == 0).all(), "packed padding has no entropy"
        alone = token_logprobs(model, input_ids, attention_mask, 0.7, 5, prefix, recompute, packed=packed)
        assert torch.equal(logp, alone), "asking for the entropy must not change the log-probs"


@pytest.fixture
def sharded_model():
    """A model sharded by FSDP2 in a process group of one, as train.py runs it on one rank."""
    from infra.training import init_distributed, shard_model
    init_distributed()
    return shard_model(random_model(layers=2), torch.device("cpu"))


def test_no_tensor_of_a_training_step_outlives_it(sharded_model):
    """Logits, log-probs and their gradients must be gone before the weight sync and the next rollout."""
    import gc
    from grpo_roc import policy_loss
    vocab, tokens, chunk = 8192, 256, 32

    def step(model, input_ids):  # what train.py's optimizer_step does with one micro-batch
        logp = token_logprobs(model, input_ids, torch.ones_like(input_ids), 0.7, chunk)  # (1, T-1)
        mask = torch.ones_like(logp)
        loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, mask.sum())
        loss.backward()
        model.zero_grad(set_to_none=True)  # (after the optimizer's step)
        return loss.item()

    with TensorsMade(numel=chunk * vocab) as made:
        step(sharded_model, torch.randint(0, vocab, (1, tokens)))
    gc.collect()
    assert made.refs, "the step must have made chunk x vocabulary tensors for this check to mean anything"
    # (FSDP2 keeps its gather buffers as tensor objects whose storage it frees: they hold no memory)
    alive = [r() for r in made.refs if r() is not None and r().untyped_storage().size() > 0]
    assert not alive, f"{len(alive)} tensors of the step still hold memory, e.g. {tuple(alive[0].shape)}"


def test_the_engine_gets_the_weights_one_parameter_at_a_time(sharded_model):
    import gc
    from infra.engine import full_weights
    names = list(sharded_model.state_dict())
    previous = None
    for count, (name, tensor) in enumerate(full_weights(sharded_model, torch.bfloat16), 1):
        gc.collect()
        assert previous is None or previous() is None, "the last parameter handed over is still held"
        assert tensor.dtype == torch.bfloat16 and not hasattr(tensor, "full_tensor"), "a full bf16 tensor"
        previous = __import__("weakref").ref(tensor)
        del tensor
    assert count == len(names)


# -----------------------------------------------------------------------------
# Checkpoints: save, keep, load with or without the optimizer, find, and the logs rewound at resume

def adam_steps(optimizer) -> set[int]:
    """The step counts of an AdamW's per-parameter states (empty set: a fresh optimizer)."""
    return {int(s["step"]) for s in optimizer.state.values()}


def trained_steps(model, optimizer, n):
    for _ in range(n):
        ids = torch.randint(0, 8192, (1, 16))
        token_logprobs(model, ids, torch.ones_like(ids)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_a_fresh_optimizer_stays_fresh_and_a_continued_one_continues(sharded_model, tmp_path):
    from infra.training import load_checkpoint, save_checkpoint, shard_model
    optimizer = torch.optim.AdamW(sharded_model.parameters(), lr=1e-3)
    trained_steps(sharded_model, optimizer, 4)
    save_checkpoint(sharded_model, optimizer, str(tmp_path), 4, {"position": 7})
    saved = {k: v.clone() for k, v in sharded_model.state_dict().items()}

    model = shard_model(random_model(layers=2, seed=1), torch.device("cpu"))
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = load_checkpoint(model, fresh, str(tmp_path / "step_4"), with_optimizer=False)
    assert meta["step"] == 4 and meta["position"] == 7
    assert all(torch.equal(v.full_tensor(), saved[k].full_tensor()) for k, v in model.state_dict().items())
    assert adam_steps(fresh) == set(), "a fresh optimizer was filled in with the saved one's state"
    trained_steps(model, fresh, 1)
    assert adam_steps(fresh) == {1}, "--reset-optimizer: the first step of the new stage must be AdamW's first"

    continued = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_checkpoint(model, continued, str(tmp_path / "step_4"), with_optimizer=True)
    trained_steps(model, continued, 1)
    assert adam_steps(continued) == {5}, "a continued optimizer must go on from the saved step count"


def test_checkpoints_are_kept_newest_first_and_a_missing_one_says_what_to_do(sharded_model, tmp_path):
    from infra.training import complete_checkpoints, find_checkpoint, save_checkpoint
    optimizer = torch.optim.AdamW(sharded_model.parameters())
    for step in (1, 2, 3):
        save_checkpoint(sharded_model, optimizer, str(tmp_path / "ckpt"), step, {}, keep=2)
    assert [os.path.basename(c) for c in complete_checkpoints(str(tmp_path / "ckpt"))] == ["step_2", "step_3"]
    assert find_checkpoint(str(tmp_path / "ckpt")).endswith("step_3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint(.|\n)*HINT"):
        find_checkpoint(str(tmp_path / "empty"))


def test_resuming_drops_what_was_logged_after_the_checkpoint(tmp_path):
    from infra.training import rewind_logs
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "samples.txt").write_text("".join(f"===== step {s} problem 0 sample 0 reward 1.0 (answer) =====\n"
                                                  f"text of {s}\n===== step {s} problem 1 sample 0 reward 0.0 "
                                                  f"(length) =====\nmore\n" for s in (1, 2, 3)))
    rewind_logs(str(tmp_path), 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    samples = (tmp_path / "samples.txt").read_text()
    assert samples.count("===== step") == 4 and "step 3" not in samples and "text of 2\n" in samples


def test_offloading_the_trainer_around_each_rollout_trains_bit_for_bit_the_same():
    """offload.trainer_offloaded moves the fp32 shards and AdamW moments out and back around every
    rollout (on a CPU: copies within host memory, the same code path as to pinned memory and back)."""
    from infra.offload import trainer_offloaded
    from infra.training import init_distributed, shard_model
    init_distributed()
    runs = []
    for offload in (False, True):
        model = shard_model(random_model(layers=2, seed=3), torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = list(model.parameters())
        torch.manual_seed(0)
        for _ in range(3):
            with trainer_offloaded(model, optimizer, offload):
                # (the rollout runs here)
                moved = [p.to_local().untyped_storage().nbytes() for p in model.parameters()]
            trained_steps(model, optimizer, 1)
        assert list(model.parameters()) == params, "the optimizer must still hold the model's parameters"
        runs.append(({k: v.full_tensor() for k, v in model.state_dict().items()}, optimizer.state_dict()))
    assert moved == [0] * len(params), "the weights' memory on the device was not freed for the engine"
    (weights, optim), (weights_offloaded, optim_offloaded) = runs
    assert all(torch.equal(weights[k], weights_offloaded[k]) for k in weights), "offloading changed training"
    for state, state_offloaded in zip(optim["state"].values(), optim_offloaded["state"].values()):
        assert all(torch.equal(state[k].full_tensor() if hasattr(state[k], "full_tensor") else state[k],
                               state_offloaded[k].full_tensor() if hasattr(state_offloaded[k], "full_tensor")
                               else state_offloaded[k]) for k in state), "the moments differ"


def test_the_host_buffers_are_allocated_once_at_the_exact_size_and_reused_every_round():
    """The first offload (at start-up, before AdamW has moments) already allocates the moments' host
    buffers; every later round copies into the same buffers (a fresh pinned page costs 20x a reused
    one on a GPU), and they hold exactly the fp32 weights and two moments: memory_plan's 12P/N."""
    from infra.offload import trainer_offloaded
    from infra.training import init_distributed, shard_model
    init_distributed()
    model = shard_model(random_model(layers=2, seed=3), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n_params = sum(p.numel() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    rounds = []
    for _ in range(3):
        with trainer_offloaded(model, optimizer) as host:
            rounds.append(sorted(buffer.data_ptr() for buffer in host))
            held = sum(buffer.numel() for buffer in host)
        trained_steps(model, optimizer, 1)
    assert held == 12 * n_params + buffer_bytes, f"host buffers of {held} bytes, not the plan's 12P"
    assert rounds[0] == rounds[1] == rounds[2], "host buffers were allocated again after the first offload"


def test_a_frozen_reference_model_goes_to_the_host_with_the_trainer_and_comes_back_unchanged():
    """trainer_offloaded(frozen=...) frees a frozen bf16 copy of the weights on the device for the block,
    holds it in host buffers of its exact size beside the trainer's 12P, and puts back the same
    tensors with the same values; the trainer trains as without it."""
    from infra.offload import trainer_offloaded
    from infra.training import init_distributed, shard_model
    init_distributed()
    model = shard_model(random_model(layers=2, seed=3), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = random_model(layers=2, seed=3).to(torch.bfloat16).requires_grad_(False)
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    params = list(reference.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    trainer_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    frozen_bytes = sum(t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()])
    for _ in range(2):
        with trainer_offloaded(model, optimizer, frozen=[reference]) as host:
            held = sum(buffer.numel() for buffer in host)
            moved = [p.untyped_storage().nbytes() for p in reference.parameters()]
        trained_steps(model, optimizer, 1)
    assert moved == [0] * len(params), "the reference's memory on the device was not freed for the engine"
    assert held == 12 * n_params + trainer_buffers + frozen_bytes, f"{held} bytes on the host"
    assert list(reference.parameters()) == params, "the reference's parameters must keep their identity"
    assert all(torch.equal(p, before[name]) for name, p in reference.named_parameters()), \
        "the reference's weights changed on their way to the host and back"


def test_expandable_segments_are_on_for_training_and_off_while_the_engine_is_awake():
    """load_sharded_model turns them on, trainer_offloaded off for its block (the engine wakes in it)
    and on after, offloading or not; the allocator's other settings stay (torch resets what a
    settings string leaves out)."""
    from infra.offload import trainer_offloaded
    from infra.training import expandable_segments, init_distributed, shard_model
    before = torch._C._accelerator_getAllocatorSettings()
    init_distributed()
    model = shard_model(random_model(layers=1), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:512")
        expandable_segments(True)
        settings = torch._C._accelerator_getAllocatorSettings
        for offload in (False, True):
            assert settings() == "max_split_size_mb:512,expandable_segments:True"
            with trainer_offloaded(model, optimizer, offload):
                assert settings() == "max_split_size_mb:512,expandable_segments:False", \
                    "expandable segments on while the engine wakes"
        assert torch._C._accelerator_getAllocatorSettings().endswith("expandable_segments:True"), \
            "expandable segments must come back on for training"
    finally:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")


# -----------------------------------------------------------------------------
# A GPU build of torch that cannot start on the machine's GPUs

def test_a_gpu_build_that_cannot_start_stops_naming_the_driver_and_a_cpu_machine_runs_on(monkeypatch):
    """A driver older than the build's CUDA makes torch.cuda.is_available() false with only a warning
    (as on this CPU build): faked here are the build's version and the GPUs NVML (or amdsmi) counts."""
    from infra.training import init_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 8)  # the driver is there, and 8 GPUs
    needs_r580 = r"CUDA 13\.0, which needs an NVIDIA driver R580(.|\n)*HINT: `nvidia-smi`"
    with pytest.raises(SystemExit, match=needs_r580):
        init_distributed()
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # no NVIDIA driver: a CPU machine
    assert init_distributed()[3] == torch.device("cpu"), "a CUDA build on a machine without GPUs runs on CPUs"
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "7.14.0")
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 8)
    with pytest.raises(SystemExit, match=r"ROCm 7\.14\.0(.|\n)*HINT: `amd-smi version`"):
        init_distributed()
