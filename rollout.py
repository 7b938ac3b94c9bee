"""Multi-turn tool rollouts: the conversation format and the agent loop.

The format (paper Fig. 3) is rendered here for SFT, RL and eval. The agent loop is a per-trajectory state machine
that a driver steps (scheduler.py has two: the turn-synchronous baseline and the load-balanced scheduler).
Trajectories are built from token ids, never by re-tokenizing text: the trainer scores exactly the sampled ids.
"""
import json
import re
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# The trajectory record (DESIGN.md §4): everything downstream reads only this.

FAILURE_KINDS = ("error", "timeout", "oom", "parse")  # what counts as a failed tool call
FINISH_REASONS = ("answer", "no_tool_call", "length", "max_turns")


@dataclass
class Trajectory:
    index: int                      # which problem of the batch (rollouts of one problem share it)
    sample: int = 0                 # which of the problem's rollouts
    prompt_ids: list[int] = field(default_factory=list)  # the rendered prompt, ending with the assistant turn opened by <reason>
    response_ids: list[int] = field(default_factory=list)  # sampled turns + tool turns, in order
    loss_mask: list[int] = field(default_factory=list)     # 1 = sampled by the policy, 0 = tool/template
    logprobs: list[float] = field(default_factory=list)    # sampler log-prob per response token (0.0 where mask is 0)
    num_turns: int = 0              # assistant turns generated
    tool_calls: int = 0             # tool calls made (parse failures included)
    tool_failures: dict[str, int] = field(default_factory=dict)  # kind (FAILURE_KINDS) -> count
    num_answers: int = 0            # <answer> blocks the model wrote, over all turns
    answer: str | None = None       # the extracted \boxed{} answer, None if there is none
    gold: str = ""                  # the reference answer
    reward: float = 0.0             # 1.0 if the answer is equivalent to the gold answer, else 0.0
    finish_reason: str = ""         # one of FINISH_REASONS, set when the trajectory ends
    text: str = ""                  # the decoded response, for logs only

    @property
    def num_tool_failures(self) -> int:
        return sum(self.tool_failures.values())


# -----------------------------------------------------------------------------
# The conversation format (paper Fig. 3; DESIGN.md §3 "Prompt" and "Turns"): SFT, RL and eval all render with these.

TOOL_NAME = "execute_python_code_with_standard_io"

_TOOL_SPEC = {"type": "function", "function": {"name": TOOL_NAME,
    "description": "Execute Python code with standard input and capture standard output. The code runs as a script; "
                   "the input string is given to it on stdin, and whatever it prints to stdout is returned. If the "
                   "code raises an error, the error message is returned instead.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The Python code to run."},
        "input": {"type": "string", "description": "The text given to the code on standard input."}},
        "required": ["code", "input"]},
    "return": {"type": "string", "description": "str: The output produced by the executed code through standard "
               "output. If an error occurs during execution, the error message will be returned."}}}

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <reason> </reason> and <answer> </answer> tags, "
    "respectively, i.e., <reason> reasoning process here </reason><answer> answer here </answer>.\n\n"
    "# Tools: You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n"
    "<tools>" + json.dumps(_TOOL_SPEC, separators=(",", ":")) + "</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:<tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>")

USER_PREFIX = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And "
               "your final answer will be extracted automatically by the \\boxed{} tag. This is the problem: ")

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_OPEN = f"{IM_START}assistant\n<reason>"  # every assistant turn starts inside <reason>


def render_prompt(question: str, system: str = SYSTEM_PROMPT) -> str:
    """System + user turn, then the assistant turn opened with <reason>."""
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{USER_PREFIX}{question}{IM_END}\n{ASSISTANT_OPEN}"


def render_tool_turn(response_text: str) -> str:
    """Follows a sampled <|im_end|>: the tool's output as a *user* turn (paper §2.1), then a new assistant turn."""
    return f"\n{IM_START}user\n<tool_response>\n{response_text}\n</tool_response>{IM_END}\n{ASSISTANT_OPEN}"


def render_function_call(name: str, arguments: dict) -> str:
    """A function call as the assistant writes it at the end of its turn (JSON in <tool_call>)."""
    call = {"name": name, "arguments": arguments}
    return f"\n<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def render_tool_call(code: str, stdin: str = "") -> str:
    """A call of the Python tool."""
    return render_function_call(TOOL_NAME, {"code": code, "input": stdin})


def render_assistant_turn(message: dict) -> str:
    """An assistant message as sampled text: content, the optional tool call, the closing <|im_end|>."""
    content = (message.get("content") or "").removeprefix("<reason>")  # data may repeat the opening tag
    if (call := message.get("tool_call")) is not None:
        content += render_tool_call(call["code"], call.get("input", ""))
    return content + IM_END


def render_messages(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation, exactly as a rollout builds them: each turn tokenized on its own
    (a rollout never re-tokenizes across turns). Messages: an optional system message (default SYSTEM_PROMPT), a
    user message, then assistant messages (which may carry "tool_call": {"code", "input"}) alternating with tool
    or further user messages. loss_mask is 1 on assistant tokens, their closing <|im_end|> included."""
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else SYSTEM_PROMPT
    roles = [m["role"] for m in msgs]
    alternating = all(r == "assistant" if i % 2 else r in ("user", "tool") for i, r in enumerate(roles))
    if roles[:1] != ["user"] or not alternating:
        raise ValueError(f"a conversation is an optional system message, a user message, then assistant messages "
                         f"alternating with tool (or user) messages; got roles {[m['role'] for m in messages]}")
    render = {"assistant": render_assistant_turn, "tool": lambda m: render_tool_turn(m["content"]),
              "user": lambda m: f"\n{IM_START}user\n{USER_PREFIX}{m['content']}{IM_END}\n{ASSISTANT_OPEN}"}
    texts = [render_prompt(msgs[0]["content"], system)] + [render[m["role"]](m) for m in msgs[1:]]
    pieces = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    ids = [i for piece in pieces for i in piece]
    loss_mask = [int(m["role"] == "assistant") for m, piece in zip(msgs, pieces) for _ in piece]
    return ids, loss_mask


# -- parsing what the model wrote ---------------------------------------------

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_NUMBER_WRAPPERS = [re.compile(p, re.DOTALL) for p in
                    (r"^\$+(.*?)\$+$", r"^\\\((.*)\\\)$", r"^\\\[(.*)\\\]$", r"^\\boxed\s*\{(.*)\}$")]
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}([, ]\d{3})+")
_DECIMAL_RE = re.compile(r"[+-]?\d+(\.\d*)?")


def parse_tool_call(text: str) -> None | tuple[str, str] | str:
    """The first tool call of an assistant turn (only the first runs, as in the official release): None if there
    is none, (code, stdin) if it is well formed, else the error message, which goes back to the model as the
    tool's output (paper §2.1: a parse error *is* the tool output)."""
    if "<tool_call>" not in text:
        return None
    if (m := _TOOL_CALL_RE.search(text)) is None:
        return "Failed to decode tool call: <tool_call> is not closed by </tool_call>"
    try:
        call = json.loads(m.group(1).strip())
    except json.JSONDecodeError as e:
        return f"Failed to decode tool call: {e}"
    if not isinstance(call, dict):
        return "Failed to decode tool call: expected a JSON object with \"name\" and \"arguments\""
    if call.get("name") != TOOL_NAME:
        return f"Failed to decode tool call: unknown tool {call.get('name')!r}; the only tool is {TOOL_NAME}"
    args = call.get("arguments")
    if not isinstance(args, dict):
        return "Failed to decode tool call: \"arguments\" must be a JSON object"
    if "code" not in args:
        return "Failed to decode tool call: missing argument \"code\""
    code, stdin = args["code"], args.get("input", "")
    if not isinstance(code, str) or not isinstance(stdin, str):
        return "Failed to decode tool call: arguments \"code\" and \"input\" must be strings"
    return code, stdin


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


# Whole tool response the model sees, cut in the middle beyond this. The official release used verl's default, 256
# characters, which cuts a three-frame traceback through its error line's context. With stdout and stderr capped at
# 1000 each by the sandbox, 1024 keeps a typical traceback or printout whole and a tool turn a few hundred tokens.
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


# -- grading (DESIGN.md §3 "Reward") --------------------------------------------

def as_number(text: str) -> int | float | None:
    """A plain number as written, else None (fractions, expressions, units, lists...). Accepted around
    it: whitespace, $...$, \\(...\\), \\[...\\], \\boxed{...} and a final period, in any order; within
    it: a sign, leading zeros, thousands separators ("1,000", "1{,}000", "1\\,000", "1 000") and a
    decimal point. An integer ("12.0" included) comes back as an int, exact however large."""
    s, before = str(text).strip(), None
    while s != before:  # peel the wrappers: "$\\boxed{12}$", "\\boxed{$12$}."
        before = s
        s = s.rstrip(".").strip()
        for wrapper in _NUMBER_WRAPPERS:
            s = wrapper.sub(r"\1", s).strip()
    s = s.replace("{,}", ",").replace("\\,", ",").replace("\\!", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    if not _DECIMAL_RE.fullmatch(s):
        return None
    whole, _, fraction = s.partition(".")
    return float(s) if fraction.strip("0") else int(whole)


def grade(answers: list[str | None], golds: list[str], sandbox=None) -> list[float]:
    """Rewards for a batch. Plain numbers are compared exactly here; math-verify decides the rest, in one batch in
    the sandbox's workers (under their hard timeout). Without a sandbox it runs in this process: fine for scripts
    and tests, but in training pass the sandbox, so that a pathological answer cannot hang the trainer."""
    rewards, undecided = [0.0] * len(answers), []
    for i, (answer, gold) in enumerate(zip(answers, golds)):
        if answer is None:
            continue
        a, g = as_number(answer), as_number(gold)
        if a is None or g is None:
            undecided.append(i)
        else:
            rewards[i] = float(a == g)
    if undecided:
        pairs = [(answers[i], golds[i]) for i in undecided]
        if sandbox is not None:
            verdicts = sandbox.verify_batch(pairs)
        else:  # math-verify returns False (never raises) for what it cannot read
            from math_verify import parse, verify
            verdicts = [verify(parse("\\boxed{" + g + "}"), parse("\\boxed{" + a + "}")) for a, g in pairs]
        for i, ok in zip(undecided, verdicts):
            rewards[i] = float(ok)
    return rewards


# -----------------------------------------------------------------------------
# The turn logic (DESIGN.md §3 "Turns"): a per-trajectory state machine any driver can step.
#   start_trajectories -> [sampling_params -> engine -> end_turn -> (sandbox) -> add_tool_turn]* -> finish

@dataclass
class RolloutConfig:
    max_turns: int = 10            # T: 10 in RL stages 1-2, 15 in stage 3, 30 at evaluation
    max_response: int = 8192       # one budget for sampled and tool tokens together
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0                  # every turn of every rollout gets its own seed derived from this
    max_tool_chars: int = MAX_TOOL_RESPONSE_CHARS
    kv_budget: int | None = None   # the scheduler admits within this many KV tokens (None: the engine's cache)


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The token ids of a problem's prompt."""
    return tokenizer.encode(render_prompt(question), add_special_tokens=False)


def drop_long_prompts(problems: list[dict], tokenizer, max_prompt: int) -> tuple[list[dict], int]:
    """The problems whose prompt fits in max_prompt tokens, and how many were dropped. (vLLM refuses
    a request longer than its context: one such problem would stop its rank in the middle of a step.)"""
    kept = [p for p in problems if len(prompt_ids(tokenizer, p["question"])) <= max_prompt]
    return kept, len(problems) - len(kept)


def start_trajectories(tokenizer, problems: list[dict], n: int, offset: int = 0) -> list[Trajectory]:
    """n fresh trajectories per problem ({"question", "answer"}), numbered from `offset`."""
    prompts = [prompt_ids(tokenizer, p["question"]) for p in problems]
    return [Trajectory(index=offset + i, sample=s, prompt_ids=list(ids), gold=str(p["answer"]))
            for i, (p, ids) in enumerate(zip(problems, prompts)) for s in range(n)]


def turn_seed(traj: Trajectory, cfg: RolloutConfig) -> int:
    """The sampling seed of the trajectory's next turn: the same whichever driver or batch runs it."""
    return hash((cfg.seed, traj.index, traj.sample, traj.num_turns)) % 2**31


def sampling_params(traj: Trajectory, cfg: RolloutConfig, tokenizer):
    """The next turn's sampling: what is left of the budget, stop at <|im_end|>, a seed of its own.
    The engine returns the finished turn's token ids only: no text (end_turn decodes it once) and
    no partial outputs (under the external launcher vLLM does that work in the trainer's thread)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=turn_seed(traj, cfg), logprobs=0,
                          max_tokens=cfg.max_response - len(traj.response_ids),
                          stop_token_ids=[tokenizer.convert_tokens_to_ids(IM_END)],
                          output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def end_turn(traj: Trajectory, token_ids: list[int], logprobs: list[float], tokenizer, cfg: RolloutConfig):
    """Append a sampled turn (loss mask 1, its closing <|im_end|> included). Returns the tool call to run next,
    (code, stdin), or a parse error to show the model; None once the trajectory has finished (finish_reason)."""
    traj.response_ids += token_ids
    traj.loss_mask += [1] * len(token_ids)
    traj.logprobs += logprobs
    traj.num_turns += 1
    text = tokenizer.decode(token_ids)
    traj.text += text
    traj.num_answers += text.count("<answer>")  # GRPO-RoC's format penalty counts repeated answers
    traj.answer = extract_answer(text) or traj.answer  # the model's last answer counts
    call = parse_tool_call(text)
    ended = bool(token_ids) and token_ids[-1] == tokenizer.convert_tokens_to_ids(IM_END)
    if not ended or len(traj.response_ids) >= cfg.max_response:
        traj.finish_reason = "length"
    elif call is None:
        traj.finish_reason = "answer" if traj.answer is not None else "no_tool_call"
    elif traj.num_turns >= cfg.max_turns:
        traj.finish_reason = "max_turns"
    else:
        traj.tool_calls += 1
        return call
    return None


def add_tool_turn(traj: Trajectory, result, tokenizer, cfg: RolloutConfig) -> None:
    """Append the tool's output (an ExecResult, or a parse error) as a user turn (loss mask 0), counting a failed
    call by kind. A tool turn that does not fit the budget ends the trajectory ("length")."""
    if isinstance(result, str) or result.status != "ok":
        kind = "parse" if isinstance(result, str) else result.status if result.status in FAILURE_KINDS else "error"
        traj.tool_failures[kind] = traj.tool_failures.get(kind, 0) + 1
    text = render_tool_turn(result if isinstance(result, str) else format_tool_response(result, cfg.max_tool_chars))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(traj.response_ids) + len(ids) >= cfg.max_response:
        traj.finish_reason = "length"
        return
    traj.response_ids += ids
    traj.loss_mask += [0] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.text += text


def finish(trajs: list[Trajectory], sandbox) -> None:
    """Rewards: 1 if the answer is equivalent to the gold one; truncated trajectories get 0."""
    rewards = grade([t.answer for t in trajs], [t.gold for t in trajs], sandbox)
    for t, r in zip(trajs, rewards):
        t.reward = 0.0 if t.finish_reason == "length" else r


def sampled(output) -> tuple[list[int], list[float]]:
    """Token ids and their log-probs from a vLLM CompletionOutput (logprobs=0: the sampled token's)."""
    ids = list(output.token_ids)
    return ids, [lp[t].logprob for t, lp in zip(ids, output.logprobs)]


def batch_stats(trajs: list[Trajectory], **extra) -> dict:
    """Per-batch statistics for logs; `extra` (timings, the driver's own counters) is passed through."""
    n = max(len(trajs), 1)
    return {"trajectories": len(trajs), "generated_tokens": sum(sum(t.loss_mask) for t in trajs),
            "turns_mean": sum(t.num_turns for t in trajs) / n, "tool_calls": sum(t.tool_calls for t in trajs),
            "accuracy": sum(t.reward for t in trajs) / n, **extra,
            **{f"tool_{k}": sum(t.tool_failures.get(k, 0) for t in trajs) for k in FAILURE_KINDS},
            **{f"finish_{r}": sum(t.finish_reason == r for t in trajs) for r in FINISH_REASONS}}
