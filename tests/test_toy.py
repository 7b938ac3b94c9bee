"""The toy world: data/prepare_toy.py's files, and (slow) that SFT on them teaches the format.

Also a script that measures a toy model with HF generate and the real tool:

    python tests/test_toy.py runs/toy_sft                  # greedy, on data/toy/test.jsonl
    python tests/test_toy.py runs/toy_sft --temperature 1.0
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
from rollout import (IM_END, SYSTEM_PROMPT, extract_answer, format_tool_response, is_correct,  # noqa: E402
                     parse_tool_call, render_messages, render_prompt, render_tool_turn)


# -----------------------------------------------------------------------------
# Measuring a toy model: multi-turn generation with HF generate, tools run for real.

def run_tools(calls):
    """[(code, stdin)] -> [ExecResult], through the sandbox."""
    from sandbox import Sandbox
    with Sandbox() as sb:
        return sb.run_batch(calls)


def evaluate(model_dir, problems, max_turns=4, max_new_tokens=64, temperature=0.0, batch_size=100, seed=0):
    """Generate on `problems` ({"question", "answer"}) the way a rollout does, turn by turn, with
    the tool's output appended as a tool turn. Returns rates over the problems:
      parse_rate       first turn well formed: a call parse_tool_call accepts, or an answer extract_answer reads
      tool_rate        first turn calls the tool
      accuracy         final answer correct
      tool_accuracy    accuracy where the first turn called the tool
      direct_accuracy  accuracy where it answered directly
      copy_rate        first call is print(<the question's expression>) (operands copied right)
      tool_error_rate  failed calls / calls (parse failures and errors)
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.pad_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    states = [dict(ids=enc(render_prompt(p["question"])), text="", done=False, first=None, calls=0, failures=0,
                   first_code=None, answer=None) for p in problems]
    for turn in range(max_turns):
        active = [s for s in states if not s["done"]]
        calls, callers = [], []
        for b in range(0, len(active), batch_size):
            chunk = active[b:b + batch_size]
            width = max(len(s["ids"]) for s in chunk)
            input_ids = torch.tensor([[pad] * (width - len(s["ids"])) + s["ids"] for s in chunk])   # (B, T) left-padded
            attention_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(s["ids"]) for s in chunk])[:, None]).long()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                     do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                     top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad)
            for s, row in zip(chunk, out[:, width:].tolist()):
                new = row[:row.index(eos) + 1] if eos in row else row
                text = tok.decode(new)
                s["ids"] += new
                s["text"] += text
                call = parse_tool_call(text)
                if s["first"] is None:
                    s["first"] = "tool" if isinstance(call, tuple) else \
                                 "answer" if call is None and extract_answer(text) is not None else "malformed"
                    s["first_code"] = call[0] if isinstance(call, tuple) else None
                if eos not in new or call is None or turn == max_turns - 1:
                    s["done"] = True
                    s["answer"] = extract_answer(text) if eos in new else None
                    continue
                s["calls"] += 1
                if isinstance(call, str):
                    s["failures"] += 1
                    s["ids"] += enc(render_tool_turn(call))
                else:
                    calls.append(call)
                    callers.append(s)
        for s, result in zip(callers, run_tools(calls) if calls else []):
            s["failures"] += result.status != "ok"
            s["ids"] += enc(render_tool_turn(format_tool_response(result)))
            s["text"] += format_tool_response(result)
    correct = [is_correct(s["answer"], p["answer"]) for s, p in zip(states, problems)]
    tool = [s["first"] == "tool" for s in states]
    n, n_tool = len(states), sum(tool)
    expr = lambda q: re.fullmatch(r"What is (.*)\?", q).group(1)
    return dict(
        n=n,
        parse_rate=sum(s["first"] != "malformed" for s in states) / n,
        tool_rate=n_tool / n,
        accuracy=sum(correct) / n,
        tool_accuracy=sum(c for c, t in zip(correct, tool) if t) / max(n_tool, 1),
        direct_accuracy=sum(c for c, t in zip(correct, tool) if not t) / max(n - n_tool, 1),
        copy_rate=sum(s["first_code"] == f"print({expr(p['question'])})" for s, p in zip(states, problems)) / max(n_tool, 1),
        tool_error_rate=sum(s["failures"] for s in states) / max(sum(s["calls"] for s in states), 1),
        example=states[0]["text"],
    )


# -----------------------------------------------------------------------------
# Fast tests on a small toy world.

def prepare(out, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "data", "prepare_toy.py"), "--out", str(out), *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


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
        assert int(p["answer"]) == eval(re.fullmatch(r"What is (.*)\?", p["question"]).group(1))
    q_train, q_test = {p["question"] for p in train}, {p["question"] for p in test}
    assert not q_test & q_train and not q_test & set(sft), "held-out problems leak into training data"


def test_sft_data_mixes_direct_answers_tool_use_and_failed_calls(toy):
    convs = [c["messages"] for c in read_jsonl(toy / "sft.jsonl")]
    tool = [m for m in convs if len(m) > 2]
    failed_first = [m for m in convs if len(m) > 4]
    assert 0.35 < len(tool) / len(convs) < 0.6, "tool use should be about half of the SFT data"
    assert 0.1 < len(failed_first) / len(tool) < 0.4, "some tool uses should fail first and be fixed"
    direct_hard_right = 0
    for m in convs:
        gold = str(eval(re.fullmatch(r"What is (.*)\?", m[0]["content"]).group(1)))
        if len(m) > 2:
            assert extract_answer(m[-1]["content"]) == m[-2]["content"] == gold, "tool users copy the tool's result"
        elif len(gold.lstrip("-")) > 2:
            direct_hard_right += extract_answer(m[-1]["content"]) == gold
    assert direct_hard_right == 0, "direct answers to hard problems must be wrong: the tool is the way to win"


def test_sft_tool_outputs_are_what_the_sandbox_shows(toy):
    convs = [c["messages"] for c in read_jsonl(toy / "sft.jsonl")]
    pairs = [(m[i - 1]["tool_call"]["code"], m[i]["content"]) for m in convs for i in range(2, len(m), 2)]
    pairs = pairs[:40] + [p for p in pairs if "Error" in p[1]][:20]
    results = run_tools([(code, "") for code, _ in pairs])
    for (code, shown), result in zip(pairs, results):
        assert shown == format_tool_response(result), f"SFT shows {shown!r} for {code!r}, the sandbox gives {result!r}"


def test_tokenizer_keeps_chat_markers_special_and_digits_single(toy):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "init_model")
    for marker in ["<|im_start|>", "<|im_end|>"]:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, f"{marker} must be one special token"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    assert "<tool_call>" not in tok.all_special_tokens, "tool tags must stay ordinary text so stop strings match"
    assert tok.tokenize("12345") == list("12345"), "digits must be split one by one"
    assert len(tok.encode(render_prompt("What is 1234 * 5678?"))) < 60, "the system prompt should compress well"


def test_chat_template_renders_what_render_messages_tokenizes(toy):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy / "init_model")
    for conv in read_jsonl(toy / "sft.jsonl")[:20]:
        ids, _ = render_messages(tok, conv["messages"])
        text = tok.apply_chat_template(conv["messages"], tokenize=False)
        assert text == tok.decode(ids), "the tokenizer's chat template and rollout.render_messages disagree"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 * 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == render_prompt("What is 2 * 3?")


def test_init_model_loads_untied_with_head_dim_32(toy):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(toy / "init_model")
    cfg = model.config
    assert cfg.model_type in ("qwen2", "qwen3") and not cfg.tie_word_embeddings
    assert cfg.hidden_size // cfg.num_attention_heads >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, cfg.vocab_size) and torch.isfinite(out).all()


# -----------------------------------------------------------------------------
# Slow: prepare + a shortened toy SFT teaches the format.

@pytest.mark.slow
def test_short_sft_teaches_the_tool_format(tmp_path):
    prepare(tmp_path, "--n-test", "100")
    sys.path.insert(0, ROOT)
    import sft
    sft.main(["--preset", "toy", "--model", str(tmp_path / "init_model"), "--data", str(tmp_path / "sft.jsonl"),
              "--out-dir", str(tmp_path / "sft"), "--max-steps", "120"])
    m = evaluate(tmp_path / "sft", read_jsonl(tmp_path / "test.jsonl"))
    assert m["parse_rate"] >= 0.8, f"well-formed first turns: {m}"
    assert 0.2 <= m["tool_rate"] <= 0.8, f"tool-call rate should track the data's ~50%: {m}"


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Measure a toy model on held-out problems with HF generate and the real tool.")
    parser.add_argument("model_dir", help="an HF checkpoint folder (e.g. runs/toy_sft)")
    parser.add_argument("--problems", default=os.path.join(ROOT, "data/toy/test.jsonl"), help="JSONL of {question, answer}")
    parser.add_argument("--n", type=int, default=200, help="how many problems to use")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(2)
    t0 = time.time()
    m = evaluate(args.model_dir, read_jsonl(args.problems)[:args.n], temperature=args.temperature, seed=args.seed)
    print(m.pop("example"))
    print(json.dumps({k: round(v, 3) for k, v in m.items()}), f"({time.time() - t0:.0f} s)")
