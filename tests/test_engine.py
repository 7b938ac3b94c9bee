"""engine.py's decisions that only a GPU can show, tested on what they ask of vLLM.

vLLM's CPU build has no sleep mode, so the GPU cycle is checked against a stand-in that keeps
vllm 0.32's bookkeeping (level-1 sleep puts "weights" and "kv_cache" to sleep; wake_up(tags)
wakes those tags) and records every call the cycle makes."""
from types import SimpleNamespace

import pytest

from engine import kv_bytes_per_token, sleep, sync_weights, wake_for_rollout
from rollout import RolloutConfig, Trajectory, sampling_params


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
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("collective_rpc", "reload_weights", ["w"]),
                         ("reset_prefix_cache",), ("wake_up", ["kv_cache"])]
    assert not llm.executor.sleeping_tags


def test_a_rollout_without_a_sync_before_it_wakes_everything_and_an_awake_engine_nothing():
    llm = SleepyLLM()
    wake_for_rollout(llm)
    assert llm.calls == [], "an engine that is awake is not woken"
    sleep(llm)
    wake_for_rollout(llm)
    assert llm.calls[-1] == ("wake_up", ["kv_cache", "weights"])


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
    from engine import make_engine
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
    from engine import full_weights, sync_weights
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
