"""The agent loop: the turn state machine (fast, scripted turns) and real vLLM rollouts (slow)."""
import argparse
import json

import pytest

import rollout
from conversation import IM_END, TOOLS, Tool, ToolCall, render_tool_call, render_tool_turn
from rollout import (RolloutConfig, Trajectory, add_rollout_flags, add_tool_turn, end_turn, rollout_config, score,
                     start_trajectories)
from sandbox import SANDBOX_FAILURE
from sandbox import ExecResult


@pytest.fixture(scope="module")
def tok(toy_world):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(toy_world / "init_model")


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def turn(tok, traj, text, cfg, logprob=-0.5):
    """Feed one scripted assistant turn through the state machine."""
    t_ids = ids(tok, text)
    return end_turn(traj, t_ids, [logprob] * len(t_ids), tok, cfg)


def fresh(tok):
    return start_trajectories(tok, [{"question": "What is 12 * 34?", "answer": "408"}], 1)[0]


CALL = "I will compute it.</reason>" + render_tool_call("print(12 * 34)") + IM_END
ANSWER = "The tool says 408.</reason>\n<answer>\\boxed{408}</answer>" + IM_END


# -- the state machine, with scripted turns ---------------------------------------

def test_tool_call_turn_returns_the_call_and_tool_turn_is_masked_out(tok):
    cfg, traj = RolloutConfig(), fresh(tok)
    assert turn(tok, traj, CALL, cfg) == ToolCall("print(12 * 34)", "")
    n_sampled = len(traj.response_ids)
    add_tool_turn(traj, ExecResult("ok", "408\n", "", 0.01, False), tok, cfg)
    tool_ids = ids(tok, render_tool_turn("408"))
    assert traj.response_ids[n_sampled:] == tool_ids, "tool turn must be the rendered user turn, tokenized alone"
    assert traj.loss_mask == [1] * n_sampled + [0] * len(tool_ids), "only sampled tokens may carry loss"
    assert traj.logprobs[n_sampled:] == [0.0] * len(tool_ids)
    assert traj.tool_calls == 1 and traj.num_tool_failures == 0 and not traj.finish_reason


def test_answer_turn_finishes_with_answer_and_counts_answers(tok):
    cfg, traj = RolloutConfig(), fresh(tok)
    turn(tok, traj, CALL, cfg)
    add_tool_turn(traj, ExecResult("ok", "408\n", "", 0.01, False), tok, cfg)
    assert turn(tok, traj, ANSWER, cfg) is None
    assert (traj.finish_reason, traj.answer, traj.num_answers, traj.num_turns) == ("answer", "408", 1, 2)
    assert traj.response_ids[-1] == tok.convert_tokens_to_ids(IM_END), "the sampled <|im_end|> stays in"
    assert traj.loss_mask[-1] == 1


def test_every_answer_block_is_counted_and_the_last_answer_counts(tok):
    traj = fresh(tok)
    turn(tok, traj, "</reason><answer>\\boxed{1}</answer><answer>\\boxed{408}</answer>" + IM_END, RolloutConfig())
    assert (traj.num_answers, traj.answer) == (2, "408"), "GRPO-RoC's format penalty needs every <answer> counted"


def test_answer_tags_that_do_not_pair_up_are_marked_for_the_format_penalty(tok):
    traj = fresh(tok)  # what RL taught SmolLM2-135M once (docs/words.md): the answer, then a run of </answer>
    text = "</reason><answer>\\boxed{12}</answer></answer></answer></tool_call>"
    turn(tok, traj, text + IM_END, RolloutConfig())
    assert (traj.answer, traj.num_answers, traj.answer_tags_match) == ("12", 1, False)
    clean = fresh(tok)
    turn(tok, clean, "</reason><answer>\\boxed{12}</answer>" + IM_END, RolloutConfig())
    assert clean.answer_tags_match


def test_turn_without_call_or_answer_is_no_tool_call(tok):
    traj = fresh(tok)
    assert turn(tok, traj, "I do not know.</reason>" + IM_END, RolloutConfig()) is None
    assert traj.finish_reason == "no_tool_call" and traj.answer is None


def test_turn_cut_by_the_budget_is_length(tok):
    traj = fresh(tok)
    assert turn(tok, traj, "I will compute it and then", RolloutConfig()) is None  # no <|im_end|>
    assert traj.finish_reason == "length"


def test_tool_call_on_the_last_allowed_turn_is_max_turns(tok):
    traj = fresh(tok)
    assert turn(tok, traj, CALL, RolloutConfig(max_turns=1)) is None
    assert traj.finish_reason == "max_turns" and traj.tool_calls == 0


def test_tool_turn_that_does_not_fit_ends_with_length_and_is_not_appended(tok):
    cfg, traj = RolloutConfig(), fresh(tok)
    turn(tok, traj, CALL, cfg)
    cfg.max_response = len(traj.response_ids) + 3
    before = list(traj.response_ids)
    add_tool_turn(traj, ExecResult("ok", "408\n", "", 0.01, False), tok, cfg)
    assert traj.finish_reason == "length" and traj.response_ids == before


def test_malformed_call_is_a_parse_failure_and_the_model_sees_the_error(tok):
    cfg, traj = RolloutConfig(), fresh(tok)
    call = turn(tok, traj, "Compute.</reason>\n<tool_call>\n{\"name\": oops}\n</tool_call>" + IM_END, cfg)
    err = call.error
    assert err.startswith("Failed to decode tool call") and call.code == ""
    add_tool_turn(traj, err, tok, cfg)
    assert traj.tool_failures == {"parse": 1} and traj.tool_calls == 1
    assert err in tok.decode(traj.response_ids), "the parse error must come back as the tool output"


@pytest.mark.parametrize("status", ["error", "timeout", "oom"])
def test_failed_execution_is_counted_by_kind(tok, status):
    cfg, traj = RolloutConfig(), fresh(tok)
    turn(tok, traj, CALL, cfg)
    add_tool_turn(traj, ExecResult(status, "", "boom", 1.0, False), tok, cfg)
    assert traj.tool_failures == {status: 1}


def test_truncated_trajectory_gets_reward_zero_even_with_a_right_answer(tok):
    cfg = RolloutConfig()
    good, cut = fresh(tok), fresh(tok)
    turn(tok, good, ANSWER, cfg)
    turn(tok, cut, "Done.</reason>\n<answer>\\boxed{408}</answer> and more", cfg)
    score([good, cut], sandbox=None, cfg=RolloutConfig())
    assert (good.reward, cut.reward) == (1.0, 0.0) and cut.finish_reason == "length"
    assert good.correct and cut.correct, "grading says whether the answer is right; the reward adds the rest"


def test_the_reward_sees_the_runs_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(rollout, "reward", lambda t, cfg: seen.append(cfg) or cfg.max_response / 1000)
    traj, cfg = Trajectory(index=0, answer="7", gold="7", finish_reason="answer"), RolloutConfig(max_response=123)
    score([traj], sandbox=None, cfg=cfg)
    assert seen == [cfg] and traj.reward == 0.123, "score must hand the run's RolloutConfig to the reward"
    assert traj.correct, "grading stays apart from the reward"


def test_a_run_given_two_tools_offers_both_and_parses_a_call_to_the_second(tok, monkeypatch):
    spec = {"type": "function", "function": {"name": "double", "parameters": {"type": "object", "properties": {
        "n": {"type": "string"}}, "required": ["n"]}}}
    monkeypatch.setitem(TOOLS, "double", Tool(spec, lambda a: (f"print(2 * {a['n']})", "")))
    parser = argparse.ArgumentParser()
    add_rollout_flags(parser)
    cfg = rollout_config(parser.parse_args(["--tools", "python", "double"]))
    assert cfg.tools == ("python", "double") and RolloutConfig().tools == ("python",)
    traj = start_trajectories(tok, [{"question": "What is 2 * 21?", "answer": "42"}], 1, tools=cfg.tools)[0]
    plain = start_trajectories(tok, [{"question": "What is 2 * 21?", "answer": "42"}], 1)[0]
    assert '"double"' in tok.decode(traj.prompt_ids) and '"double"' not in tok.decode(plain.prompt_ids)
    text = 'Double it.</reason>\n<tool_call>\n{"name": "double", "arguments": {"n": "21"}}\n</tool_call>' + IM_END
    assert turn(tok, traj, text, cfg) == ToolCall("print(2 * 21)", ""), "the second tool's call must run"
    assert turn(tok, plain, text, RolloutConfig()).error is not None, "a run without it must refuse the call"


def test_a_sandbox_failure_ends_the_trajectory_marked_and_is_not_the_models_tool_error(tok):
    cfg, traj = RolloutConfig(), fresh(tok)
    turn(tok, traj, CALL, cfg)
    n = len(traj.response_ids)
    add_tool_turn(traj, ExecResult(SANDBOX_FAILURE, "", "worker died", 0.0, False), tok, cfg)
    assert traj.sandbox_failed and traj.finish_reason == "sandbox_failure"
    assert traj.num_tool_failures == 0, "the sandbox's failure was counted as the model's failed tool call"
    assert len(traj.response_ids) == n, "no tool turn may be made up for a call the sandbox lost"


def test_a_turn_with_neither_a_tool_call_nor_an_answer_is_void(tok):
    cfg, void, answered = RolloutConfig(), fresh(tok), fresh(tok)
    turn(tok, void, "I do not know.</reason>" + IM_END, cfg)
    turn(tok, answered, CALL, cfg)
    turn(tok, answered, ANSWER, cfg)
    assert (void.void_turns, answered.void_turns) == (1, 0)


# -- real rollouts on vLLM with the SFT'd toy model -----------------------------------

@pytest.fixture(scope="module")
def problems(toy_world):
    lines = (toy_world / "test.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:16]]


class Recorder:
    """The real engine, with a record of every prompt it was given and every turn it sampled."""

    def __init__(self, engine):
        self.engine, self.prompts, self.calls = engine, {}, []

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = prompt["prompt_token_ids"]
        self.engine.add_request(request_id, prompt, params)

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def step(self):
        outs = self.engine.step()
        self.calls += [(self.prompts[o.request_id], list(o.outputs[0].token_ids)) for o in outs if o.finished]
        return outs


@pytest.fixture(scope="module")
def lockstep_batch(toy_engine, sandbox, problems):
    from scheduler import rollout_lockstep
    tok = toy_engine.get_tokenizer()
    rec = Recorder(toy_engine.llm_engine)
    cfg = RolloutConfig(deterministic=True, max_response=512, seed=1)
    trajs, stats = rollout_lockstep(rec, tok, sandbox, problems, 4, cfg)
    return trajs, stats, rec


@pytest.mark.slow
def test_rollouts_are_multi_turn_and_ids_are_exactly_what_was_sampled(lockstep_batch, toy_engine):
    trajs, stats, rec = lockstep_batch
    tok = toy_engine.get_tokenizer()
    multi = sum(t.num_turns >= 2 and t.tool_calls >= 1 for t in trajs)
    assert multi > len(trajs) / 2, f"only {multi}/{len(trajs)} trajectories made a tool round-trip"
    sampled_by_prompt = {}                  # the samples of one problem share their first prompt
    for p, s in rec.calls:
        sampled_by_prompt.setdefault(tuple(p), []).append(s)
    for t in trajs:
        # Walk the trajectory turn by turn: each sampled segment must be exactly what vLLM
        # returned for the prefix before it, and each tool segment the rendered tool turn.
        response, mask, pos = t.response_ids.tolist(), t.loss_mask.tolist(), 0
        while pos < len(response):
            prefix = tuple(t.prompt_ids.tolist() + response[:pos])
            s = next((s for s in sampled_by_prompt[prefix] if response[pos:pos + len(s)] == s), None)
            assert s is not None, f"trajectory {t.index}/{t.sample}: tokens at {pos} are not what vLLM sampled"
            assert mask[pos:pos + len(s)] == [1] * len(s), "sampled tokens must have loss mask 1"
            pos += len(s)
            end = pos
            while end < len(response) and mask[end] == 0:
                end += 1
            if end > pos:
                text = tok.decode(response[pos:end])
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
                assert response[pos:end] == tok.encode(text, add_special_tokens=False)
            pos = end
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
    assert stats["generated_tokens"] == sum(sum(t.loss_mask) for t in trajs)


@pytest.mark.slow
def test_trainer_logprobs_match_sampler_logprobs(lockstep_batch, toy_sft_model):
    import torch
    from transformers import AutoModelForCausalLM
    trajs, _, _ = lockstep_batch
    model = AutoModelForCausalLM.from_pretrained(toy_sft_model, torch_dtype=torch.float32)
    worst = max_diff_hf_vs_sampler(model, trajs)
    assert worst < 1e-4, f"HF and vLLM disagree on sampled tokens by {worst:.2e}"


def hf_logprobs(model, traj, temperature=1.0):
    import torch
    ids = torch.tensor([traj.prompt_ids.tolist() + traj.response_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(traj.prompt_ids) - 1:]                       # one per response token


def max_diff_hf_vs_sampler(model, trajs, temperature=1.0):
    import torch
    worst = 0.0
    for t in trajs:
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        diff = (hf_logprobs(model, t, temperature) - torch.tensor(t.logprobs))[mask].abs()
        worst = max(worst, diff.max().item() if mask.any() else 0.0)
    return worst


@pytest.mark.slow
def test_at_temperature_0_7_sampler_and_trainer_score_the_distribution_that_drew_the_tokens(
        toy_engine, toy_sft_model, sandbox, problems):
    import torch
    from transformers import AutoModelForCausalLM
    from scheduler import rollout_lockstep
    from infra.logprobs import token_logprobs
    trajs, _ = rollout_lockstep(toy_engine.llm_engine, toy_engine.get_tokenizer(), sandbox, problems[:8], 2,
                                RolloutConfig(deterministic=True, max_response=256, temperature=0.7, seed=5))
    model = AutoModelForCausalLM.from_pretrained(toy_sft_model, dtype=torch.float32)
    worst = max_diff_hf_vs_sampler(model, trajs, temperature=0.7)
    assert worst < 1e-4, f"the sampler's log-probs are not log_softmax(logits / 0.7): off by {worst:.2e}"
    assert max_diff_hf_vs_sampler(model, trajs, temperature=1.0) > 1e-2, "the check must tell the temperatures apart"
    t = trajs[0]
    ids = torch.tensor([t.prompt_ids.tolist() + t.response_ids.tolist()])
    with torch.no_grad():
        trainer = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)[0, len(t.prompt_ids) - 1:]
    assert torch.allclose(trainer, hf_logprobs(model, t, 0.7), atol=1e-5), "the trainer must divide by 0.7 too"


@pytest.mark.slow
def test_weight_sync_reaches_the_engine_prefix_cache_included(toy_engine, toy_sft_model, sandbox, problems):
    import torch
    from transformers import AutoModelForCausalLM
    from infra.engine import sync_weights
    from scheduler import rollout_lockstep
    tok, cfg = toy_engine.get_tokenizer(), RolloutConfig(deterministic=True, max_response=48, max_turns=1, seed=3)
    engine = toy_engine.llm_engine
    model = AutoModelForCausalLM.from_pretrained(toy_sft_model, torch_dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    before, _ = rollout_lockstep(engine, tok, sandbox, problems[:4], 1, cfg)  # caches these prompts
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        sync_weights(toy_engine, iter(model.state_dict().items()))
        after, _ = rollout_lockstep(engine, tok, sandbox, problems[:4], 1, cfg)
        worst = max_diff_hf_vs_sampler(model, after)
        assert worst < 1e-4, f"after a sync vLLM still differs from the new weights by {worst:.2e} (stale prefix cache?)"
    finally:
        sync_weights(toy_engine, iter(original.items()))
    restored, _ = rollout_lockstep(engine, tok, sandbox, problems[:4], 1, cfg)
    assert [t.response_ids.tolist() for t in restored] == [t.response_ids.tolist() for t in before], \
        "syncing the original weights back must restore the original samples"


@pytest.mark.slow
def test_turn_and_budget_caps_end_trajectories_with_the_right_reason(toy_engine, sandbox, problems):
    from scheduler import rollout_lockstep
    tok, engine = toy_engine.get_tokenizer(), toy_engine.llm_engine
    one_turn, _ = rollout_lockstep(engine, tok, sandbox, problems, 2, RolloutConfig(max_turns=1, max_response=512))
    assert all(t.num_turns == 1 for t in one_turn)
    assert any(t.finish_reason == "max_turns" for t in one_turn), "a tool call on the only turn must end it"
    assert all(t.finish_reason != "max_turns" or t.tool_calls == 0 for t in one_turn)
    short, _ = rollout_lockstep(engine, tok, sandbox, problems, 2, RolloutConfig(max_response=12))
    assert all(len(t.response_ids) <= 12 for t in short), "the budget covers sampled and tool tokens"
    assert any(t.finish_reason == "length" for t in short)
    assert all(t.finish_reason in ("length", "answer", "no_tool_call") for t in short), \
        "with 12 tokens no tool turn fits: a tool call must end the trajectory with length"
    assert all(t.reward == 0.0 for t in short if t.finish_reason == "length")


@pytest.mark.slow
def test_an_infinite_loop_costs_one_timeout_not_the_batch(toy_engine, sandbox, problems):
    from scheduler import rollout_lockstep

    class HangTheFirstCall:
        """The real sandbox, except that the first call it is given loops forever."""
        hung = False

        def run_batch(self, jobs):
            if jobs and not self.hung:
                self.hung = True
                jobs = [("while True:\n    pass", "")] + jobs[1:]
            return sandbox.run_batch(jobs)

        def verify_batch(self, pairs):
            return sandbox.verify_batch(pairs)

    tok = toy_engine.get_tokenizer()
    trajs, stats = rollout_lockstep(toy_engine.llm_engine, tok, HangTheFirstCall(), problems, 2,
                                    RolloutConfig(deterministic=True, max_response=512))
    assert sum(t.tool_failures.get("timeout", 0) for t in trajs) == 1, "only the looping call may time out"
    assert all(t.finish_reason for t in trajs)
    assert stats["tool_wait_seconds"] < 2 * sandbox.timeout + 5, "the loop must cost one timeout, not more"


# -- the engine's size does not depend on the machine ------------------------------------------

@pytest.mark.slow
def test_the_engine_starts_on_a_small_numa_node_with_the_kv_cache_it_was_asked_for(toy_engine, toy_sft_model,
                                                                                      monkeypatch):
    """vLLM 0.32 on CPU sized a fraction of the NUMA node minus this process's RSS: on an 11 GB node with
    10 GB in use that is negative, and the engine did not start. The cache is asked for in tokens."""
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo
    import vllm.v1.worker.cpu_worker as cpu_worker
    from conftest import KV_CACHE_TOKENS
    from infra.engine import CPU_BLOCK, kv_capacity_tokens, make_engine
    assert kv_capacity_tokens(toy_engine.llm_engine) == KV_CACHE_TOKENS, "the shared engine must hold what it was asked for"
    node = MemoryNodeInfo(total_memory=int(11.21 * 2**30), available_memory=int(1.16 * 2**30))
    monkeypatch.setattr(cpu_worker, "get_memory_node_info", lambda *_: node)
    small = make_engine(str(toy_sft_model), max_model_len=512, kv_cache_tokens=10 * CPU_BLOCK + 1)
    assert kv_capacity_tokens(small.llm_engine) == 11 * CPU_BLOCK, "asked tokens round up to whole blocks, no more"
    del small  # (not shut down: that would tear down the process group the shared engine lives in)
    with pytest.raises(RuntimeError, match="HINT: a KV cache of 400000 tokens .* ask for fewer"):
        make_engine(str(toy_sft_model), max_model_len=512, kv_cache_tokens=400_000)  # 1.5 GiB > 1.16 GiB free


def test_the_collapse_alarm_fires_at_the_step_tool_use_halves_and_not_before():
    from infra.training import collapse_alarms
    history = [{"tool_calls": 1.0, "turns": 2.0}, {"tool_calls": 1.2, "turns": 2.2}]   # means 1.1, 2.1
    assert collapse_alarms([], {"tool_calls": 0.0, "turns": 0.0}) == [], "no history: nothing to compare"
    assert collapse_alarms(history, {"tool_calls": 0.56, "turns": 1.06}) == [], "above half the mean"
    alarms = collapse_alarms(history, {"tool_calls": 0.5, "turns": 2.0})
    assert len(alarms) == 1 and alarms[0].startswith("tool_calls 0.50") and "1.10" in alarms[0]


def test_metrics_leave_what_the_sandbox_failed_out_of_every_rate():
    from rollout import trajectory_metrics
    good = Trajectory(index=0, correct=True, reward=1.0, tool_calls=2, tool_failures={"error": 1},
                      response_ids=[1] * 10, loss_mask=[1] * 10, num_turns=3)
    failed = Trajectory(index=0, sandbox_failed=True, tool_calls=1, response_ids=[1] * 4, loss_mask=[1] * 4)
    m = trajectory_metrics([good, failed])
    assert (m["trajectories"], m["sandbox_failures"], m["accuracy"], m["tool_calls"]) == (2, 1, 1.0, 2.0)
    assert (m["tool_error_ratio"], m["tool_error_ratio_pos"], m["response_length"]) == (0.5, 0.5, 10.0)
    assert m["generated_tokens"] == 14, "what was generated was generated, failure or not"
