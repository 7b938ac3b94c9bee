"""engine.py's decisions that only a GPU can show, tested on what they ask of vLLM.

vLLM's CPU build has no sleep mode, so the GPU cycle is checked against a stand-in that keeps
vllm 0.32's bookkeeping (level-1 sleep puts "weights" and "kv_cache" to sleep; wake_up(tags)
wakes those tags) and records every call the cycle makes."""
from types import SimpleNamespace

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


def test_kv_bytes_per_token_of_the_toy_model(toy_world):
    # 4 layers, 4 KV heads of 32, keys and values, fp32
    assert kv_bytes_per_token(str(toy_world / "init_model"), dtype_bytes=4) == 2 * 4 * 4 * 32 * 4
