"""data/prepare_{rl,eval,sft}.py: the integer filter, 8-gram decontamination, de-duplication, the SFT
conversions (rendered by conversation.render_messages), and each script end to end on local JSONL and
parquet files with the real sources' columns, offline, with a library cache of the test's own."""
import json
import os
import subprocess
import sys

import pyarrow
import pyarrow.parquet
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
sys.path.append(os.path.join(ROOT, "data"))

import prepare_eval  # noqa: E402
import prepare_rl  # noqa: E402
import prepare_sft  # noqa: E402
from prepare_sft import Skip  # noqa: E402
from conversation import (SYSTEM_PROMPT, TOOL_NAME, USER_PREFIX, ToolCall, parse_tool_call, render_assistant_turn,  # noqa: E402
                          render_messages)

# -----------------------------------------------------------------------------
# Integer answers


@pytest.mark.parametrize("raw, expected", [
    ("42", "42"), (" $42$ ", "42"), ("+7", "7"), ("-5", "-5"), ("\\boxed{12}", "12"), ("$\\boxed{12}$.", "12"),
    ("12.0", "12"), ("12.", "12"), ("1,000", "1000"), ("1{,}000", "1000"), ("1\\,000", "1000"), ("033", "33"),
    (12, "12"), ("1 000", "1000"), ("\\(-3\\)", "-3"), ("0.00", "0"),
])
def test_integer_answers_are_kept_in_canonical_form(raw, expected):
    assert prepare_rl.integer_answer(raw) == (expected, "ok"), f"{raw!r} is an integer and should become {expected!r}"


@pytest.mark.parametrize("raw, reason", [
    ("\\frac{1}{2}", "not an integer"), ("3/4", "not an integer"), ("12.5", "not an integer"),
    ("2\\sqrt{2}", "not an integer"), ("x = 5", "not an integer"), ("5 cm", "not an integer"),
    ("1,2", "not an integer"), ("6.5e27330467", "not an integer"), ("", "empty answer"), ("$ $", "empty answer"),
    ("\\boxed{}", "empty answer"),
    ("1" * 21, "more than 20 digits"),
])
def test_non_integer_answers_are_rejected_with_a_reason(raw, reason):
    assert prepare_rl.integer_answer(raw) == (None, reason), f"{raw!r} must be rejected as {reason!r}"


def test_digit_cap_is_a_parameter():
    assert prepare_rl.integer_answer("123456", max_digits=5) == (None, "more than 5 digits")
    assert prepare_rl.integer_answer("-12345", max_digits=5) == ("-12345", "ok"), "the sign is not a digit"


# -----------------------------------------------------------------------------
# Normalisation, decontamination, de-duplication

BENCH = {"aime24": [{"question": "Let $N$ be the greatest four-digit positive integer with the property that whenever "
                                 "one of its digits is changed to $1$, the resulting number is divisible by $7$.",
                     "answer": "699"}],
         "math500": [{"question": "Compute $\\dbinom{16}{5}$.", "answer": "4368"}]}


def test_words_lowercase_and_strip_latex_punctuation():
    assert prepare_rl.words("Let $\\triangle ABC$ have \\left( x_1 \\right) and $\\dfrac{1}{2}$!") == \
        ["let", "triangle", "abc", "have", "x", "1", "and", "frac", "1", "2"]


def test_paraphrase_sharing_an_8gram_is_contaminated():
    grams = prepare_rl.benchmark_ngrams(BENCH)
    # reworded start and end; "one of its digits is changed to 1 the" survives (8 words), in other LaTeX
    q = "Find the largest number N such that if ONE of its digits is changed to \\(1\\), the result is a multiple of 7."
    assert prepare_rl.contamination(q, grams) == "aime24", "a shared 8-gram (after normalisation) must be caught"


def test_seven_word_overlap_is_not_contamination():
    grams = prepare_rl.benchmark_ngrams(BENCH)
    q = "Suppose one of its digits is changed to 3; what is the smallest such prime?"  # 7 shared words, then "3"
    assert prepare_rl.contamination(q, grams) is None, "only 7 consecutive words are shared: must be kept"


def test_different_problem_on_the_same_topic_is_kept():
    grams = prepare_rl.benchmark_ngrams(BENCH)
    q = "How many four-digit positive integers are divisible by 7 and have all digits equal to 1 or 7?"
    assert prepare_rl.contamination(q, grams) is None


def test_benchmark_problem_shorter_than_n_words_is_matched_whole():
    grams = prepare_rl.benchmark_ngrams(BENCH)
    assert prepare_rl.contamination("First, compute $\\binom{16}{5}$ and then add 3.", grams) == "math500"
    assert prepare_rl.contamination("Compute $\\binom{16}{6}$.", grams) is None


def test_clean_filters_dedups_and_decontaminates_with_counts_per_source():
    records = [
        {"question": "What is $2+2$?", "answer": "4", "source": "dapo"},
        {"question": "what  is $2 + 2$ ?", "answer": "4", "source": "openmath"},        # duplicate (normalised)
        {"question": "What is half of 3?", "answer": "\\frac{3}{2}", "source": "dapo"},  # not an integer
        {"question": BENCH["aime24"][0]["question"], "answer": "699", "source": "dapo"},  # a benchmark problem
        {"question": "How many primes are below 20?", "answer": "$8$", "source": "openmath"},
    ]
    kept, stats = prepare_rl.clean(records, prepare_rl.benchmark_ngrams(BENCH))
    assert kept == [{"question": "What is $2+2$?", "answer": "4"},
                    {"question": "How many primes are below 20?", "answer": "8"}], "first copy wins, answers canonical"
    assert stats == {("dapo", "kept"): 1, ("openmath", "duplicate question"): 1, ("dapo", "not an integer"): 1,
                     ("dapo", "overlaps aime24"): 1, ("openmath", "kept"): 1}


def test_dapo_instruction_wrapper_is_removed():
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 6*7?\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
    assert prepare_rl.from_dapo({"prompt": wrapped, "solution": "42"}) == ({"question": "What is 6*7?", "answer": "42"}, "ok")
    assert prepare_rl.from_dapo({"prompt": "What is 6*7?", "solution": "42"})[0]["question"] == "What is 6*7?"


def test_openmath_keeps_extracted_answers_a_strong_model_agreed_with():
    row = {"problem": "p", "expected_answer": "3", "problem_type": "has_answer_extracted", "pass_rate_72b_tir": "0.5"}
    assert prepare_rl.from_openmath(row) == ({"question": "p", "answer": "3"}, "ok")
    assert prepare_rl.from_openmath(dict(row, problem_type="converted_proof")) == (None, "no extracted answer")
    assert prepare_rl.from_openmath(dict(row, pass_rate_72b_tir="n/a")) == (None, "no pass rate")
    assert prepare_rl.from_openmath(dict(row, pass_rate_72b_tir="0.0625"))[0] is None


# -----------------------------------------------------------------------------
# SFT conversions

GLAIVE = {
    "system": 'SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n'
              '{\n    "name": "get_exchange_rate",\n    "description": "Get the exchange rate",\n    "parameters": '
              '{"type": "object", "properties": {"base": {"type": "string"}, "target": {"type": "string"}}}\n}\n',
    "chat": "USER: How many euros is one dollar?\n\n\nASSISTANT: <functioncall> {\"name\": \"get_exchange_rate\", "
            "\"arguments\": '{\"base\": \"USD\", \"target\": \"EUR\"}'} <|endoftext|>\n\n\nFUNCTION RESPONSE: "
            "{\"rate\": 0.92}\n\n\nASSISTANT: One dollar is 0.92 euros. <|endoftext|>\n\n\nUSER: Thanks!\n\n\n"
            "ASSISTANT: You're welcome! <|endoftext|>",
}
TOOLACE = {
    "system": "You are an expert in composing functions. Here is a list of functions in JSON format that you can "
              "invoke:\n[{\"name\": \"Weather\", \"description\": \"Weather of a city\", \"parameters\": {\"type\": "
              "\"dict\", \"properties\": {\"city\": {\"type\": \"string\"}}}}]. Should you decide to return the "
              "function call(s), put it in the format of [func1(params_name=params_value)]",
    "conversations": [{"from": "user", "value": "Weather in Paris and Rome?"},
                      {"from": "assistant", "value": "[Weather(city=\"Paris\"), Weather(city='Rome')]"},
                      {"from": "tool", "value": "[{\"temp\": 21}]"}, {"from": "tool", "value": "[{\"temp\": 25}]"},
                      {"from": "assistant", "value": "Paris is 21 degrees and Rome 25."}],
}
APIGEN = {
    "system": "# Retail agent policy\nAlways confirm before cancelling.",
    "tools": json.dumps([{"name": "cancel_order", "description": "Cancel an order",
                          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}]),
    "conversations": [{"from": "human", "value": "Cancel order #W1."},
                      {"from": "gpt", "value": "Do you confirm cancelling #W1?"},
                      {"from": "human", "value": "Yes."},
                      {"from": "function_call", "value": json.dumps({"name": "cancel_order", "arguments": {"order_id": "#W1"}})},
                      {"from": "observation", "value": "{\"status\": \"cancelled\"}"},
                      {"from": "gpt", "value": "Order #W1 is cancelled."}],
}
MAGICODER = {
    "lang": "python", "problem": "Write a function that returns the n-th Fibonacci number.",
    "solution": "Here is an iterative solution:\n\n```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                "        a, b = b, a + b\n    return a\n\nprint(fib(10))\n```\n\n"
                "It runs in O(n) time. For example:\n```python\nfib(3)\n```",
}
TULU = {"messages": [{"role": "user", "content": "Write a haiku about rain. Use no commas."},
                     {"role": "assistant", "content": "Soft rain on the roof\nwhispers to the sleeping town\nmorning comes washed clean"}]}
NEMOTRON = {"input": [{"role": "user", "content": "Give me a synonym for happy."}], "output": "Joyful.",
            "reasoning": "off", "system_prompt": "detailed thinking off"}


def call_in(content):
    """The JSON call written in an assistant message's text (non-code calls)."""
    return [json.loads(c) for c in content.split("<tool_call>\n")[1:] for c in [c.split("\n</tool_call>")[0]]]


def test_glaive_calls_become_tool_call_text_with_its_tools_in_the_system_prompt():
    msgs = prepare_sft.from_glaive(GLAIVE)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert '"name": "get_exchange_rate"' in msgs[0]["content"] and TOOL_NAME not in msgs[0]["content"], \
        "the system prompt must list the conversation's functions instead of the Python tool"
    spec = SYSTEM_PROMPT[SYSTEM_PROMPT.index("<tools>{") + 7:SYSTEM_PROMPT.index("}</tools>") + 1]
    assert msgs[0]["content"] == SYSTEM_PROMPT.replace(spec, json.dumps({"type": "function", "function": json.loads(
        GLAIVE["system"][GLAIVE["system"].index("{"):])})), "only the tool list differs from the RL system prompt"
    assert msgs[2]["content"].startswith("</reason>") and "tool_call" not in msgs[2], "a non-code call is text"
    assert call_in(msgs[2]["content"]) == [{"name": "get_exchange_rate", "arguments": {"base": "USD", "target": "EUR"}}]
    assert msgs[3] == {"role": "tool", "content": '{"rate": 0.92}'}
    assert msgs[4]["content"] == "</reason><answer>One dollar is 0.92 euros.</answer>"
    assert msgs[6]["content"] == "</reason><answer>You're welcome!</answer>", "<|endoftext|> must be stripped"
    plain = dict(GLAIVE, chat='USER: Rate?\n\n\nASSISTANT: <functioncall> {"name": "get_exchange_rate", "arguments": '
                              '{"base": "USD"}} <|endoftext|>\n\n\nFUNCTION RESPONSE: 1\n\n\nASSISTANT: 1.')
    assert call_in(prepare_sft.from_glaive(plain)[2]["content"]) == [{"name": "get_exchange_rate", "arguments": {"base": "USD"}}]
    no_tools = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
                "chat": "USER: Hi, the USER: field is empty\n\n\nASSISTANT: Fill it in. <|endoftext|>"}
    assert prepare_sft.from_glaive(no_tools) == [{"role": "user", "content": "Hi, the USER: field is empty"},
                                                 {"role": "assistant", "content": "</reason><answer>Fill it in.</answer>"}]


def test_toolace_bracket_calls_parallel_calls_and_results_are_merged_per_turn():
    msgs = prepare_sft.from_toolace(TOOLACE)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert "Should you decide" not in msgs[0]["content"], "ToolACE's own call-syntax instructions must be dropped"
    assert call_in(msgs[2]["content"]) == [{"name": "Weather", "arguments": {"city": "Paris"}},
                                          {"name": "Weather", "arguments": {"city": "Rome"}}]
    assert msgs[3]["content"] == '[{"temp": 21}]\n[{"temp": 25}]', "two results of one turn make one tool turn"



@pytest.mark.parametrize("text, calls", [
    ("[Get Stock Price(symbol='X', days=5)]", [("Get Stock Price", {"symbol": "X", "days": 5})]),
    ("[api.v2.search(q=\"a, b\", flags=[1, 2]), Ping()]", [("api.v2.search", {"q": "a, b", "flags": [1, 2]}), ("Ping", {})]),
    ("[f(q=\"x), g(\")]", None),           # a name-like piece inside a string must not become a call
    ("[f(x=g(1))]", None),                  # nested calls are not literal arguments
    ("[Note] this is prose, not calls]", None),
    ("[f(1)]", None),                       # positional arguments have no names to put in JSON
])
def test_toolace_bracket_call_parsing(text, calls):
    assert prepare_sft.bracket_calls(text) == calls


def test_apigen_keeps_the_policy_and_multi_turn_structure():
    msgs = prepare_sft.from_apigen(APIGEN)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    assert "Always confirm before cancelling." in msgs[0]["content"] and '"cancel_order"' in msgs[0]["content"]
    assert msgs[2]["content"] == "</reason><answer>Do you confirm cancelling #W1?</answer>"
    assert call_in(msgs[4]["content"]) == [{"name": "cancel_order", "arguments": {"order_id": "#W1"}}]


def test_magicoder_code_becomes_a_python_tool_call_that_round_trips():
    msgs = prepare_sft.from_magicoder(MAGICODER)
    assert [m["role"] for m in msgs] == ["user", "assistant"], "no system message: the default prompt lists the Python tool"
    turn = msgs[1]
    assert turn["content"] == "Here is an iterative solution:</reason>", "the explanation before the code is the reasoning"
    assert turn["tool_call"]["code"].startswith("def fib(n):") and "print(fib(10))" in turn["tool_call"]["code"], \
        "the longest python block is the call"
    assert parse_tool_call(render_assistant_turn(turn)) == ToolCall(turn["tool_call"]["code"], ""), "the call must parse back"
    assert turn["tool_call"]["tool"] == "python", "a call in SFT data names its tool in TOOLS"
    with pytest.raises(Skip, match="not Python"):
        prepare_sft.from_magicoder(dict(MAGICODER, lang="cpp"))
    with pytest.raises(Skip, match="no Python code block"):
        prepare_sft.from_magicoder(dict(MAGICODER, solution="Use a loop."))


def test_instruction_following_and_chat_become_plain_answers():
    assert prepare_sft.from_tulu(TULU) == [
        {"role": "user", "content": TULU["messages"][0]["content"]},
        {"role": "assistant", "content": f"</reason><answer>{TULU['messages'][1]['content']}</answer>"}]
    assert prepare_sft.from_nemotron_chat(NEMOTRON)[1]["content"] == "</reason><answer>Joyful.</answer>"
    old = dict(NEMOTRON, input="<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nGive me a synonym.<|eot_id|>")
    assert prepare_sft.from_nemotron_chat(old)[0] == {"role": "user", "content": "Give me a synonym."}
    with pytest.raises(Skip, match="reasoning on"):
        prepare_sft.from_nemotron_chat(dict(NEMOTRON, reasoning="on"))


@pytest.mark.parametrize("steps, reason", [
    ([("user", "q"), ("result", "42")], "tool result without a call"),
    ([("user", "q"), ("call", ("f", {})), ("result", "1"), ("user", "again")], "user turn right after a tool result"),
    ([("user", "q"), ("code", ("print(1)", None))], "tool call does not round-trip"),
    ([("user", "q")], "not user ... assistant"),
    ([("assistant", "hi"), ("user", "q")], "not user ... assistant"),
])
def test_records_that_do_not_fit_are_skipped_with_a_reason(steps, reason):
    with pytest.raises(Skip, match=reason):
        prepare_sft.build(steps)


def make_tokenizer(texts):
    """A byte-level BPE tokenizer with the ChatML specials, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_every_converted_record_renders_and_its_calls_parse_back():
    converted = [prepare_sft.from_glaive(GLAIVE), prepare_sft.from_toolace(TOOLACE), prepare_sft.from_apigen(APIGEN),
                 prepare_sft.from_magicoder(MAGICODER), prepare_sft.from_tulu(TULU), prepare_sft.from_nemotron_chat(NEMOTRON)]
    tokenizer = make_tokenizer([json.dumps(m) for m in converted] + [SYSTEM_PROMPT, USER_PREFIX])
    for msgs in converted:
        ids, loss_mask = render_messages(tokenizer, msgs)
        text = tokenizer.decode(ids)
        assistant = [m for m in msgs if m["role"] == "assistant"]
        assert text.count("<|im_start|>assistant\n<reason>") == len(assistant), "one opened assistant turn per assistant message"
        trained = tokenizer.decode([i for i, m in zip(ids, loss_mask) if m])
        assert trained == "".join(render_assistant_turn(m) for m in assistant), "loss only (and all) on assistant text"
        for m in assistant:
            parsed = parse_tool_call(render_assistant_turn(m))
            if "tool_call" in m:
                assert parsed == ToolCall(m["tool_call"]["code"], m["tool_call"]["input"]), "a Python call must parse back"
            elif "<tool_call>" in m["content"]:
                assert "unknown tool" in parsed.error, "another function's call parses as JSON and is refused by name"
            else:
                assert parsed is None


# -----------------------------------------------------------------------------
# End to end: each script as a command on local files. A subprocess, because the datasets library
# reads HF_DATASETS_OFFLINE and its cache location from the environment when it is imported.


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network for the library, and a cache under tmp_path instead of the user's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))


def run(script, *args):
    """`python data/<script> args...` in the test's environment: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "data", script), *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_benchmarks(tmp_path):
    """The four benchmarks in their hub columns (problem, answer, and one more), two as parquet;
    each benchmark's first problem is the AIME problem of BENCH. Returns the --local arguments."""
    files = []
    for k, name in enumerate(prepare_eval.BENCHMARKS):
        rows = [{"problem": f"{name} problem {i}", "answer": str(i), "id": i} for i in range(3)]
        rows[0]["problem"] = f"{name}: " + BENCH["aime24"][0]["question"]
        if k % 2:
            files.append(f"{name}={write_parquet(tmp_path / f'{name}.parquet', rows)}")
        else:
            files.append(f"{name}={write_jsonl(tmp_path / f'{name}.jsonl', rows)}")
    return files


def test_prepare_eval_then_prepare_rl_on_local_files(offline, tmp_path):
    eval_dir = tmp_path / "eval"
    local = write_benchmarks(tmp_path)
    code, out, err = run("prepare_eval.py", "--out-dir", eval_dir, "--local", *local)
    assert code == 0, err
    for name in prepare_eval.BENCHMARKS:
        problems = read_jsonl(eval_dir / f"{name}.jsonl")
        assert [p["answer"] for p in problems] == ["0", "1", "2"] and set(problems[0]) == {"question", "answer"}, \
            f"{name}: every row as {{question, answer}}, answers as strings, other columns dropped"
        assert f"{name}: 3 problems from {tmp_path / name}." in out
    assert "warning: math500 has 3 problems, not 500" in out, "a count unlike the real set's must be flagged"
    assert any((tmp_path / "hf" / "datasets").iterdir()), "the library's cache must be the test's own"

    code, out, err = run("prepare_eval.py", "--out-dir", eval_dir)  # offline, no --local: any read would fail
    assert code == 0 and out.count("problems already in") == 4, "existing files are kept without --force"

    dapo = [{"prompt": f"What is {i} times 3?", "solution": str(3 * i), "data_source": "x"} for i in range(150)]
    dapo += [{"prompt": "What is 1 times 3?", "solution": "3", "data_source": "x"},                # duplicate
             {"prompt": "What is a half?", "solution": "\\frac{1}{2}", "data_source": "x"},        # not an integer
             {"prompt": BENCH["aime24"][0]["question"], "solution": "699", "data_source": "x"},  # contaminated
             {"prompt": "What is nothing?", "solution": "", "data_source": "x"}]                   # empty answer
    openmath = [dict(problem="How many sides has a square?", expected_answer="4"),
                dict(problem="Prove it.", expected_answer="", problem_type="converted_proof"),
                dict(problem="How many sides has a pentagon?", expected_answer="5", pass_rate_72b_tir="0.0625"),
                dict(problem="How many sides has a hexagon?", expected_answer="6", pass_rate_72b_tir="n/a"),
                dict(problem="What is 2 times 3?", expected_answer="6"),                           # in DAPO already
                dict(problem="How many grams in a kilogram?", expected_answer="1{,}000"),
                dict(problem="Beyond --openmath-rows: never read", expected_answer="7")]
    openmath = [dict(dict(problem_type="has_answer_extracted", pass_rate_72b_tir="0.5", generated_solution="..."), **r)
                for r in openmath]
    out_file = tmp_path / "rl.jsonl"
    code, out, err = run("prepare_rl.py", "--out", out_file, "--eval-dir", eval_dir, "--openmath-rows", 6,
                         "--local", f"dapo={write_jsonl(tmp_path / 'dapo.jsonl', dapo)}",
                         f"openmath={write_parquet(tmp_path / 'openmath.parquet', openmath)}")
    assert code == 0, err
    assert read_jsonl(out_file) == [{"question": f"What is {i} times 3?", "answer": str(3 * i)} for i in range(150)] + [
        {"question": "How many sides has a square?", "answer": "4"},
        {"question": "How many grams in a kilogram?", "answer": "1000"}], "kept problems, in order, answers canonical"
    for line in ("dapo: 154 rows, kept 150", "1  duplicate question", "1  not an integer", "1  overlaps aime24",
                 "1  empty answer", "openmath: 6 rows, kept 2", "1  no extracted answer", "1  pass rate < 0.125",
                 "1  no pass rate", "wrote 152 problems"):
        assert line in out, f"the summary must report {line!r}:\n{out}"


def test_prepare_eval_names_each_failed_benchmark_and_what_to_do(offline, tmp_path):
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"question": "q", "solution": "1"}])
    code, out, err = run("prepare_eval.py", "--out-dir", tmp_path / "eval", "--benchmarks", "aime24", "aime25", "hmmt25",
                         "--local", f"aime24={tmp_path / 'missing.jsonl'}", f"hmmt25={renamed}")
    assert code != 0 and "could not prepare aime24, aime25, hmmt25" in err
    failures = {line.split(":")[0]: line for line in err.split("\n") if ": FAILED to read" in line}
    assert "missing.jsonl" in failures["aime24"] and "MathArena/aime_2025" in failures["aime25"] \
        and "renamed.jsonl" in failures["hmmt25"], f"each failure must name the benchmark and its source:\n{err}"
    hints = [line for line in err.split("\n") if line.startswith("---> HINT:")]
    assert len(hints) == 3, err
    assert "--local aime25=FILE" in hints[1] and "HF_DATASETS_OFFLINE" in hints[1], "no network: offline cache or a file"
    assert "problem and answer" in hints[2] and "BENCHMARKS" in hints[2], "a renamed column: which columns, where to fix"
    assert not (tmp_path / "eval").exists(), "nothing is written for a failed benchmark"


def test_prepare_rl_without_benchmarks_says_to_run_prepare_eval(tmp_path):
    with pytest.raises(SystemExit, match="prepare_eval.py"):
        prepare_rl.main(["--out", str(tmp_path / "rl.jsonl"), "--eval-dir", str(tmp_path / "nothing")])


def test_prepare_rl_failure_names_the_source_and_what_to_do(offline, tmp_path):
    write_jsonl(tmp_path / "b.jsonl", BENCH["aime24"])
    args = ["--out", tmp_path / "rl.jsonl", "--benchmarks", tmp_path / "b.jsonl"]
    code, out, err = run("prepare_rl.py", *args)  # the hub, offline and nothing cached
    assert code != 0 and "dapo: could not read open-r1/DAPO-Math-17k-Processed" in err
    assert "---> HINT:" in err and "--local dapo=FILE" in err, err
    renamed = write_parquet(tmp_path / "dapo.parquet", [{"problem": "What is 1+1?", "answer": "2"}])
    code, out, err = run("prepare_rl.py", *args, "--local", f"dapo={renamed}")
    assert code != 0 and f"dapo: could not read {renamed}" in err
    assert "---> HINT:" in err and "the columns prompt, solution" in err, err
    assert not (tmp_path / "rl.jsonl").exists()


def test_prepare_sft_on_local_files_reports_counts_and_missing_sources(offline, tmp_path):
    local = [f"glaive={write_jsonl(tmp_path / 'glaive.jsonl', [GLAIVE, {'system': '', 'chat': 'FUNCTION RESPONSE: 1'}])}",
             f"magicoder={write_parquet(tmp_path / 'magicoder.parquet', [MAGICODER] * 3 + [dict(MAGICODER, lang='rust')])}",
             f"tulu_if={write_jsonl(tmp_path / 'tulu.jsonl', [TULU])}",
             f"chat={write_jsonl(tmp_path / 'chat.jsonl', [NEMOTRON, dict(NEMOTRON, reasoning='on')])}"]
    out_file = tmp_path / "sft.jsonl"
    code, out, err = run("prepare_sft.py", "--out", out_file, "--sources", "glaive", "magicoder", "tulu_if", "chat",
                         "apigen", "--max-per-source", 2, "--local", *local)
    assert code == 0, err
    rows = read_jsonl(out_file)
    assert rows == [{"messages": m} for m in [prepare_sft.from_glaive(GLAIVE)] + [prepare_sft.from_magicoder(MAGICODER)] * 2
                    + [prepare_sft.from_tulu(TULU), prepare_sft.from_nemotron_chat(NEMOTRON)]], \
        "glaive 1 (1 dropped), magicoder capped at 2, tulu 1, chat 1 (streamed; 1 dropped), apigen failed"
    for line in ("glaive: kept 1", "1  tool result without a call", "magicoder: kept 2", "tulu_if: kept 1",
                 "chat: kept 1", "1  reasoning on", "apigen: kept 0  (failed", "missing sources: apigen"):
        assert line in out, f"the summary must report {line!r}:\n{out}"
    assert "apigen: FAILED after 0 conversations" in err and "Salesforce/APIGen-MT-5k" in err
    assert "---> HINT:" in err and "--local apigen=FILE" in err, err

    code, out, err = run("prepare_sft.py", "--out", out_file, "--sources", "tulu_if", "apigen", "--strict",
                         "--local", local[2])
    assert code != 0 and "--strict: 1 source(s) failed" in err
    code, out, err = run("prepare_sft.py", "--out", tmp_path / "none.jsonl", "--sources", "magicoder",
                         "--local", f"magicoder={tmp_path / 'missing.parquet'}")
    assert code != 0 and "no conversations" in err and "missing.parquet must exist" in err


# -----------------------------------------------------------------------------
# Without network: the hub asked once, every script saying so at once (data/hub.py)

@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """A hub that refuses every connection (a closed local port), not offline by choice, and a cache
    of the test's own: what a machine without network sees, without needing one."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again when the block ends: connections are refused)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))


def test_the_hub_is_found_unreachable_within_the_timeout_whether_refused_or_silent(no_hub, monkeypatch):
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import hub
    start = time.monotonic()
    refused = hub.unreachable(timeout=2.0)
    assert refused and "cannot be reached" in refused and time.monotonic() - start < 2.5, refused
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        why = hub.unreachable(timeout=2.0)
        assert why and "did not answer within 2 s" in why and time.monotonic() - start < 3.0, why
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert hub.unreachable(timeout=2.0) is None, "offline by choice: the cache is read, the hub not asked"
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # (it wins over HF_HUB_OFFLINE, as in datasets)
        assert not hub.offline()

    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("HF_DATASETS_OFFLINE")
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert hub.unreachable(timeout=2.0) is None, "a hub that answers, whatever the status, is reachable"
    finally:
        server.shutdown()


def test_without_network_each_script_says_so_once_at_once_and_what_to_do(no_hub, tmp_path):
    local = write_benchmarks(tmp_path)
    code, out, err = run("prepare_eval.py", "--out-dir", tmp_path / "eval",
                         "--benchmarks", "aime24", "aime25", "hmmt25", "--local", local[0])
    assert code != 0 and "aime24: 3 problems" in out, "a benchmark on disk is still written"
    failures = [line for line in err.split("\n") if ": FAILED to read" in line]
    assert len(failures) == 2 and all("cannot be reached" in f for f in failures), err
    assert "--local hmmt25=FILE" in err and err.count("HF_HUB_OFFLINE=1") == 2, err

    write_jsonl(tmp_path / "b.jsonl", BENCH["aime24"])
    code, out, err = run("prepare_rl.py", "--out", tmp_path / "rl.jsonl",
                         "--benchmarks", tmp_path / "b.jsonl")
    assert code != 0 and "dapo: cannot read from the hub" in err and "dapo: reading" not in out, err
    assert "--local dapo=FILE" in err and "HF_HUB_OFFLINE=1" in err, err

    tulu = f"tulu_if={write_jsonl(tmp_path / 'tulu.jsonl', [TULU])}"
    code, out, err = run("prepare_sft.py", "--out", tmp_path / "sft.jsonl", "--sources", "tulu_if", "toolace",
                         "glaive", "--local", tulu)
    assert code == 0 and "tulu_if: kept 1" in out and "missing sources: toolace, glaive" in out, out + err
    assert "toolace: reading" not in out and "glaive: reading" not in out, "no hub source is tried"
    assert err.count("cannot be reached") == 2 and "--local glaive=FILE" in err and "HF_HUB_OFFLINE=1" in err

    code, out, err = run("prepare_gsm8k.py", "--out", tmp_path / "gsm8k")
    assert code != 0 and "gsm8k: cannot read openai/gsm8k from the hub" in err and "cannot be reached" in err, err
    assert "--local gsm8k=FILE" in err and "HF_HUB_OFFLINE=1" in err, err
