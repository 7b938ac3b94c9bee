"""infra/engine.py's decisions that only a GPU can show, tested on what they ask of vLLM.

vLLM's CPU build has no sleep mode, so the GPU cycle is checked against a stand-in that keeps
vllm 0.32's bookkeeping (sleep puts "weights" and "kv_cache" to sleep at levels 1 and 2; wake_up(tags)
wakes those tags) and records every call the cycle makes. What level 2 needs of the sync (that it
writes every parameter), the model runner GPUs get, the ranks' seeds and the sync's gather are checked
on the CPU (the gather under torchrun, slow)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import torchrun
from infra.engine import engine_seed, kv_bytes_per_token, sleep, sync_weights, wake_for_rollout
from rollout import RolloutConfig, Trajectory, sampling_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SleepyLLM:
    def __init__(self):
        self.calls, executor = [], SimpleNamespace(sleeping_tags=set())
        self.executor = executor
        model_config = SimpleNamespace(enable_sleep_mode=True)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config),
                                          engine_core=SimpleNamespace(engine_core=SimpleNamespace(
                                              model_executor=executor)))

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.executor.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.executor.sleeping_tags -= set(tags or self.executor.sleeping_tags)

    def collective_rpc(self, method, kwargs):
        self.calls.append(("collective_rpc", method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_the_sync_wakes_the_weights_only_and_the_rollout_the_kv_cache():
    llm = SleepyLLM()
    sleep(llm)                                       # after a rollout: the trainer gets the GPU
    sync_weights(llm, iter([("w", None)]))           # after training
    assert llm.executor.sleeping_tags == {"kv_cache"}, "the KV cache must stay freed through the sync"
    wake_for_rollout(llm)                            # before the next rollout
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("collective_rpc", "reload_weights", ["w"]),
                         ("reset_prefix_cache",), ("wake_up", ["kv_cache"])]
    assert not llm.executor.sleeping_tags


def test_a_rollout_without_a_sync_since_the_engine_slept_is_refused_and_an_awake_engine_not_woken():
    """Level 2 drops the weights: woken without a sync they would hold whatever the GPU memory held."""
    llm = SleepyLLM()
    wake_for_rollout(llm)
    assert llm.calls == [], "an engine that is awake is not woken"
    sleep(llm)
    with pytest.raises(RuntimeError, match="dropped(.|\n)*HINT: sync_weights"):
        wake_for_rollout(llm)
    assert llm.calls == [("sleep", 2)], "the dropped weights must not be woken for a rollout"


def test_turns_ask_for_the_finished_turn_only_and_no_text(toy_world):
    from transformers import AutoTokenizer
    from vllm.sampling_params import RequestOutputKind
    tok = AutoTokenizer.from_pretrained(toy_world / "init_model")
    params = sampling_params(Trajectory(index=0, response_ids=[1] * 10), RolloutConfig(max_response=100), tok)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY and params.detokenize is False
    assert params.max_tokens == 90 and params.logprobs == 0


def test_one_engine_seed_by_default_and_a_seed_per_turn_when_deterministic(toy_world):
    """vLLM 0.32 samples requests that carry their own seed one by one: only --deterministic pays that."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy_world / "init_model")
    traj = Trajectory(index=3, sample=1)
    assert sampling_params(traj, RolloutConfig(seed=7), tok).seed is None, "a seed per request by default"
    seeded = [sampling_params(traj, RolloutConfig(seed=7, deterministic=True), tok).seed for _ in range(2)]
    traj.num_turns = 1
    next_turn = sampling_params(traj, RolloutConfig(seed=7, deterministic=True), tok).seed
    assert seeded[0] == seeded[1] is not None and next_turn != seeded[0], "a seed of its own for every turn"


def test_a_multiprocess_engine_is_refused_before_anything_loads(monkeypatch, tmp_path):
    from infra.engine import make_engine
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1(.|\n)*HINT: unset it"):
        make_engine(str(tmp_path / "no-model-needed"), max_model_len=64)


@pytest.mark.slow
def test_an_engine_started_without_the_checkpoint_samples_like_one_that_read_it(toy_engine, blank_toy_engine,
                                                                              toy_sft_model, toy_world, sandbox):
    """train.py's engine starts with random weights (vLLM's dummy load format) and gets the trainer's at
    a sync before the first rollout: its rollouts must be those of an engine that read the checkpoint."""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    from infra.engine import full_weights, sync_weights
    from scheduler import rollout_lockstep
    tok = toy_engine.get_tokenizer()
    problems = [json.loads(x) for x in (toy_world / "test.jsonl").read_text().splitlines()[:4]]
    cfg = RolloutConfig(deterministic=True, max_response=256, seed=11)
    blank = blank_toy_engine
    before, _ = rollout_lockstep(blank.llm_engine, tok, sandbox, problems, 2, cfg)
    model = AutoModelForCausalLM.from_pretrained(toy_sft_model, dtype=torch.float32)
    sync_weights(blank, full_weights(model, torch.float32))
    synced, _ = rollout_lockstep(blank.llm_engine, tok, sandbox, problems, 2, cfg)
    read, _ = rollout_lockstep(toy_engine.llm_engine, tok, sandbox, problems, 2, cfg)
    assert [list(t.response_ids) for t in before] != [list(t.response_ids) for t in read], \
        "random weights sampled what the checkpoint does: this check could not fail"
    assert [list(t.response_ids) for t in synced] == [list(t.response_ids) for t in read], \
        "after the first sync the engine must sample exactly what one that read the checkpoint samples"


def test_kv_bytes_per_token_of_the_toy_model(toy_world):
    # 4 layers, 4 KV heads of 32, keys and values, fp32
    assert kv_bytes_per_token(str(toy_world / "init_model"), dtype_bytes=4) == 2 * 4 * 4 * 32 * 4


# -- the model runner, the ranks' seeds -----------------------------------------------------------

def test_gpus_run_the_model_runner_the_tests_run_unless_asked_for_the_other(monkeypatch, tmp_path):
    """vLLM 0.32 picks its Model Runner V2 wherever Triton is (every GPU) and V1 on CPUs, where every
    test runs: make_engine asks for V1, and VLLM_USE_V2_MODEL_RUNNER=1 still gets V2."""
    import vllm.config.vllm as vllm_config
    import vllm.envs as envs
    from vllm.config import VllmConfig
    from infra.engine import make_engine
    config = VllmConfig()
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)  # what vLLM finds on a GPU
    # (read the environment when asked, as before an engine's start-up, not the cache vLLM keeps after)
    monkeypatch.setattr(envs, "__getattr__", getattr(envs.__getattr__, "__wrapped__", envs.__getattr__))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert config.use_v2_model_runner, "left to itself vLLM runs V2 on a GPU: this check could not fail"
    for asked, v2 in ((None, False), ("1", True)):
        if asked:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", asked)
        with pytest.raises(OSError):  # (no model there: it stops at reading the config, after choosing)
            make_engine(str(tmp_path / "no-model-needed"), max_model_len=64)
        assert config.use_v2_model_runner is v2, f"VLLM_USE_V2_MODEL_RUNNER={asked}: V2 is {v2}"


def test_every_rank_has_an_engine_seed_of_its_own_and_rank_0_keeps_the_runs():
    seeds = [engine_seed(7, rank) for rank in range(64)]
    assert seeds[0] == 7, "a one-rank run samples as it did"
    assert len(set(seeds)) == 64, "two ranks with one engine seed draw the same noise for their k-th request"
    assert seeds == [engine_seed(7, rank) for rank in range(64)], "a rank's seed is the same every run"
    assert engine_seed(8, 1) != engine_seed(7, 1) and all(0 <= s < 2**32 for s in seeds)


@pytest.mark.slow
def test_two_ranks_engines_draw_different_samples_and_a_rank_draws_the_same_again(toy_engine):
    """Requests without a seed (train.py's default) draw their noise from the generators vLLM seeds with
    the engine seed at start-up (set_random_seed, which every rank's engine calls with its own seed):
    the same prompts on rank 0's and rank 1's engines must sample apart, rank 0's again the same."""
    from vllm import SamplingParams
    from vllm.utils.torch_utils import set_random_seed
    prompts = [f"What is {a} times {b}?" for a, b in [(12, 34), (56, 78), (91, 23), (45, 67)]]
    params = SamplingParams(temperature=1.0, max_tokens=24)

    def samples(rank):
        set_random_seed(engine_seed(0, rank))  # what rank `rank`'s engine does at its start
        toy_engine.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in toy_engine.generate(prompts, params, use_tqdm=False)]

    rank0, rank1, rank0_again = samples(0), samples(1), samples(0)
    assert rank0 == rank0_again, "one rank's engine seed must give the same samples again"
    assert rank0 != rank1, "two ranks sampled the same rollouts: one engine seed for every rank"


# -- what level-2 sleep needs of the sync ----------------------------------------------------------

@pytest.mark.slow
def test_a_sync_writes_every_engine_parameter_so_dropped_weights_lose_nothing(blank_toy_engine,
                                                                              toy_sft_model):
    """Level-2 sleep drops the engine's weights (on a GPU they wake as whatever the memory held) and keeps
    its buffers; the sync after it must write every parameter. Here each one is NaN before the sync."""
    import torch
    from transformers import AutoModelForCausalLM
    from infra.engine import full_weights
    executor = blank_toy_engine.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
    engine_model = worker.model_runner.model
    random_weights = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
    trainer = AutoModelForCausalLM.from_pretrained(toy_sft_model, dtype=torch.float32)
    try:
        with torch.no_grad():
            for p in engine_model.parameters():
                p.fill_(float("nan"))
        sync_weights(blank_toy_engine, full_weights(trainer, torch.float32))
        unwritten = [n for n, p in engine_model.named_parameters() if p.isnan().any()]
        assert not unwritten, f"the sync left {unwritten} as the sleep left them"
        embeddings = dict(engine_model.named_parameters())["model.embed_tokens.weight"]
        vocab = trainer.config.vocab_size  # (vLLM pads the vocabulary to a multiple of 64: zero rows)
        assert torch.equal(embeddings[:vocab], trainer.model.embed_tokens.weight), "the sync wrote others"
    finally:  # (the engine goes on with its random weights, as the other tests expect of it)
        with torch.no_grad():
            for n, p in engine_model.named_parameters():
                p.copy_(random_weights[n])
        blank_toy_engine.reset_prefix_cache()


# -- the sync's gather, under torchrun ------------------------------------------------------------

@pytest.mark.slow
def test_each_shard_cast_before_the_gather_gives_the_bits_of_casting_after_and_gathers_bf16(tmp_path):
    """Two ranks shard a model (a vocabulary of 1001 rows: uneven shards); full_weights must hand over
    exactly the bits of the gather-then-cast it replaced, and gather 2-byte tensors, not fp32."""
    cmd = [*torchrun(2), __file__, str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["names"] == r["state_dict"], "every parameter is handed over, once, in order"
        assert r["uneven"], "no parameter was sharded unevenly: the check would miss the padded gather"
        assert r["differ"] == [], f"rank {rank}: these differ from gathering in fp32, then casting"
        assert r["gathered"] and set(r["gathered"]) == {"torch.bfloat16"}, f"gathered in {r['gathered']}"


def _gather_rank_main(folder: str):
    """One rank of the test above (run by torchrun)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from infra.engine import full_weights
    from infra.training import init_distributed, shard_model
    rank, _, _, device = init_distributed()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = shard_model(Qwen3ForCausalLM(config), device)
    with torch.no_grad():  # (fp32 values with every mantissa bit set, not just the initialiser's)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    state = model.state_dict()
    before = {n: t.full_tensor().to(torch.bfloat16) for n, t in state.items()}  # the gather-then-cast

    class Gathers(TorchDispatchMode):
        dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_gather" in str(func):
                self.dtypes.append(str(args[0].dtype))
            return func(*args, **(kwargs or {}))

    with Gathers():
        sent = list(full_weights(model, torch.bfloat16))
    bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
    differ = [n for n, t in sent if t.dtype != torch.bfloat16 or not torch.equal(bits(t), bits(before[n]))]
    uneven = any(t.shape[0] % 2 for t in state.values())
    result = {"names": [n for n, _ in sent], "state_dict": list(state), "differ": differ, "uneven": uneven,
              "gathered": Gathers.dtypes}
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()  # no rank tears gloo down while the other may still be talking to it
    torch.distributed.destroy_process_group()


# -- the end of a run -----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_engine_shuts_down_and_leaves_the_process_group_to_the_trainer(tmp_path, toy_world):
    """vLLM 0.32's own shutdown of an engine destroys torch.distributed's default group (whenever the
    collector frees it): engine.shutdown frees the engine now and leaves the group, so train.py's ranks
    meet in a barrier and destroy it once. Then a second engine starts in the same process."""
    cmd = [sys.executable, __file__, str(tmp_path), "shutdown", str(toy_world / "init_model")]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "shutdown.json").read_text())
    assert result == {"group_after_shutdown": True, "barrier": "met", "group_at_the_end": False,
                      "second_engine": "started"}, result


def _shutdown_main(folder: str, model: str):
    """The process of the test above."""
    import gc
    import torch.distributed as dist
    from infra.engine import make_engine, shutdown
    from infra.training import cpu_group, init_distributed
    init_distributed()
    result = {}
    llm = make_engine(model, max_model_len=256, kv_cache_tokens=2048)
    shutdown(llm)
    del llm
    gc.collect()  # (what would have run vLLM's own shutdown)
    result["group_after_shutdown"] = dist.is_initialized()
    dist.barrier(group=cpu_group())
    result["barrier"] = "met"
    llm = make_engine(model, max_model_len=256, kv_cache_tokens=2048)
    result["second_engine"] = "started"
    shutdown(llm)
    dist.destroy_process_group()
    result["group_at_the_end"] = dist.is_initialized()
    with open(f"{folder}/shutdown.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[2:3] == ["shutdown"]:
        _shutdown_main(sys.argv[1], sys.argv[3])
    else:
        _gather_rank_main(sys.argv[1])
