"""The non-reasoning SFT mix (paper §4.1) as sft.py's {"messages": [...]} JSONL.

    python data/prepare_sft.py                        # every source at the paper's size -> data/sft.jsonl
    python data/prepare_sft.py --max-per-source 2000  # a small mix
    python data/prepare_sft.py --sources glaive magicoder --strict
    python data/prepare_sft.py --local glaive=glaive.json   # a copy of a source on disk

Sources (datasets.load_dataset; --local NAME=PATH reads a JSONL or parquet file with the same
columns instead), at most --max-per-source each:
    toolace    Team-ACE/ToolACE                                  function calls ([f(a=1)] syntax)
    apigen     Salesforce/APIGen-MT-5k (gated: HF_TOKEN)         multi-turn function calls
    glaive     glaiveai/glaive-function-calling-v2               function calls (<functioncall> syntax)
    magicoder  ise-uiuc/Magicoder-OSS-Instruct-75K (Python only) code -> the Python tool
    tulu_if    allenai/tulu-3-sft-personas-instruction-following instruction following
    chat       nvidia/Llama-Nemotron-Post-Training-Dataset (SFT/chat, reasoning off; streamed: the
               SFT config holds millions of rows of other splits)
The paper also rewrote the IF responses and the chat prompts with o4-mini; we use them as released.
Downloads are cached by the library (HF_HOME or HF_DATASETS_CACHE say where); HF_HUB_OFFLINE=1
reads only that cache; HF_TOKEN is used if set. Whether the hub answers is asked once, before the
first source read from it (data/hub.py): without network every hub source fails at once.

How a record becomes messages (conversation.render_messages renders them):
1. Every assistant turn opens inside <reason> (the template adds it). This data has no reasoning, so
   a final reply is "</reason><answer>REPLY</answer>"; a turn that calls a tool keeps any text before
   the call as its reasoning and closes </reason> before the call (as the toy SFT data does).
2. Code: Magicoder's Python solution becomes a call of the single tool, after the explanation that
   precedes it: "tool_call": tool_call("python", code=..., input="") (conversation.py). The conversation
   ends at the call: we do not run the code, and we will not invent an output for it.
3. Other function calls are KEPT, written as plain assistant text in the very format of the Python
   tool's call (conversation.function_call_pieces writes both:
   "\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>"), with the conversation's
   own functions listed in the system prompt's <tools> block and their results as tool turns. They
   are the paper's 117K function-calling examples: they teach the JSON call format and when to call,
   which the Python tool needs; at RL time the prompt lists only the Python tool and
   parse_tool_call refuses any other name.
A record that does not fit (unreadable call, a result without a call, ...) is dropped and counted.
Sources that cannot be read are reported at the end with what to do; the script fails only when
nothing was read, or with --strict when any source failed.
"""
import argparse
import ast
import json
import os
import re
import sys
from collections import Counter

from datasets import load_dataset
from datasets.exceptions import DatasetsError

import hub

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conversation import (SYSTEM_PROMPT, TOOLS, ToolCall, function_call_pieces, parse_tool_call,  # noqa: E402
                          render_assistant_turn, tool_call)


class Skip(Exception):
    """A record that cannot be converted; the message is the reason that gets counted."""


# -----------------------------------------------------------------------------
# Building conversations. A converter describes a record as steps: ("system", text),
# ("user", text), ("assistant", text), ("call", (name, arguments)), ("code", (code, stdin)),
# ("result", text); build() turns them into messages.

def system_prompt(tools=None, instructions=""):
    """SYSTEM_PROMPT with the record's instructions before its tool block and, if given, its own
    functions in the <tools> block instead of the Python tool."""
    head, sep, tail = SYSTEM_PROMPT.partition("# Tools")
    if tools:
        specs = [t if "function" in t else {"type": "function", "function": t} for t in tools]
        listed = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
        tail = re.sub(r"<tools>\{.*?\}</tools>", lambda m: f"<tools>{listed}</tools>", tail, count=1,
                      flags=re.DOTALL)
    return head + (instructions.strip() + "\n\n" if instructions.strip() else "") + sep + tail


def build(steps, tools=None):
    """Steps -> messages: text before a call is that turn's reasoning, consecutive calls make one
    turn, consecutive results one tool turn, text not followed by a call is a final reply. A system
    message is added only for records with their own tools or instructions. Raises Skip."""
    msgs, instructions, text, calls = [], [], [], []

    def close_turn():
        thought = "\n\n".join(t.strip() for t in text if t and t.strip())
        if any(kind == "code" for kind, _ in calls):
            if len(calls) > 1:
                raise Skip("code call mixed with other calls")
            code, stdin = calls[0][1]
            msgs.append({"role": "assistant", "content": thought + "</reason>",
                         "tool_call": tool_call("python", code=code, input=stdin)})
        elif calls:
            written = "".join("".join(function_call_pieces(name, arguments)) for _, (name, arguments) in calls)
            msgs.append({"role": "assistant", "content": thought + "</reason>" + written})
        elif thought:
            if "<tool_call>" in thought:
                raise Skip("reply text contains <tool_call>")
            msgs.append({"role": "assistant", "content": f"</reason><answer>{thought}</answer>"})
        text.clear()
        calls.clear()

    for kind, value in steps:
        if kind == "system":
            instructions.append(value or "")
        elif kind == "user":
            close_turn()
            if msgs and msgs[-1]["role"] == "tool":
                raise Skip("user turn right after a tool result")
            if msgs and msgs[-1]["role"] == "user":
                msgs[-1]["content"] += "\n\n" + value
            else:
                msgs.append({"role": "user", "content": value})
        elif kind == "assistant":
            if calls:
                raise Skip("text after a call in the same turn")
            text.append(value)
        elif kind in ("call", "code"):
            calls.append((kind, value))
        elif kind == "result":
            if calls:
                close_turn()
                msgs.append({"role": "tool", "content": value})
            elif not text and msgs and msgs[-1]["role"] == "tool":
                msgs[-1]["content"] += "\n" + value
            else:
                raise Skip("tool result without a call")
    close_turn()
    if not msgs or msgs[0]["role"] != "user" or msgs[-1]["role"] != "assistant":
        raise Skip("not user ... assistant")
    for m in msgs:  # the tool call must parse back exactly: into the program its own arguments make
        if (call := m.get("tool_call")) is None:
            continue
        arguments = {name: value for name, value in call.items() if name != "tool"}
        program = ToolCall(*TOOLS[call["tool"]].program(arguments))
        if parse_tool_call(render_assistant_turn(m), (call["tool"],)) != program:
            raise Skip("tool call does not round-trip")
    if tools or any(i.strip() for i in instructions):
        msgs.insert(0, {"role": "system", "content": system_prompt(tools, "\n\n".join(instructions))})
    return msgs


def chat_steps(messages):
    """[{"role", "content"}] (user / assistant / system) -> steps."""
    steps = []
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise Skip(f"unexpected message role {m.get('role')!r}")
        steps.append((m["role"], m["content"]))
    return steps


def json_objects(text):
    """Consecutive JSON values in text (Glaive lists its functions one object after another)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) >= 0:
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


# -----------------------------------------------------------------------------
# Sources: one converter per record format.

_GLAIVE_CALL = re.compile(r"""\{\s*"name":\s*"([^"]+)",\s*"arguments":\s*'(.*)'\s*\}""", re.DOTALL)


def from_glaive(row):
    """system: "SYSTEM: ... -\\n{function}\\n{function}"; chat: "USER: ... ASSISTANT: ... <functioncall>
    {"name": ..., "arguments": '<json>'} <|endoftext|> FUNCTION RESPONSE: ... ASSISTANT: ..."."""
    try:
        tools = json_objects(row["system"])
    except ValueError:
        raise Skip("unreadable tool list") from None
    parts = re.split(r"(?m)^\s*(USER|ASSISTANT|FUNCTION RESPONSE):", row["chat"])
    steps = []
    for role, body in zip(parts[1::2], parts[2::2]):
        body = body.replace("<|endoftext|>", "").strip()
        if role == "USER":
            steps.append(("user", body))
        elif role == "FUNCTION RESPONSE":
            steps.append(("result", body))
        else:
            before, has_call, call = body.partition("<functioncall>")
            steps.append(("assistant", before))
            if has_call:
                m = _GLAIVE_CALL.fullmatch(call.strip())
                try:
                    c = {"name": m.group(1), "arguments": m.group(2)} if m else json.loads(call)
                    args = json.loads(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"]
                    steps.append(("call", (c["name"], args)))
                except (ValueError, KeyError, TypeError):
                    raise Skip("unreadable call") from None
    return build(steps, tools)


_CALL_NAME = re.compile(r"(\[|\)\s*,\s*)([A-Za-z_][^()\[\]=,'\"]*?)\s*\(")


def bracket_calls(text):
    """ToolACE's "[f(a=1, b='x'), Get Stock Price(symbol='X')]" -> [(name, arguments)], or None if
    text is not such a list. Names may contain spaces, so they are swapped for stand-ins before
    Python parses the list; a stand-in that lands inside an argument string leaves a count mismatch."""
    names = []

    def stand_in(m):
        names.append(m.group(2).strip())
        return f"{m.group(1)}_f{len(names) - 1}("
    try:
        tree = ast.parse(_CALL_NAME.sub(stand_in, text.strip()), mode="eval").body
        if not isinstance(tree, ast.List) or not names or len(tree.elts) != len(names):
            return None
        calls = []
        for i, c in enumerate(tree.elts):
            if (not isinstance(c, ast.Call) or c.args or not isinstance(c.func, ast.Name)
                    or c.func.id != f"_f{i}"):
                return None
            calls.append((names[i], {k.arg: ast.literal_eval(k.value) for k in c.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError):
        return None


def from_toolace(row):
    """system: instructions for its own call syntax (dropped) and a JSON list of functions;
    conversations: [{"from": user | assistant | tool, "value"}]."""
    system = row.get("system") or ""
    start = re.search(r"\[\s*\{", system)
    try:
        tools, _ = json.JSONDecoder().raw_decode(system, start.start())
    except (AttributeError, ValueError):
        raise Skip("unreadable tool list") from None
    steps = []
    for turn in row["conversations"]:
        who, value = turn["from"], turn["value"]
        if who == "assistant" and value.strip().startswith("[") and value.strip().endswith("]"):
            calls = bracket_calls(value)
            if calls is None:
                raise Skip("unreadable call")
            steps += [("call", c) for c in calls]
        elif who in ("user", "assistant", "tool"):
            steps.append(({"tool": "result"}.get(who, who), value))
        else:
            raise Skip("unexpected speaker")
    return build(steps, tools)


def from_apigen(row):
    """ShareGPT-style: conversations [{"from": human | gpt | function_call | observation, "value"}],
    tools (a JSON string), system (the domain policy: kept as instructions)."""
    tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
    steps = [("system", row.get("system") or "")]
    for turn in row["conversations"]:
        who, value = turn["from"], turn["value"]
        if who == "function_call":
            c = json.loads(value) if isinstance(value, str) else value
            steps.append(("call", (c["name"], c.get("arguments", {}))))
        elif who in ("human", "gpt", "observation"):
            steps.append(({"human": "user", "gpt": "assistant", "observation": "result"}[who], value))
        else:
            raise Skip("unexpected speaker")
    return build(steps, tools)


def from_magicoder(row):
    """problem, solution (markdown with code blocks), lang: the longest ```python block is the call."""
    if row.get("lang") != "python":
        raise Skip("not Python")
    blocks = list(re.finditer(r"```(?:python|py)[ \t]*\n(.*?)```", row["solution"], re.DOTALL))
    if not blocks:
        raise Skip("no Python code block")
    best = max(blocks, key=lambda m: len(m.group(1)))
    return build([("user", row["problem"]), ("assistant", row["solution"][:best.start()]),
                  ("code", (best.group(1).rstrip() + "\n", ""))])


def from_tulu(row):
    """messages: [{"role", "content"}]."""
    return build(chat_steps(row["messages"]))


_LLAMA_TURN = re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\s*(.*?)\s*"
                         r"(?=<\|eot_id\|>|<\|start_header_id\|>|$)", re.DOTALL)


def from_nemotron_chat(row):
    """input (messages, or a string in the Llama-3 chat format in older releases), output, reasoning."""
    if row.get("reasoning") != "off":
        raise Skip("reasoning on")
    inp = row["input"]
    if isinstance(inp, str):
        turns = [{"role": r, "content": c} for r, c in _LLAMA_TURN.findall(inp)]
        inp = turns or [{"role": "user", "content": inp}]
    inp = [m for m in inp if not (m.get("role") == "system" and "detailed thinking" in m.get("content", ""))]
    output = re.sub(r"^\s*<think>.*?</think>", "", row["output"], flags=re.DOTALL).replace("<|eot_id|>", "")
    return build(chat_steps(inp) + [("assistant", output)])


# name: (dataset, config, split, columns, streamed, paper's count (§4.1; None = all), converter)
SOURCES = {
    "toolace": ("Team-ACE/ToolACE", "default", "train",
                ["system", "conversations"], False, None, from_toolace),
    "apigen": ("Salesforce/APIGen-MT-5k", "default", "train",
               ["system", "tools", "conversations"], False, None, from_apigen),
    "glaive": ("glaiveai/glaive-function-calling-v2", "default", "train",
               ["system", "chat"], False, 101_000, from_glaive),
    "magicoder": ("ise-uiuc/Magicoder-OSS-Instruct-75K", "default", "train",
                  ["lang", "problem", "solution"], False, 48_000, from_magicoder),
    "tulu_if": ("allenai/tulu-3-sft-personas-instruction-following", "default", "train",
                ["messages"], False, 30_000, from_tulu),
    "chat": ("nvidia/Llama-Nemotron-Post-Training-Dataset", "SFT", "chat",
             ["input", "output", "reasoning"], True, 27_000, from_nemotron_chat),
}


def failure_hint(error, name, source):
    """What to do when a source cannot be read."""
    dataset, columns = SOURCES[name][0], SOURCES[name][3]
    if "gated" in str(error).lower():
        return f"accept its terms on https://huggingface.co/datasets/{dataset}, export HF_TOKEN=<read token>"
    if isinstance(error, ConnectionError):  # no network, or HF_DATASETS_OFFLINE=1 with nothing cached
        return (f"no network: --local {name}=FILE reads a copy on disk, HF_DATASETS_OFFLINE=1 what an "
                f"earlier run cached; or leave the source out (--sources)")
    return f"{source} must exist and have the columns {', '.join(columns)} (SOURCES in data/prepare_sft.py)"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build the non-reasoning SFT mix as {messages} JSONL.")
    parser.add_argument("--out", default="data/sft.jsonl", help='output JSONL of {"messages": [...]}')
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES),
                        help="which sources to include")
    parser.add_argument("--max-per-source", type=int, default=None,
                        help="keep at most this many conversations per source (default: the paper's counts)")
    parser.add_argument("--strict", action="store_true", help="exit non-zero if any source could not be read")
    parser.add_argument("--local", nargs="+", default=[], metavar="NAME=PATH",
                        help="read source NAME from a local JSONL or parquet file with the hub set's columns")
    args = parser.parse_args(argv)
    local = dict(item.partition("=")[::2] for item in args.local)
    if bad := [k for k, path in local.items() if k not in SOURCES or not path]:
        parser.error(f"--local takes NAME=PATH with NAME one of {', '.join(SOURCES)}, not {', '.join(bad)}")

    conversations, failed, hub_down = [], {}, None  # (whether the hub answers is asked once)
    for name in args.sources:
        dataset, config, split, columns, streaming, paper_count, convert = SOURCES[name]
        cap = min(n for n in (paper_count, args.max_per_source, float("inf")) if n is not None)
        file = local.get(name)
        source = file or f"{dataset} ({config}/{split})"
        kept, dropped = 0, Counter()
        if not file and hub_down is None:
            hub_down = hub.unreachable() or ""
        if not file and hub_down:
            failed[name] = f"{name}: FAILED: {hub_down}\n---> HINT: {hub.hint(f'--local {name}=FILE')}"
            print(f"{name}: not read (failed, see the end)")
            continue
        print(f"{name}: reading {source} ...", flush=True)
        try:
            if file:  # load_dataset("json" | "parquet", data_files=...) reads a file as it reads a hub set
                kind = "parquet" if file.endswith(".parquet") else "json"
                rows = load_dataset(kind, data_files=file, split="train", streaming=streaming)
            else:
                rows = load_dataset(dataset, config, split=split, streaming=streaming)
            for row in rows.select_columns(columns):
                if kept >= cap:
                    break
                try:
                    conversations.append({"messages": convert(row)})
                    kept += 1
                except Skip as e:
                    dropped[str(e)] += 1
                except (KeyError, TypeError, ValueError) as e:  # a malformed record is one drop, not a crash
                    detail = f": {e}" if isinstance(e, KeyError) else ""
                    dropped[f"malformed record ({type(e).__name__}{detail})"] += 1
        except (OSError, ValueError, DatasetsError) as e:  # no file or set, no network, gated, renamed column
            hint = failure_hint(e, name, source)
            failed[name] = f"{name}: FAILED after {kept} conversations: {e}\n---> HINT: {hint}"
        print(f"{name}: kept {kept}" + ("  (failed, see the end)" if name in failed else ""))
        for why, c in dropped.most_common():
            print(f"    dropped {c:6d}  {why}")

    for err in failed.values():
        print("\n" + err, file=sys.stderr)
    if not conversations:
        sys.exit("no conversations: nothing was read or converted (see above)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    print(f"wrote {len(conversations)} conversations to {args.out}"
          + (f"; missing sources: {', '.join(failed)}" if failed else ""))
    if failed and args.strict:
        sys.exit(f"--strict: {len(failed)} source(s) failed")
    return conversations


if __name__ == "__main__":
    main()
