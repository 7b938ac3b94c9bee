"""data/prepare_mawps.py: MAWPS and ASDiv-A records -> questions people read and tool-using conversations,
checked by hand on records of the SVAMP authors' training file (copied here as published), and the
script end to end on that file when it is there."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "data")]

from chains import chain_code, conversation, printed_matches  # noqa: E402
from conversation import ToolCall, parse_tool_call, render_assistant_turn  # noqa: E402
from prepare_mawps import CSV, convert, detokenize, number_text  # noqa: E402

BRYAN = {"Question": "Bryan took a look at his books as well . If Bryan has number0 books in each of his "
                     "number1 bookshelves , how many books does he have in total ?",
         "Numbers": "56.0 9.0", "Equation": "* number0 number1", "Answer": "504.0",
         "Ques": "how many books does he have in total ?"}
CONNER = {"Question": "Conner has number0 dollars in his bank account . Every month he spends number1 dollars "
                      ". He does not add money to the account . How much money will Conner have in his "
                      "account after number2 months ?",
          "Numbers": "25000.0 1500.0 8.0", "Equation": "- number0 * number1 number2", "Answer": "13000.0",
          "Ques": "How much money will Conner have in his account after number2 months ?"}
DAVE = {"Question": "Dave had to wash number0 short sleeve shirts and number1 long sleeve shirts before school "
                    ". If he had only washed number2 of them by the time school started , how many did he "
                    "not wash ?",
        "Numbers": "9.0 27.0 20.0", "Equation": "- + number0 number1 number2", "Answer": "16.0",
        "Ques": "how many did he not wash ?"}
KENDRA = {"Question": "Kendra made punch for her friend 's birthday party . She used number0 gallon of grape "
                      "juice , number1 gallon of cranberry juice , and number2 gallon of club soda . How many "
                      "gallons of punch did Kendra make ?",
          "Numbers": "0.25 0.375 0.125", "Equation": "+ + number0 number1 number2", "Answer": "0.75",
          "Ques": "How many gallons of punch did Kendra make ?"}


def test_the_detokenizer_gives_the_text_people_wrote():
    assert detokenize("how many books in total ?") == "how many books in total?"
    assert detokenize("She spent $ 13.99 on shorts , $ 12.14 on a shirt .") == \
        "She spent $13.99 on shorts, $12.14 on a shirt."
    assert detokenize("cindy 's mom baked cookies ; they didn 't eat them") == \
        "cindy's mom baked cookies; they didn't eat them"
    assert detokenize("the students ' books ( about half ) : 20 %") == "the students' books (about half): 20%"
    assert number_text("56.0") == "56" and number_text("10.22") == "10.22", "a whole number prints without .0"


def test_a_one_step_problem_states_the_operation_and_the_conversation_shows_what_its_code_printed(sandbox):
    question, reasoning, steps, answer, operations = convert(BRYAN)
    assert question == ("Bryan took a look at his books as well. If Bryan has 56 books in each of his 9 "
                        "bookshelves, how many books does he have in total?")
    assert (answer, operations) == ("504", 1)
    assert reasoning == "First, 56 * 9 = 504."
    code = chain_code(steps)
    assert code == "step1 = 56 * 9\nprint(step1)"
    result = sandbox.run_batch([code])[0]
    messages = conversation(question, reasoning, [code], [result], answer)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "First, 56 * 9 = 504.</reason>"
    assert messages[1]["tool_call"]["code"] == code
    assert messages[2]["content"] == "504", "the tool's output is what the sandbox printed"
    assert messages[3]["content"] == "The code printed 504.</reason><answer>\\boxed{504}</answer>"


def test_a_two_step_problem_computes_the_inner_operation_first_and_uses_it_by_its_step_name(sandbox):
    question, reasoning, steps, answer, operations = convert(CONNER)
    assert question.endswith("How much money will Conner have in his account after 8 months?")
    assert reasoning == "First, 1500 * 8 = 12000. Then, 25000 - 12000 = 13000."
    code = chain_code(steps)
    assert code == "step1 = 1500 * 8\nstep2 = 25000 - step1\nprint(step2)", \
        "the inner operation comes first; its result is used by its step's name, not its value"
    result = sandbox.run_batch([code])[0]
    assert result.stdout == "13000\n" and printed_matches(result, answer) and operations == 2
    _, reasoning, steps, _, _ = convert(DAVE)
    assert reasoning == "First, 9 + 27 = 36. Then, 36 - 20 = 16."
    assert chain_code(steps) == "step1 = 9 + 27\nstep2 = step1 - 20\nprint(step2)"
    _, reasoning, steps, answer, _ = convert(KENDRA)
    assert reasoning == "First, 0.25 + 0.375 = 0.625. Then, 0.625 + 0.125 = 0.75."
    assert sandbox.run_batch([chain_code(steps)])[0].stdout == "0.75\n" and answer == "0.75"


def test_the_stepwise_style_makes_every_operation_a_step_and_leaves_the_answer_to_the_code(sandbox):
    _, reasoning, steps, answer, _ = convert(BRYAN)  # (the default style)
    assert reasoning == "First, 56 * 9 = 504.", "no answer of its own: the model would box it, not the output"
    assert chain_code(steps) == "step1 = 56 * 9\nprint(step1)", "one operation has the first step's shape"
    _, reasoning, steps, answer, _ = convert(CONNER)
    assert reasoning == "First, 1500 * 8 = 12000. Then, 25000 - 12000 = 13000."
    code = chain_code(steps)
    assert code == "step1 = 1500 * 8\nstep2 = 25000 - step1\nprint(step2)", "a sentence a line, in order"
    assert sandbox.run_batch([code])[0].stdout == "13000\n" and answer == "13000"


def test_the_cue_ends_the_question_with_its_numbers_and_changes_nothing_else():
    question, reasoning, steps, answer, operations = convert(DAVE, cue=True)
    assert question.endswith("? (The numbers: 9, 27 and 20.)")
    assert (question.removesuffix(" (The numbers: 9, 27 and 20.)"), reasoning, steps, answer, operations) == \
        convert(DAVE)
    assert convert(BRYAN, cue=True)[0].endswith("? (The numbers: 56 and 9.)")


def test_the_call_parses_back_and_runs_to_the_answer(sandbox):
    _, _, steps, answer, _ = convert(KENDRA)
    code = chain_code(steps)
    result = sandbox.run_batch([code])[0]
    assert result.status == "ok" and float(result.stdout) == pytest.approx(0.75) and answer == "0.75"
    msg = {"role": "assistant", "content": "r</reason>", "tool_call": {"code": code, "input": ""}}
    assert parse_tool_call(render_assistant_turn(msg)) == ToolCall(code, "")


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, CSV)), reason=f"{CSV} is not here (shared data)")
def test_the_script_holds_out_problems_and_writes_disjoint_sets_of_integer_answers(tmp_path):
    run = subprocess.run([sys.executable, "data/prepare_mawps.py", "--out", str(tmp_path), "--n-test", "300",
                          "--n-sft", "200", "--error-share", "0.5", "--multi-share", "0.6"], cwd=ROOT,
                         capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    read = {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
            for name in ("test", "train", "sft")}
    test, train = read["test"], read["train"]
    sft = [c["messages"][0]["content"] for c in read["sft"]]
    multi = [c for c in read["sft"] if "Then, " in c["messages"][1]["content"]]  # (the stepwise style)
    assert abs(len(multi) / len(sft) - 0.6) < 0.01, "--multi-share repeats conversations of two operations"
    assert all(c["messages"][1]["content"].startswith("First, ") for c in read["sft"])
    distinct = {json.dumps(c) for c in read["sft"]}
    assert 190 <= len(distinct) <= 200 < len(sft), "the repeats come on top of the converted problems"
    assert len(test) == 300 and len(train) > 1000
    sft = sorted(set(sft))
    questions = [p["question"] for p in test + train] + sft
    assert len(set(questions)) == len(questions), "held-out, RL and SFT problems must be disjoint"
    assert all(p["answer"].lstrip("-").isdigit() and p["steps"] >= 1 for p in test + train), \
        "RL and held-out problems have integer answers and record their operations"
    assert not any("number0" in q or " ?" in q for q in questions), "numbers unmasked, tokenization undone"
    fixed = sum(len(json.loads(c)["messages"]) > 4 for c in distinct)
    assert 0.3 < fixed / len(distinct) < 0.7, "about --error-share of the conversations fix a failing first call"
