"""The conversation format (paper Fig. 3; docs/design.md §2): SFT, RL, eval and chat use it.

First the tools a run may offer (TOOLS). A conversation is rendered as text (for people, logs, and the
chat template saved with checkpoints) and as token ids (for the model): the template's own markers
become control tokens, the content (problems, messages, tool output) is always plain text. Then:
reading what the model wrote (its tool call, its answer), and writing what the tool printed.
"""
import json
import re
import weakref
from dataclasses import dataclass
from typing import Callable


# -----------------------------------------------------------------------------
# The tools a run may offer (--tools: rollout.add_rollout_flags), and a tool call as SFT data carries it.
# The model calls a tool by its spec's function name with JSON arguments (parse_tool_call reads them).

TOOL_NAME = "execute_python_code_with_standard_io"

_PYTHON_SPEC = {"type": "function", "function": {"name": TOOL_NAME,
    "description": "Execute Python code with standard input and capture standard output. The code runs "
                   "as a script; the input string is given to it on stdin, and whatever it prints to "
                   "stdout is returned. If the code raises an error, the error message is returned "
                   "instead.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The Python code to run."},
        "input": {"type": "string", "description": "The text given to the code on standard input."}},
        "required": ["code", "input"]},
    "return": {"type": "string", "description": "str: The output produced by the executed code through "
               "standard output. If an error occurs during execution, the error message will be "
               "returned."}}}


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its function schema, as the system prompt lists it, and how a call's
    arguments become a program for the sandbox: program(arguments) -> (code, stdin)."""
    spec: dict
    program: Callable[[dict], tuple[str, str]]  # a missing argument it needs raises KeyError

    @property
    def name(self) -> str:
        """The function name its calls write."""
        return self.spec["function"]["name"]

    @property
    def arguments(self) -> list[str]:
        """The names of its arguments, in the order its spec lists them and its calls write them."""
        return list(self.spec["function"]["parameters"]["properties"])


# By the name --tools takes; a second tool is one more entry. Every argument is a string (parse_tool_call
# checks it).
TOOLS = {"python": Tool(_PYTHON_SPEC, lambda args: (args["code"], args.get("input", "")))}
DEFAULT_TOOLS = ("python",)  # the paper's one tool


def tool_call(tool: str, **arguments: str) -> dict:
    """An assistant message's "tool_call" in SFT data: `tool` (a name in TOOLS) called with `arguments`,
    checked against its spec and put in the spec's order. render_messages and the chat template write it
    as the tool's function call. A "tool_call" without "tool" is the Python tool's {"code", "input"}, as
    SFT files written before there were other tools have it. (No tool may name an argument "tool".)"""
    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r}\n---> HINT: a tool call names one of conversation.TOOLS: "
                         f"{', '.join(TOOLS)}")
    required = TOOLS[tool].spec["function"]["parameters"].get("required", [])
    if set(arguments) - set(TOOLS[tool].arguments) or set(required) - set(arguments):
        raise ValueError(f"{tool} takes the arguments {', '.join(TOOLS[tool].arguments)}; this call gives "
                         f"{', '.join(arguments) or 'none'}\n---> HINT: give it {', '.join(required)} "
                         f"and no argument its spec does not list")
    return {"tool": tool, **{name: arguments[name] for name in TOOLS[tool].arguments if name in arguments}}


def function_call(call: dict) -> tuple[str, dict]:
    """The function name and the arguments that an assistant message's "tool_call" is written with."""
    if "tool" not in call:  # the Python tool's arguments alone, as older SFT files have them
        call = {"tool": "python", "code": call["code"], "input": call.get("input", "")}
    arguments = tool_call(**call)
    return TOOLS[arguments.pop("tool")].name, arguments


# -----------------------------------------------------------------------------
# The format

def system_prompt(tools=DEFAULT_TOOLS) -> str:
    """The paper's system prompt (Fig. 3) with `tools` (names in TOOLS) in its <tools> block."""
    specs = "\n".join(json.dumps(TOOLS[name].spec, separators=(",", ":")) for name in tools)
    return (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
        "The Assistant first thinks about the reasoning process in the mind and then provides the user with "
        "the answer. The reasoning process and answer are enclosed within <reason> </reason> and <answer> "
        "</answer> tags, respectively, i.e., <reason> reasoning process here </reason><answer> answer here "
        "</answer>.\n\n"
        "# Tools: You may call one or more functions to assist with the user query. You are provided with "
        "function signatures within <tools></tools> XML tags:\n"
        "<tools>" + specs + "</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:"
        "<tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>")


SYSTEM_PROMPT = system_prompt()

USER_PREFIX = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
               "</answer>. And your final answer will be extracted automatically by the \\boxed{} tag. "
               "This is the problem: ")

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_OPEN = f"{IM_START}assistant\n<reason>"  # every assistant turn starts inside <reason>
# The template's own markers: where one is a single token of the vocabulary, it is that token; the
# same string inside content (a problem, a message, a tool's output) is plain text (see `encode`).
MARKERS = (IM_START, IM_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


class Content(str):
    """Text from outside the template (a problem, a message, a tool's output): always plain text."""


# A rendered turn is a list of pieces: the template's text (str) and content (Content).
# "".join(pieces) is its text; encode(tokenizer, pieces) its token ids.

def prompt_pieces(question: str, system: str = SYSTEM_PROMPT) -> list[str]:
    """System + user turn, then the assistant turn opened with <reason>. The system prompt is the
    template's own text: it shows the model the <tool_call></tool_call> markers it is to write."""
    return [f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{USER_PREFIX}", Content(question),
            f"{IM_END}\n{ASSISTANT_OPEN}"]


def user_turn_pieces(question: str) -> list[str]:
    """A further user message (after an assistant turn), then a new assistant turn."""
    return [f"\n{IM_START}user\n{USER_PREFIX}", Content(question), f"{IM_END}\n{ASSISTANT_OPEN}"]


def tool_turn_pieces(output: str) -> list[str]:
    """Follows a sampled end of turn: the tool's output as a *user* turn (paper §2.1), then a new
    assistant turn."""
    return [f"\n{IM_START}user\n<tool_response>\n", Content(output),
            f"\n</tool_response>{IM_END}\n{ASSISTANT_OPEN}"]


def function_call_pieces(name: str, arguments: dict) -> list[str]:
    """A function call as the assistant writes it at the end of its turn (JSON in <tool_call>)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return ["\n<tool_call>\n", Content(call), "\n</tool_call>"]


def assistant_pieces(message: dict) -> list[str]:
    """An assistant message as sampled text: content, the optional tool call, the closing <|im_end|>."""
    pieces = [Content((message.get("content") or "").removeprefix("<reason>"))]  # data may repeat the tag
    if (call := message.get("tool_call")) is not None:
        pieces += function_call_pieces(*function_call(call))
    return pieces + [IM_END]


def render_prompt(question: str, system: str = SYSTEM_PROMPT) -> str:
    return "".join(prompt_pieces(question, system))


def render_tool_turn(output: str) -> str:
    return "".join(tool_turn_pieces(output))


def render_tool_call(code: str, stdin: str = "") -> str:
    """The Python tool's call; another tool's: render_assistant_turn of a message with its tool_call."""
    return "".join(function_call_pieces(TOOL_NAME, {"code": code, "input": stdin}))


def render_assistant_turn(message: dict) -> str:
    return "".join(assistant_pieces(message))


_MARKER_RE = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text` encoded with the tokenizer's normalizer, pre-tokenizer and BPE but none of its added tokens:
    what tokenizer.encode gives for text without them (split_special_tokens=True still matches the
    non-special ones, such as Qwen3's <tool_response> and <think>). Needs a fast tokenizer."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, None)]
    return [token.id for word, _ in words for token in backend.model.tokenize(word)]


# The template's own text, encoded once per tokenizer: the system prompt (hundreds of tokens) opens
# every prompt, and train.py measures the prompt of every problem it reads.
_TEMPLATE_IDS = weakref.WeakKeyDictionary()  # a tokenizer's backend -> {template text: its ids}


def template_ids(tokenizer, text: str) -> list[int]:
    """plain_ids of text that holds no content, remembered."""
    known = _TEMPLATE_IDS.setdefault(tokenizer.backend_tokenizer, {})
    if text not in known:
        known[text] = plain_ids(tokenizer, text)
    return known[text]


def encode(tokenizer, pieces: list[str]) -> list[int]:
    """Token ids of rendered pieces. The template's markers become their tokens; all other text is encoded
    as plain text, so untrusted content cannot become a control token: a tool that prints
    "<|im_end|>\\n<|im_start|>assistant" shows the model those characters, not a new turn. For text
    without added tokens this is exactly tokenizer.encode of the joined text."""
    markers = {m: i for m, i in tokenizer.get_added_vocab().items() if m in MARKERS}
    ids, text, content = [], "", False
    for piece in pieces:
        parts = [piece] if isinstance(piece, Content) else _MARKER_RE.split(piece)
        for j, part in enumerate(parts):
            if j % 2 == 1 and part in markers:  # odd places of the split are markers
                ids += (plain_ids if content else template_ids)(tokenizer, text) + [markers[part]]
                text, content = "", False
            else:
                text += part
                content = content or isinstance(piece, Content)
    return ids + (plain_ids if content else template_ids)(tokenizer, text)


def render_messages(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation, exactly as a rollout builds them: each turn encoded on its
    own (a rollout never re-tokenizes across turns). Messages: an optional system message (default
    SYSTEM_PROMPT), a user message, then assistant messages (which may carry a "tool_call": tool_call)
    alternating with tool or further user messages. loss_mask is 1 on assistant tokens, their closing
    <|im_end|> included. CHAT_TEMPLATE renders the same text."""
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else SYSTEM_PROMPT
    roles = [m["role"] for m in msgs]
    alternating = all(r == "assistant" if i % 2 else r in ("user", "tool") for i, r in enumerate(roles))
    if roles[:1] != ["user"] or not alternating:
        raise ValueError(f"a conversation is an optional system message, a user message, then assistant "
                         f"messages alternating with tool (or user) messages; got roles {roles}")
    turns = {"assistant": assistant_pieces,
             "tool": lambda m: tool_turn_pieces(m["content"]),
             "user": lambda m: user_turn_pieces(m["content"])}
    pieces = [prompt_pieces(msgs[0]["content"], system)] + [turns[m["role"]](m) for m in msgs[1:]]
    ids_per_turn = [encode(tokenizer, p) for p in pieces]
    ids = [i for turn_ids in ids_per_turn for i in turn_ids]
    loss_mask = [int(m["role"] == "assistant") for m, turn_ids in zip(msgs, ids_per_turn) for _ in turn_ids]
    return ids, loss_mask


def _jinja(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Jinja string literal


def chat_template() -> str:
    """The same format as a Jinja chat template, saved with every checkpoint (training.save_hf_checkpoint),
    so that tokenizer.apply_chat_template and `vllm serve` render the text render_messages renders, the
    calls of every tool in TOOLS included. Its tokens are the same where each assistant turn starts at a
    pre-tokenizer boundary; a tokenizer may also join "<reason>" to the turn's first word when it encodes
    a whole conversation (Qwen3 has ">The"), which a rollout never does."""
    # Each tool's function name and argument order, as a Jinja literal. The call's JSON is written piece
    # by piece, because the sandboxed Jinja of transformers cannot build a dict in a given order.
    tools = {key: {"name": tool.name, "arguments": tool.arguments} for key, tool in TOOLS.items()}
    return (
        "{%- set tools = " + json.dumps(tools) + " -%}"
        "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else "
        + _jinja(SYSTEM_PROMPT) + " -%}"
        "{{ " + _jinja(f"{IM_START}system\n") + " + system + " + _jinja(IM_END) + " }}"
        "{%- for m in messages if m['role'] != 'system' -%}"
        "{%- if m['role'] == 'assistant' -%}"
        "{{ " + _jinja(f"\n{ASSISTANT_OPEN}") + " + m['content'] }}"
        "{%- if m.get('tool_call') -%}"
        "{%- set call = m['tool_call'] -%}"
        "{%- set tool = tools[call.get('tool', 'python')] -%}"
        "{{ " + _jinja('\n<tool_call>\n{"name": ') + " + (tool['name'] | tojson) + "
        + _jinja(', "arguments": {') + " }}"
        # A call without "tool" is the Python tool's, every argument written, "input" as "" if missing.
        "{%- for name in tool['arguments'] if name in call or 'tool' not in call -%}"
        "{{ (', ' if not loop.first else '') + (name | tojson) + ': ' + (call.get(name, '') | tojson) }}"
        "{%- endfor -%}"
        "{{ " + _jinja("}}\n</tool_call>") + " }}"
        "{%- endif -%}"
        "{{ " + _jinja(IM_END) + " }}"
        "{%- elif m['role'] == 'tool' -%}"
        "{{ " + _jinja(f"\n{IM_START}user\n<tool_response>\n") + " + m['content'] + "
        + _jinja(f"\n</tool_response>{IM_END}") + " }}"
        "{%- else -%}"
        "{{ " + _jinja(f"\n{IM_START}user\n{USER_PREFIX}") + " + m['content'] + " + _jinja(IM_END) + " }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt %}{{ " + _jinja(f"\n{ASSISTANT_OPEN}") + " }}{% endif -%}")


CHAT_TEMPLATE = chat_template()  # with the tools TOOLS has when this module is imported


# -- parsing what the model wrote ---------------------------------------------

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\s*\{")


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model wrote: the program to run in the sandbox, or, when the call is malformed,
    the error the model sees as the tool's output instead (paper §2.1: a parse error *is* the output)."""
    code: str = ""
    stdin: str = ""
    error: str | None = None


def parse_tool_call(text: str, tools=DEFAULT_TOOLS) -> ToolCall | None:
    """The first tool call of an assistant turn (only the first runs, as in the official release), None
    if there is none. A call names one of `tools` (names in TOOLS) by its function name. The JSON object
    after <tool_call> is decoded first, then the closing tag is required: code may print "</tool_call>"."""
    if "<tool_call>" not in text:
        return None
    body = text[text.index("<tool_call>") + len("<tool_call>"):]
    try:
        call, end = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError as e:
        return ToolCall(error=f"Failed to decode tool call: {e}")
    if not body.lstrip()[end:].lstrip().startswith("</tool_call>"):
        return ToolCall(error="Failed to decode tool call: <tool_call> is not closed by </tool_call>")
    if not isinstance(call, dict):
        return ToolCall(error='Failed to decode tool call: expected a JSON object with "name" and "arguments"')
    by_name = {TOOLS[name].name: TOOLS[name] for name in tools}
    if call.get("name") not in by_name:
        return ToolCall(error=f"Failed to decode tool call: unknown tool {call.get('name')!r}; the tools are "
                              f"{', '.join(by_name)}")
    args = call.get("arguments")
    if not isinstance(args, dict):
        return ToolCall(error="Failed to decode tool call: \"arguments\" must be a JSON object")
    if not all(isinstance(value, str) for value in args.values()):
        return ToolCall(error=f"Failed to decode tool call: arguments {', '.join(map(json.dumps, args))} "
                              f"must be strings")
    try:
        code, stdin = by_name[call["name"]].program(args)
    except KeyError as e:
        return ToolCall(error=f"Failed to decode tool call: missing argument \"{e.args[0]}\"")
    return ToolCall(code, stdin)


def extract_answer(text: str) -> str | None:
    """The last \\boxed{...} (nested braces handled) inside the last closed <answer> block, else None."""
    block = (_ANSWER_RE.findall(text) or [""])[-1]
    for m in reversed(list(_BOXED_RE.finditer(block))):
        depth, i = 1, m.end()
        while i < len(block) and depth:
            depth += {"{": 1, "}": -1}.get(block[i], 0)
            i += 1
        if depth == 0:
            return block[m.end():i - 1].strip()
    return None


# Whole tool response the model sees, cut in the middle beyond this. The official release used verl's
# default, 256 characters, which cuts a three-frame traceback through its error line's context. With stdout
# and stderr capped at 1000 each by the sandbox, 1024 keeps a typical traceback or printout whole and a tool
# turn a few hundred tokens.
MAX_TOOL_RESPONSE_CHARS = 1024
_TRUNCATION_MARK = "\n...(truncated)...\n"


def format_tool_response(result, max_chars: int = MAX_TOOL_RESPONSE_CHARS) -> str:
    """The text the model sees for an ExecResult: stdout, then stderr, then a line for a timeout or a kill;
    middle-truncated to max_chars (the head says what ran, the tail where it failed)."""
    parts = [s.rstrip("\n") for s in (result.stdout, result.stderr) if s and s.strip()]
    stopped = {"timeout": "TimeoutError: the code ran past the time limit and was stopped after "
                          f"{result.seconds:.1f} s",
               "oom": "MemoryError: the code went over the memory limit and was stopped"}
    if result.status not in ("ok", "error"):
        parts.append(stopped.get(result.status, f"the code was stopped ({result.status})"))
    text = "\n".join(parts) if parts else "(no output)"
    if len(text) > max_chars:
        keep = max(max_chars - len(_TRUNCATION_MARK), 0)
        text = text[:keep - keep // 2] + _TRUNCATION_MARK + text[len(text) - keep // 2:]
    return text


def prompt_ids(tokenizer, question: str, tools=DEFAULT_TOOLS) -> list[int]:
    """The token ids of a problem's prompt, its system prompt offering `tools` (names in TOOLS)."""
    return encode(tokenizer, prompt_pieces(question, system_prompt(tools)))


def pad_token_id(tokenizer) -> int:
    """The id that pads a batch's rows (never trained on: padding is off the loss mask): the tokenizer's
    pad token, else its eos token, else 0."""
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
