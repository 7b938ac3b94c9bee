"""A tool other than Python, end to end: a calculator added to TOOLS (the README's example of a second
tool) is called in SFT data, rendered and tokenized as sft.py trains on it, written by the chat template
that checkpoints carry, parsed back from the assistant's text and run by the rollout's tool dispatch."""
import copy
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sft  # noqa: E402
from conversation import (chat_template, render_assistant_turn, render_messages,  # noqa: E402
                          render_tool_call, system_prompt)
from rollout import RolloutConfig, Trajectory, add_tool_turn, end_turn  # noqa: E402
from conversation import TOOLS, Tool, tool_call  # noqa: E402

# One arithmetic expression, evaluated without builtins, in the same sandbox as Python's code.
CALCULATOR = Tool({"type": "function", "function": {
    "name": "calculate", "description": "Evaluate one arithmetic expression; prints its value.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {
        "type": "string", "description": "An arithmetic expression, e.g. 12 * 34 + 5"}}}}},
    lambda args: (f"print(eval({args['expression']!r}, {{'__builtins__': {{}}}}))", ""))


@pytest.fixture
def calculator(monkeypatch):
    monkeypatch.setitem(TOOLS, "calculator", CALCULATOR)


def calculator_conversation() -> list[dict]:
    """What an SFT file teaching the calculator holds: the system prompt of an RL run with --tools
    calculator, a call, its output, the answer."""
    return [{"role": "system", "content": system_prompt(("calculator",))},
            {"role": "user", "content": "What is 12 * 34 + 5?"},
            {"role": "assistant", "content": "Let me calculate.</reason>",
             "tool_call": tool_call("calculator", expression="12 * 34 + 5")},
            {"role": "tool", "content": "413"},
            {"role": "assistant", "content": "So it is 413.</reason><answer>\\boxed{413}</answer>"}]


def test_a_calculator_call_is_trained_on_then_parsed_and_run_as_a_rollout_runs_it(calculator, qwen3_tokenizer,
                                                                                   sandbox):
    tok, messages = qwen3_tokenizer, calculator_conversation()
    ids, loss_mask = render_messages(tok, messages)
    call_text = render_assistant_turn(messages[2])
    assert '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 34 + 5"}}\n</tool_call>' \
        in call_text, f"the call must be written with the calculator's spec: {call_text!r}"
    trained = tok.decode([i for i, m in zip(ids, loss_mask) if m])
    assert trained == call_text + render_assistant_turn(messages[4]), "the loss must cover assistant turns"

    # The first assistant turn, as if the model had sampled its ids, through the rollout's turn logic.
    start = loss_mask.index(1)
    tool_start = loss_mask.index(0, start)
    next_start = loss_mask.index(1, tool_start)
    cfg = RolloutConfig(tools=("calculator",))
    traj = Trajectory(index=0, prompt_ids=ids[:start])
    call = end_turn(traj, ids[start:tool_start], [0.0] * (tool_start - start), tok, cfg)
    assert call is not None and call.error is None, f"the calculator's call did not parse back: {call}"
    result = sandbox.run(call.code, call.stdin)
    assert (result.status, result.stdout) == ("ok", "413\n"), result
    add_tool_turn(traj, result, tok, cfg)
    assert traj.response_ids == ids[start:next_start], "the rollout must build the ids SFT trained on"
    assert traj.tool_calls == 1 and traj.tool_failures == {}

    sampled = ids[start:tool_start]
    python_only = end_turn(Trajectory(index=0), sampled, [0.0] * len(sampled), tok, RolloutConfig())
    assert "unknown tool" in python_only.error, "a run that does not offer the calculator refuses its call"


def test_the_saved_chat_template_writes_the_calculator_call_as_render_messages_does(calculator,
                                                                                     qwen3_tokenizer):
    tok = copy.copy(qwen3_tokenizer)
    tok.chat_template = chat_template()  # what training.save_hf_checkpoint saves with these TOOLS
    messages = calculator_conversation()
    ids, _ = render_messages(tok, messages)
    templated = tok.apply_chat_template(messages, tokenize=False)
    assert templated == tok.decode(ids), "the chat template and render_messages write the call differently"
    assert tok.encode(templated, add_special_tokens=False) == ids


def test_sft_reads_and_tokenizes_a_conversation_that_calls_the_calculator(calculator, qwen3_tokenizer,
                                                                          tmp_path):
    path = tmp_path / "calculator.jsonl"
    path.write_text(json.dumps({"messages": calculator_conversation()}) + "\n")
    conversations = sft.load_conversations(str(path))
    samples = sft.tokenize_conversations(qwen3_tokenizer, conversations, str(path), max_len=4096)
    assert samples == [render_messages(qwen3_tokenizer, calculator_conversation())]


def test_an_old_python_call_without_its_tool_name_renders_as_tool_call_writes_it(qwen3_tokenizer):
    old = {"role": "assistant", "content": "Compute.</reason>", "tool_call": {"code": "print(2 + 2)"}}
    new = {"role": "assistant", "content": "Compute.</reason>",
           "tool_call": tool_call("python", code="print(2 + 2)", input="")}
    assert render_assistant_turn(old) == render_assistant_turn(new) == \
        "Compute.</reason>" + render_tool_call("print(2 + 2)") + "<|im_end|>"
    user = {"role": "user", "content": "2 + 2?"}
    tok = copy.copy(qwen3_tokenizer)
    tok.chat_template = chat_template()
    rendered = [tok.apply_chat_template([user, message], tokenize=False) for message in (old, new)]
    assert rendered[0] == rendered[1], "the chat template must write an old Python call as the new one"


WRONG_ARGUMENTS = [({}, "none"), ({"expression": "1", "code": "x"}, "expression, code")]


@pytest.mark.parametrize("arguments, given", WRONG_ARGUMENTS, ids=["missing", "unknown"])
def test_a_tool_call_must_give_the_arguments_its_spec_lists(calculator, arguments, given):
    said = f"calculator takes the arguments expression; this call gives {given}\n---> HINT: give it"
    with pytest.raises(ValueError, match=said):
        tool_call("calculator", **arguments)
    with pytest.raises(ValueError, match="(?s)unknown tool 'abacus'.*HINT"):
        tool_call("abacus", expression="1")
