"""data/prepare_{rl,eval,sft}.py: the integer filter, 8-gram decontamination, de-duplication, the SFT
conversions (rendered by rollout.render_messages), load_benchmark, and each script end to end
against a local stand-in for the datasets-server /rows API."""
import http.server
import json
import os
import sys
import threading
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
sys.path.append(os.path.join(ROOT, "data"))

import prepare_eval  # noqa: E402
import prepare_rl  # noqa: E402
import prepare_sft  # noqa: E402
from prepare_sft import Skip  # noqa: E402
from rollout import SYSTEM_PROMPT, TOOL_NAME, USER_PREFIX, parse_tool_call, render_assistant_turn, render_messages  # noqa: E402

# -----------------------------------------------------------------------------
# Integer answers


@pytest.mark.parametrize("raw, expected", [
    ("42", "42"), (" $42$ ", "42"), ("+7", "7"), ("-5", "-5"), ("\\boxed{12}", "12"), ("$\\boxed{12}$.", "12"),
    ("12.0", "12"), ("12.", "12"), ("1,000", "1000"), ("1{,}000", "1000"), ("1\\,000", "1000"), ("033", "33"),
    (12, "12"),
])
def test_integer_answers_are_kept_in_canonical_form(raw, expected):
    assert prepare_rl.integer_answer(raw) == (expected, "ok"), f"{raw!r} is an integer and should become {expected!r}"


@pytest.mark.parametrize("raw, reason", [
    ("\\frac{1}{2}", "not an integer"), ("3/4", "not an integer"), ("12.5", "not an integer"),
    ("2\\sqrt{2}", "not an integer"), ("x = 5", "not an integer"), ("5 cm", "not an integer"),
    ("1,2", "not an integer"), ("6.5e27330467", "not an integer"), ("", "empty answer"), ("$ $", "empty answer"),
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
    assert parse_tool_call(render_assistant_turn(turn)) == (turn["tool_call"]["code"], ""), "the call must parse back"
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
    ([("user", "q"), ("assistant", "use <|im_end|> here")], "contains chat special tokens"),
    ([("user", "q"), ("code", ("print('</tool_call>')", ""))], "tool call does not round-trip"),
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
                assert parsed == (m["tool_call"]["code"], m["tool_call"]["input"]), "a Python call must parse back"
            elif "<tool_call>" in m["content"]:
                assert "unknown tool" in parsed, "another function's call parses as JSON and is refused by name"
            else:
                assert parsed is None


# -----------------------------------------------------------------------------
# load_benchmark


def test_load_benchmark_reads_a_local_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "1+1?", "answer": 2}\n\n{"question": "2+2?", "answer": "4", "id": 7}\n')
    assert prepare_eval.load_benchmark(str(path)) == [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]


def test_load_benchmark_reads_the_cache_without_downloading(tmp_path):
    (tmp_path / "aime24.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    assert prepare_eval.load_benchmark("aime24", cache_dir=str(tmp_path), base_url="http://127.0.0.1:9") == \
        [{"question": "q", "answer": "1"}]


def test_load_benchmark_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)unknown benchmark 'aime2099'.*HINT"):
        prepare_eval.load_benchmark("aime2099")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "q"}\n')
    with pytest.raises(ValueError, match="(?s)bad.jsonl:1.*HINT"):
        prepare_eval.load_benchmark(str(bad))


# -----------------------------------------------------------------------------
# End to end against a local /rows server


class RowsServer:
    """Serves {(dataset, config, split): rows} like the datasets-server /rows endpoint; 404 otherwise."""

    def __init__(self, tables, truncated=()):
        tables, truncated, self.requests = tables, set(truncated), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                q = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).items()}
                server.requests.append(q)
                rows = tables.get((q.get("dataset"), q.get("config"), q.get("split")))
                if rows is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                start, length = int(q["offset"]), int(q["length"])
                assert length <= 100, "the API serves at most 100 rows a request"
                page = [{"row_idx": i, "row": rows[i], "truncated_cells": ["prompt"] if i in truncated else []}
                        for i in range(start, min(start + length, len(rows)))]
                body = json.dumps({"rows": page, "num_rows_total": len(rows)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hub():
    servers = []

    def start(tables, truncated=()):
        servers.append(RowsServer(tables, truncated))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def test_prepare_eval_then_prepare_rl_end_to_end(hub, tmp_path, capsys):
    bench = {name: [{"problem": f"{name} problem {i}: " + BENCH["aime24"][0]["question"] if i == 0 else f"{name} problem {i}",
                     "answer": str(i)} for i in range(3)] for name in prepare_eval.BENCHMARKS}
    tables = {(d, c, s): bench[name] for name, (d, c, s, *_) in prepare_eval.BENCHMARKS.items()}
    dapo = [{"prompt": f"What is {i} times 3?", "solution": str(3 * i)} for i in range(150)]  # two pages
    dapo += [{"prompt": "What is 1 times 3?", "solution": "3"},                   # duplicate
             {"prompt": "What is a half?", "solution": "\\frac{1}{2}"},           # not an integer
             {"prompt": BENCH["aime24"][0]["question"], "solution": "699"},       # contaminated
             {"prompt": "A cut-short row", "solution": "1"}]                      # truncated by the API
    tables["open-r1/DAPO-Math-17k-Processed", "en", "train"] = dapo
    server = hub(tables, truncated={len(dapo) - 1})
    eval_dir = tmp_path / "eval"

    prepare_eval.main(["--out-dir", str(eval_dir), "--hub-url", server.url])
    assert prepare_eval.load_benchmark("hmmt25", cache_dir=str(eval_dir)) == \
        [{"question": p["problem"], "answer": p["answer"]} for p in bench["hmmt25"]]

    out = tmp_path / "rl.jsonl"
    prepare_rl.main(["--out", str(out), "--eval-dir", str(eval_dir), "--hub-url", server.url])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"question": f"What is {i} times 3?", "answer": str(3 * i)} for i in range(150)]
    printed = capsys.readouterr().out
    for line in ("dapo: 154 rows, kept 150", "1  duplicate question", "1  not an integer", "1  overlaps aime24",
                 "1  cut short by the rows API"):
        assert line in printed, f"the summary must report {line!r}"
    assert sorted(int(r["offset"]) for r in server.requests if r["dataset"].startswith("open-r1")) == [0, 100]


def test_load_benchmark_downloads_a_missing_benchmark(hub, tmp_path):
    server = hub({("HuggingFaceH4/MATH-500", "default", "test"): [{"problem": "q", "answer": "\\frac{1}{2}", "level": 3}]})
    assert prepare_eval.load_benchmark("math500", str(tmp_path), base_url=server.url) == [{"question": "q", "answer": "\\frac{1}{2}"}]
    assert (tmp_path / "math500.jsonl").exists(), "the download is cached"


def test_prepare_rl_without_benchmarks_says_to_run_prepare_eval(tmp_path):
    with pytest.raises(SystemExit, match="prepare_eval.py"):
        prepare_rl.main(["--out", str(tmp_path / "rl.jsonl"), "--eval-dir", str(tmp_path / "nothing")])


def test_download_failure_names_the_source_and_what_to_do(hub, tmp_path):
    server = hub({})
    with pytest.raises(prepare_rl.FetchError, match="(?s)HuggingFaceH4/aime_2024.*url: .*HINT"):
        prepare_eval.load_benchmark("aime24", str(tmp_path), base_url=server.url)
    with pytest.raises(SystemExit, match="could not prepare aime25"):
        prepare_eval.main(["--benchmarks", "aime25", "--out-dir", str(tmp_path), "--hub-url", server.url])


def test_prepare_sft_end_to_end_reports_missing_sources(hub, tmp_path, capsys):
    tables = {("glaiveai/glaive-function-calling-v2", "default", "train"): [GLAIVE, {"system": "", "chat": "FUNCTION RESPONSE: 1"}],
              ("ise-uiuc/Magicoder-OSS-Instruct-75K", "default", "train"): [MAGICODER] * 3 + [dict(MAGICODER, lang="rust")],
              ("allenai/tulu-3-sft-personas-instruction-following", "default", "train"): [TULU]}
    server = hub(tables)
    out = tmp_path / "sft.jsonl"
    rows = prepare_sft.main(["--out", str(out), "--sources", "glaive", "magicoder", "tulu_if", "apigen",
                             "--max-per-source", "2", "--hub-url", server.url])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert len(rows) == 1 + 2 + 1, "glaive 1 (1 dropped), magicoder capped at 2, tulu 1, apigen failed"
    captured = capsys.readouterr()
    assert "glaive: kept 1" in captured.out and "1  tool result without a call" in captured.out
    assert "magicoder: kept 2" in captured.out
    assert "apigen: DOWNLOAD FAILED after 0 conversations" in captured.err and "Salesforce/APIGen-MT-5k" in captured.err and "HINT" in captured.err
    assert "missing sources: apigen" in captured.out
    with pytest.raises(SystemExit, match="--strict"):
        prepare_sft.main(["--out", str(out), "--sources", "tulu_if", "apigen", "--strict", "--hub-url", server.url])
    with pytest.raises(SystemExit, match="no conversations"):
        prepare_sft.main(["--out", str(out), "--sources", "apigen", "--hub-url", server.url])
