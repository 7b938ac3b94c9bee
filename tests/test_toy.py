"""The toy world: data/prepare_toy.py's files, and (slow) that the toy SFT teaches the format.

Run as a script, it measures a toy model on held-out problems with HF generate and the real tool:

    python tests/test_toy.py runs/toy_sft                      # temperature 0.6, data/toy/test.jsonl
    python tests/test_toy.py runs/toy_sft --temperature 1.0 --show 5
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conversation import (IM_END, extract_answer, format_tool_response, parse_tool_call,  # noqa: E402
                          render_messages, render_prompt, render_tool_turn)
from rollout import grade  # noqa: E402


# -----------------------------------------------------------------------------
# Measuring a toy model: multi-turn generation with HF generate, tool calls run in the sandbox.

def expression(question):
    return re.fullmatch(r"What is (.*)\?", question).group(1)


def evaluate(model_dir, problems, max_turns=4, max_new_tokens=64, temperature=0.6, batch_size=100, seed=0):
    """Generate on `problems` ({"question", "answer"}) as a rollout does, turn by turn, each tool
    call's output appended as a tool turn. Returns rates over the problems, and per-problem records:
      parse_rate       first turn well formed: a call parse_tool_call accepts, or an answer extract_answer reads
      tool_rate        first turn calls the tool
      accuracy         final answer correct
      tool_accuracy    accuracy where the first turn called the tool (direct_accuracy: where it did not)
      copy_rate        of those, first call is exactly print(<the question's expression>)
      tool_error_rate  failed calls (parse failures included) / calls
    """
    import torch
    from sandbox import Sandbox
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.pad_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    states = [dict(ids=enc(render_prompt(p["question"])), text="", done=False, first=None, first_code=None,
                   calls=0, failures=0, answer=None) for p in problems]
    with Sandbox() as sandbox:
        for turn in range(max_turns):
            active, calls, callers = [s for s in states if not s["done"]], [], []
            for b in range(0, len(active), batch_size):
                chunk = active[b:b + batch_size]
                width = max(len(s["ids"]) for s in chunk)
                input_ids = torch.tensor([[pad] * (width - len(s["ids"])) + s["ids"] for s in chunk])  # (B, T) left-padded
                attention_mask = (input_ids != pad).long()  # (B, T); pad never occurs inside a conversation
                with torch.no_grad():
                    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                         max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                         temperature=temperature or None, top_p=None, top_k=None,
                                         eos_token_id=eos, pad_token_id=pad)
                for s, row in zip(chunk, out[:, width:].tolist()):
                    new = row[:row.index(eos) + 1] if eos in row else row
                    text = tok.decode(new)
                    s["ids"] += new
                    s["text"] += text
                    call = parse_tool_call(text)
                    if s["first"] is None:
                        s["first"] = ("tool" if call is not None and call.error is None else
                                      "answer" if call is None and extract_answer(text) is not None else "malformed")
                        s["first_code"] = call.code if s["first"] == "tool" else None
                    if eos not in new or call is None or turn == max_turns - 1:
                        s["done"], s["answer"] = True, extract_answer(text) if eos in new else None
                        continue
                    s["calls"] += 1
                    if call.error is not None:  # a parse error is the tool's output
                        s["failures"] += 1
                        s["ids"] += enc(render_tool_turn(call.error))
                        s["text"] += call.error
                    else:
                        calls.append((call.code, call.stdin))
                        callers.append(s)
            for s, result in zip(callers, sandbox.run_batch(calls)):
                s["failures"] += result.status != "ok"
                s["ids"] += enc(render_tool_turn(format_tool_response(result)))
                s["text"] += format_tool_response(result)
    correct = [r == 1.0 for r in grade([s["answer"] for s in states], [p["answer"] for p in problems])]
    tool = [s["first"] == "tool" for s in states]
    n, n_tool = len(states), sum(tool)
    return dict(
        n=n,
        parse_rate=sum(s["first"] != "malformed" for s in states) / n,
        tool_rate=n_tool / n,
        accuracy=sum(correct) / n,
        tool_accuracy=sum(c for c, t in zip(correct, tool) if t) / max(n_tool, 1),
        direct_accuracy=sum(c for c, t in zip(correct, tool) if not t) / max(n - n_tool, 1),
        copy_rate=sum(s["first_code"] == f"print({expression(p['question'])})"
                      for s, p in zip(states, problems)) / max(n_tool, 1),
        tool_error_rate=sum(s["failures"] for s in states) / max(sum(s["calls"] for s in states), 1),
        records=[dict(question=p["question"], gold=p["answer"], answer=s["answer"], first=s["first"], correct=c,
                      text=s["text"]) for s, p, c in zip(states, problems, correct)],
    )


# -----------------------------------------------------------------------------
# Fast tests

def prepare(out, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "data", "prepare_toy.py"), "--out", str(out), *flags]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_tools(codes):
    from sandbox import Sandbox
    with Sandbox() as sb:
        return sb.run_batch(codes)


SMALL = ["--n-train", "300", "--n-test", "100", "--n-sft", "600"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    prepare(out, *SMALL)
    return out


def test_same_seed_writes_the_same_world(toy, tmp_path):
    prepare(tmp_path, *SMALL)
    for name in ["train.jsonl", "test.jsonl", "sft.jsonl", "init_model/tokenizer.json", "init_model/config.json"]:
        with open(toy / name) as a, open(tmp_path / name) as b:
            assert a.read() == b.read(), f"{name} differs between two runs with the same seed"


def test_problems_have_integer_answers_and_do_not_overlap(toy):
    train, test = read_jsonl(toy / "train.jsonl"), read_jsonl(toy / "test.jsonl")
    sft = [c["messages"][0]["content"] for c in read_jsonl(toy / "sft.jsonl")]
    assert (len(train), len(test), len(sft)) == (300, 100, 600)
    for p in train + test:
        assert re.fullmatch(r"-?\d+", p["answer"]), f"answer {p['answer']!r} is not an integer"
        assert int(p["answer"]) == eval(expression(p["question"])), f"wrong answer for {p['question']}"
    q_train, q_test = {p["question"] for p in train}, {p["question"] for p in test}
    assert not q_test & q_train and not q_test & set(sft), "held-out problems leak into training data"


def test_sft_data_mixes_direct_answers_tool_use_and_failed_calls(toy):
    convs = [c["messages"] for c in read_jsonl(toy / "sft.jsonl")]
    tool = [m for m in convs if len(m) > 2]
    fixed = [m for m in convs if len(m) > 4]
    assert 0.4 < len(tool) / len(convs) < 0.6, "about half of the SFT conversations should use the tool"
    assert 0.15 < len(fixed) / len(tool) < 0.35, "about a quarter of tool uses should fail first, then be fixed"
    for m in convs:
        gold = str(eval(expression(m[0]["content"])))
        if len(m) > 2:
            assert m[-2]["content"] == gold, "the last call must print the answer"
            assert extract_answer(m[-1]["content"]) == gold, "tool users must copy the tool's result"
        else:
            assert extract_answer(m[-1]["content"]) not in (None, gold), \
                "direct answers must be readable and wrong: the tool is the way to win"


def test_sft_tool_outputs_are_what_the_sandbox_shows(toy):
    convs = [c["messages"] for c in read_jsonl(toy / "sft.jsonl")]
    shown = [(m[i - 1]["tool_call"]["code"], m[i]["content"]) for m in convs for i in range(2, len(m), 2)]
    shown = shown[:30] + [s for s in shown if "Error" in s[1]][:30]
    assert any("NameError" in s for _, s in shown) and any("SyntaxError" in s for _, s in shown)
    for (code, text), result in zip(shown, run_tools([code for code, _ in shown])):
        assert text == format_tool_response(result), f"SFT shows {text!r} for {code!r}; the sandbox gives {result}"


def test_tokenizer_keeps_chat_markers_special_and_digits_single(toy):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "init_model")
    for marker in ["<|im_start|>", "<|im_end|>"]:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, f"{marker} must be one special token"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token not in (None, tok.eos_token)
    assert not {"<tool_call>", "<answer>", "<reason>"} & set(tok.all_special_tokens), \
        "tags must stay ordinary text so that stop strings and parsers see them"
    assert tok.tokenize("90125") == list("90125"), "digits must be split one by one (copying is token by token)"
    assert len(tok.encode(render_prompt("What is 1234 * 5678?"))) < 60, "the constant system prompt should compress"


def test_chat_template_renders_what_render_messages_tokenizes(toy):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "init_model")
    for conv in read_jsonl(toy / "sft.jsonl")[:20]:
        ids, _ = render_messages(tok, conv["messages"])
        assert tok.apply_chat_template(conv["messages"], tokenize=False) == tok.decode(ids), \
            "the tokenizer's chat template and conversation.render_messages disagree"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 * 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == render_prompt("What is 2 * 3?")


def test_init_model_is_untied_qwen_with_head_dim_32(toy):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(toy / "init_model")
    cfg = model.config
    assert cfg.model_type in ("qwen2", "qwen3") and not cfg.tie_word_embeddings
    assert cfg.head_dim >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, cfg.vocab_size) and torch.isfinite(out).all()


# -----------------------------------------------------------------------------
# Slow: the toy SFT model (conftest builds it once per machine with `sft.py --preset toy`)

@pytest.mark.slow
def test_toy_sft_model_writes_well_formed_turns_and_uses_the_tool_well(toy_world, toy_sft_model):
    import torch
    torch.set_num_threads(1)
    m = evaluate(toy_sft_model, read_jsonl(toy_world / "test.jsonl")[:100], temperature=0.6)
    m.pop("records")
    assert m["parse_rate"] >= 0.9, f"well-formed first turns: {m}"
    assert 0.3 <= m["tool_rate"] <= 0.7, f"the tool-call rate should track the SFT data's ~50%: {m}"
    assert m["tool_accuracy"] >= 0.8, f"with the tool's result appended, answers should be right: {m}"
    assert m["direct_accuracy"] <= 0.1, f"direct answers to hard problems should be wrong: {m}"


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Measure a toy model on held-out problems with HF generate and the real tool.")
    parser.add_argument("model_dir", help="an HF checkpoint folder, e.g. runs/toy_sft")
    parser.add_argument("--problems", default=os.path.join(ROOT, "data/toy/test.jsonl"), help="JSONL of {question, answer}")
    parser.add_argument("--n", type=int, default=200, help="how many problems to use")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (0.6: the paper's evaluation)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--show", type=int, default=3, help="print this many wrong answers")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    t0 = time.time()
    m = evaluate(args.model_dir, read_jsonl(args.problems)[:args.n], temperature=args.temperature, seed=args.seed)
    for r in [r for r in m.pop("records") if not r["correct"]][:args.show]:
        print(f"--- {r['question']} (gold {r['gold']}, got {r['answer']})\n{r['text']}")
    print(json.dumps({k: round(v, 3) for k, v in m.items()}), f"({time.time() - t0:.0f} s)")
