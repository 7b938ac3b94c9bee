"""data/prepare_gsm8k.py and data/chains.py: GSM8K solutions -> tool-using conversations, checked by hand
on real records
(the first ones of GSM8K's training split), and the script end to end on a local file."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "data")]

from conversation import (ToolCall, format_tool_response, parse_tool_call,  # noqa: E402
                          render_assistant_turn, render_messages)
from chains import Skip, broken_code, chain_code, conversation  # noqa: E402
from prepare_gsm8k import parse_solution  # noqa: E402

NATALIA = dict(question="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                        "in May. How many clips did Natalia sell altogether in April and May?",
               answer="Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
                      "clips altogether in April and May.\n#### 72")
WENG = dict(question="Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                     "How much did she earn?",
            answer="Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                   "$<<0.2*50=10>>10.\n#### 10")
BETTY = dict(question="Betty is saving money for a new wallet which costs $100. Betty has only half of the "
                      "money she needs. Her parents decided to give her $15 for that purpose, and her "
                      "grandparents twice as much as her parents. How much more money does Betty need to buy "
                      "the wallet?",
             answer="In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her "
                    "15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 "
                    "more.\n#### 5")


def test_a_solution_splits_into_reasoning_named_steps_and_its_final_answer():
    reasoning, steps, final = parse_solution(NATALIA["answer"])
    assert reasoning == ("Natalia sold 48/2 = 24 clips in May.\n"
                         "Natalia sold 48+24 = 72 clips altogether in April and May."), "annotations must go"
    assert steps == [("clips_in_may", "48/2", "24"), ("clips_altogether_in", "48+24", "72")]
    assert final == "72"


def test_the_code_names_each_quantity_and_uses_an_earlier_result_by_its_name():
    assert chain_code(parse_solution(NATALIA["answer"])[1]) == (
        "clips_in_may = 48 / 2\nclips_altogether_in = 48 + clips_in_may\nprint(clips_altogether_in)")
    # words that name nothing ("$10.") give step{k}; 0.2 is the first step's result, used by its name
    assert chain_code(parse_solution(WENG["answer"])[1]) == (
        "per_minute = 12 / 60\nstep2 = per_minute * 50\nprint(step2)")
    # 50 and 30 are earlier results: the chain is computed, not copied; 100 and 15 come from the question
    assert chain_code(parse_solution(BETTY["answer"])[1]) == (
        "step1 = 100 / 2\nstep2 = 15 * 2\nmore = 100 - step1 - step2 - 15\nprint(more)")


@pytest.mark.parametrize("answer, reason", [
    ("She has 3 apples.\n#### 3", "no calculator annotation"),
    ("She has <<3 apples=3>>3.\n#### 3", "an annotation that is not Python"),
    ("She has <<len('abc')=3>>3.\n#### 3", "an annotation that is not arithmetic"),
    ("She has 3 apples.", "no #### final answer"),
])
def test_solutions_that_cannot_become_code_are_skipped_with_a_reason(answer, reason):
    with pytest.raises(Skip, match=reason):
        chain_code(parse_solution(answer)[1])


def test_the_conversation_shows_what_the_sandbox_printed_and_a_failing_call_is_fixed(sandbox, qwen3_tokenizer):
    reasoning, steps, final = parse_solution(NATALIA["answer"])
    code = chain_code(steps)
    broken = broken_code(code, __import__("random").Random(0))
    results = sandbox.run_batch([broken, code])
    assert [r.status for r in results] == ["error", "ok"], "the broken call must fail and the chain must run"
    assert results[1].stdout == "72.0\n", "48 + 48 / 2 prints 72.0 in Python"
    msgs = conversation(NATALIA["question"], reasoning, [broken, code], results, final)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert msgs[2]["content"] == format_tool_response(results[0]) and "Error" in msgs[2]["content"]
    assert msgs[4]["content"] == "72.0"
    assert msgs[-1]["content"] == "The code printed 72.0.</reason><answer>\\boxed{72}</answer>"
    assert parse_tool_call(render_assistant_turn(msgs[1])) == ToolCall(broken, ""), "the call must parse back"
    ids, mask = render_messages(qwen3_tokenizer, msgs)
    assert 0 < sum(mask) < len(ids), "loss on the assistant's tokens only"


def test_the_script_writes_disjoint_sets_and_every_conversation_reaches_its_answer(tmp_path):
    source = tmp_path / "train.jsonl"
    unannotated = [dict(question=f"Q{i}", answer=f"No steps.\n#### {i}") for i in range(4)]
    rows = [NATALIA, WENG, BETTY] * 4 + unannotated
    rows = [dict(r, question=f"{r['question']} ({i})") for i, r in enumerate(rows)]  # 16 distinct problems
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "data/prepare_gsm8k.py", "--local", f"gsm8k={source}",
                          "--out", str(out), "--n-test", "3", "--n-sft", "8", "--error-share", "0.5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    names = ("test", "train", "easy", "sft")
    read = {name: [json.loads(line) for line in open(out / f"{name}.jsonl")] for name in names}
    assert len(read["test"]) == 3 and len(read["train"]) == 5
    steps = {r["question"]: r["answer"].count("<<") for r in rows}
    assert all(p["steps"] == steps[p["question"]] for p in read["train"]), "steps: the solution's annotations"
    assert read["easy"] == [p for p in read["train"] if p["steps"] <= 2], "easy: the RL problems of <= 2 steps"
    sft_questions = [c["messages"][0]["content"] for c in read["sft"]]
    sets = [{p["question"] for p in read["test"]}, {p["question"] for p in read["train"]}, set(sft_questions)]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2]), "SFT, RL and held-out overlap"
    by_question = {r["question"]: r["answer"].rpartition("####")[2].strip() for r in rows}
    for c in read["sft"]:
        final = by_question[c["messages"][0]["content"]]
        assert float(c["messages"][-2]["content"]) == float(final), "the last tool output must be the answer"
        assert c["messages"][-1]["content"].endswith(f"\\boxed{{{final}}}</answer>")
    left_out = {r["question"] for r in rows} - sets[0] - sets[1] - sets[2]
    assert len(read["sft"]) + len(left_out) == 8, "each SFT problem is converted or counted as left out"
    assert all(by_question[q] and "No steps" in dict((r["question"], r["answer"]) for r in rows)[q]
               for q in left_out), "only solutions without annotations may be left out"


def test_the_real_split_converts_most_solutions():
    path = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"GSM8K's training split is not at {path} (the repository's shared data folder)")
    rows = [json.loads(line) for line in open(path)][:500]
    converted = 0
    for row in rows:
        try:
            chain_code(parse_solution(row["answer"])[1])
            converted += 1
        except Skip:
            pass
    assert converted >= 0.95 * len(rows), f"only {converted} of {len(rows)} GSM8K solutions became code"
