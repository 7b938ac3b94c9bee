"""Multi-turn tool rollouts: the trajectory record, the problems, and the agent loop.

The agent loop is a per-trajectory state machine that a driver steps (scheduler.py has two);
conversation.py renders its turns. Problems are {"question", "answer"} JSONL lines, checked when
read. Trajectories are built from token ids, never by re-tokenizing text: the trainer scores
exactly the sampled ids.
"""
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from conversation import (DEFAULT_TOOLS, IM_END, MAX_TOOL_RESPONSE_CHARS, TOOLS, encode, extract_answer,
                          format_tool_response, parse_tool_call, prompt_ids, tool_turn_pieces)
from sandbox import SANDBOX_FAILURE

# -----------------------------------------------------------------------------
# The trajectory record (docs/design.md §1): everything downstream reads only this. Its payload, the
# tokens (lists while it grows, TOKENS arrays once scored: a ninth of the memory) and the text, is None
# on a rank that holds only its numbers (ProblemQueue.gather), where `sizes` keeps the token counts.

FAILURE_KINDS = ("error", "timeout", "oom", "parse")  # what counts as a failed tool call
# A sandbox_failure is the sandbox's own, not the model's code's, and it ends the trajectory.
FINISH_REASONS = ("answer", "no_tool_call", "length", "max_turns", "sandbox_failure")
TOKENS = {"prompt_ids": np.int32, "response_ids": np.int32, "loss_mask": np.bool_, "logprobs": np.float32}


@dataclass
class Trajectory:
    index: int                      # which problem of the batch (rollouts of one problem share it)
    sample: int = 0                 # which of the problem's rollouts
    prompt_ids: list[int] = field(default_factory=list)    # the prompt, up to the assistant's <reason>
    response_ids: list[int] = field(default_factory=list)  # sampled turns + tool turns, in order
    loss_mask: list[int] = field(default_factory=list)     # 1 = sampled by the policy, 0 = tool/template
    logprobs: list[float] = field(default_factory=list)    # sampler log-prob per token (0.0 where mask is 0)
    num_turns: int = 0              # assistant turns generated
    tool_calls: int = 0             # tool calls made (parse failures included)
    tool_failures: dict[str, int] = field(default_factory=dict)  # kind (FAILURE_KINDS) -> count
    num_answers: int = 0            # <answer> blocks the model wrote, over all turns
    answer_tags_match: bool = True  # each turn closes as many answers as it opens (RoC's format penalty)
    void_turns: int = 0             # turns that ended with neither a tool call nor an answer
    answer: str | None = None       # the extracted \boxed{} answer, None if there is none
    gold: str = ""                  # the reference answer
    correct: bool = False           # the answer is equivalent to the gold one (set by grading)
    reward: float = 0.0             # what the update optimises: reward(traj), computed from `correct`
    sandbox_failed: bool = False    # the sandbox failed it (a worker died, a check did not finish):
    #                                 not the model's doing, so it is left out of the update
    finish_reason: str = ""         # one of FINISH_REASONS, set when the trajectory ends
    text: str | None = ""           # the decoded response, for logs only
    sizes: tuple[int, int, int] = ()  # (prompt, response, loss) tokens, where the tokens are None
    rank: int = 0                   # the rank that rolled it out (ProblemQueue.gather sets it)

    @property
    def num_tool_failures(self) -> int:
        return sum(self.tool_failures.values())

    @property
    def prompt_length(self) -> int:
        return self.sizes[0] if self.prompt_ids is None else len(self.prompt_ids)

    @property
    def response_length(self) -> int:
        return self.sizes[1] if self.response_ids is None else len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:  # the tokens the policy sampled: those the loss counts
        return self.sizes[2] if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))


# -----------------------------------------------------------------------------
# The turn logic (docs/design.md §2): a per-trajectory state machine any driver can step.
#   start_trajectories -> [sampling_params -> engine -> end_turn -> (sandbox) -> add_tool_turn]* -> score

# The paper's rollout settings (§4.3), defined here once: each RL stage's budget and turns (train.py
# --stage; eval.py's stage-3 filter samples as stage 2 does), and evaluation's (eval.py, chat.py).
# RolloutConfig's defaults are stage 1's, at training's temperature.
STAGE_ROLLOUTS = {1: dict(max_response=8192, max_turns=10), 2: dict(max_response=12288, max_turns=10),
                  3: dict(max_response=12288, max_turns=15)}
EVALUATION = dict(temperature=0.6, max_response=30000, max_turns=30)
MAX_PROMPT = 2048  # training's longest prompt in tokens: with a stage's budget, the engine's context
PROBLEMS_PER_STEP, ROLLOUTS_PER_PROBLEM = 512, 32  # the paper's RL step (§4.3): 2G = 32 rollouts a problem


@dataclass
class RolloutConfig:
    max_turns: int = STAGE_ROLLOUTS[1]["max_turns"]        # T: the assistant turns of a trajectory
    max_response: int = STAGE_ROLLOUTS[1]["max_response"]  # one budget for sampled and tool tokens together
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0                  # with `deterministic`: every turn of every rollout derives its own
    deterministic: bool = False    # per-turn seeds: the same samples whatever the batch, sampled slower
    max_tool_chars: int = MAX_TOOL_RESPONSE_CHARS
    kv_budget: int | None = None   # the scheduler admits within this many KV tokens (None: the engine's)
    eos_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (model_eos_ids): they end a turn too
    tools: tuple[str, ...] = DEFAULT_TOOLS  # the tools the system prompt offers (names in TOOLS)


def add_rollout_flags(parser, training: bool = False, **defaults):
    """The rollout flags of every script (train.py, eval.py, chat.py), each with its defaults (EVALUATION,
    or a stage's). Returns the argument group, for a script's own rollout flags. training=True: no
    --top-p (see --temperature's help), and --max-tool-chars and --deterministic stay settings without a
    flag (RolloutConfig's defaults; train.py's toy preset sets deterministic)."""
    group = parser.add_argument_group("rollouts")
    group.add_argument("--max-turns", type=int, default=RolloutConfig.max_turns,
                       help="T: assistant turns per trajectory")
    group.add_argument("--max-response", type=int, default=RolloutConfig.max_response,
                       help="token budget of a response: sampled and tool tokens together")
    scored = ("; the trainer scores with the same (no --top-p: the engine's log-probs are after its top-p "
              "mask, the trainer's over the vocabulary)")
    group.add_argument("--temperature", type=float, default=RolloutConfig.temperature,
                       help="sampling temperature" + (scored if training else ""))
    group.add_argument("--tools", nargs="+", choices=sorted(TOOLS), default=list(DEFAULT_TOOLS),
                       help="the tools the system prompt offers and a call may name (conversation.TOOLS)")
    if not training:
        group.add_argument("--top-p", type=float, default=RolloutConfig.top_p, help="nucleus sampling")
        group.add_argument("--max-tool-chars", type=int, default=MAX_TOOL_RESPONSE_CHARS,
                           help="a tool response is cut to this many characters (middle-truncated)")
        group.add_argument("--deterministic", action="store_true",
                           help="a seed per turn of every rollout: the same samples whatever the driver, "
                                "rank or batch runs them (tests, comparisons). Off: one engine seed, because "
                                "vLLM samples seeded requests one at a time, a Python loop per decode step")
    parser.set_defaults(max_tool_chars=MAX_TOOL_RESPONSE_CHARS, deterministic=False, **defaults)
    return group


def rollout_config(args, **fields) -> RolloutConfig:
    """The RolloutConfig of add_rollout_flags' flags; `fields` sets the rest (seed, eos_ids, ...)."""
    return RolloutConfig(max_turns=args.max_turns, max_response=args.max_response,
                         temperature=args.temperature, top_p=getattr(args, "top_p", 1.0),
                         max_tool_chars=args.max_tool_chars, deterministic=args.deterministic,
                         tools=tuple(getattr(args, "tools", DEFAULT_TOOLS)), **fields)


def end_of_turn_ids(tokenizer, cfg: RolloutConfig) -> list[int]:
    """The ids that end an assistant turn: <|im_end|>, the tokenizer's eos and the model's."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id, *cfg.eos_ids]
    return sorted({i for i in ids if i is not None})


def read_problems(path: str) -> list[dict]:
    """{"question": str, "answer": ...} per line (other fields kept, the answer made a string)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file\n---> HINT: data/prepare_rl.py writes data/rl.jsonl, "
                                f"data/prepare_eval.py the benchmarks, data/prepare_toy.py the toy world")
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = f"not JSON ({e})"
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) \
                    or not row["question"].strip() or not str(row.get("answer", "")).strip():
                raise ValueError(f"{path}:{line_number}: a problem needs a question and an answer, got "
                                 f"{line.strip()[:200]}\n---> HINT: each line is "
                                 f'{{"question": ..., "answer": ...}}; fix or drop this line')
            problems.append(dict(row, answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"{path}: no problems in the file\n---> HINT: check that it was written completely")
    return problems


def drop_long_prompts(problems: list[dict], tokenizer, max_prompt: int, tools=DEFAULT_TOOLS):
    """The problems whose prompt fits in max_prompt tokens, and how many were dropped. (vLLM refuses
    a request longer than its context: one such problem would stop its rank in the middle of a step.)"""
    kept = [p for p in problems if len(prompt_ids(tokenizer, p["question"], tools)) <= max_prompt]
    return kept, len(problems) - len(kept)


def start_trajectories(tokenizer, problems: list[dict], n: int, offset: int = 0, tools=DEFAULT_TOOLS):
    """n fresh trajectories per problem ({"question", "answer"}), numbered from `offset`."""
    prompts = [prompt_ids(tokenizer, p["question"], tools) for p in problems]
    return [Trajectory(index=offset + i, sample=s, prompt_ids=list(ids), gold=str(p["answer"]))
            for i, (p, ids) in enumerate(zip(problems, prompts)) for s in range(n)]


def turn_seed(traj: Trajectory, cfg: RolloutConfig) -> int | None:
    """The sampling seed of the trajectory's next turn, the same whichever driver or batch runs it; None
    (the engine's generator, seeded once) unless cfg.deterministic: vLLM samples a request that carries
    a seed on its own (docs/gpu.md)."""
    if not cfg.deterministic:
        return None
    return hash((cfg.seed, traj.index, traj.sample, traj.num_turns)) % 2**31


def sampling_params(traj: Trajectory, cfg: RolloutConfig, tokenizer):
    """The next turn's sampling: what is left of the budget, stop at the end of the turn, its seed. The
    engine returns the finished turn's token ids only: no text (end_turn decodes it once) and
    no partial outputs (under the external launcher vLLM does that work in the trainer's thread)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=turn_seed(traj, cfg),
                          logprobs=0, max_tokens=cfg.max_response - len(traj.response_ids),
                          stop_token_ids=end_of_turn_ids(tokenizer, cfg),
                          output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def end_turn(traj: Trajectory, token_ids: list[int], logprobs: list[float], tokenizer, cfg: RolloutConfig):
    """Append a sampled turn (loss mask 1, its closing end-of-turn token included). Returns the ToolCall to
    run next (or, malformed, the error to show the model); None once the trajectory has finished."""
    traj.response_ids += token_ids
    traj.loss_mask += [1] * len(token_ids)
    traj.logprobs += logprobs
    traj.num_turns += 1
    text = tokenizer.decode(token_ids)
    traj.text += text
    traj.num_answers += text.count("<answer>")  # GRPO-RoC's format penalty counts repeated answers
    traj.answer_tags_match &= text.count("<answer>") == text.count("</answer>")
    traj.answer = extract_answer(text) or traj.answer  # the model's last answer counts
    call = parse_tool_call(text, cfg.tools)
    ended = bool(token_ids) and token_ids[-1] in end_of_turn_ids(tokenizer, cfg)
    if not ended or len(traj.response_ids) >= cfg.max_response:
        traj.finish_reason = "length"
    elif call is None:
        traj.void_turns += extract_answer(text) is None  # neither a tool call nor an answer (SimpleTIR)
        traj.finish_reason = "answer" if traj.answer is not None else "no_tool_call"
    elif traj.num_turns >= cfg.max_turns:
        traj.finish_reason = "max_turns"
    else:
        traj.tool_calls += 1
        return call
    return None


def add_tool_turn(traj: Trajectory, result, tokenizer, cfg: RolloutConfig) -> None:
    """Append the tool's output (an ExecResult, or a ToolCall's error) as a user turn (loss mask 0), counting
    a failed call by kind; one that does not fit the budget ends the trajectory ("length"). The output is
    plain text: it cannot end the turn or open another. A failure of the sandbox itself is not the model's:
    not a failed call; the trajectory ends there, marked (what follows would not be what its code did)."""
    if isinstance(result, str):
        kind, output = "parse", result
    elif result.status == SANDBOX_FAILURE:
        traj.sandbox_failed = True
        traj.finish_reason = "sandbox_failure"
        return
    else:
        kind = result.status if result.status in ("ok", *FAILURE_KINDS) else "error"
        output = format_tool_response(result, cfg.max_tool_chars)
    if kind != "ok":
        traj.tool_failures[kind] = traj.tool_failures.get(kind, 0) + 1
    pieces = tool_turn_pieces(output)
    ids = encode(tokenizer, pieces)
    if len(traj.response_ids) + len(ids) >= cfg.max_response:
        traj.finish_reason = "length"
        return
    traj.response_ids += ids
    traj.loss_mask += [0] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.text += "".join(pieces)


# -----------------------------------------------------------------------------
# The reward (docs/design.md §3): is the model's answer equivalent to the gold one. Plain numbers
# (all RL answers are integers) are compared exactly here; math-verify decides the rest.

_NUMBER_WRAPPERS = [re.compile(p, re.DOTALL) for p in
                    (r"^\$+(.*?)\$+$", r"^\\\((.*)\\\)$", r"^\\\[(.*)\\\]$", r"^\\boxed\s*\{(.*)\}$")]
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}([, ]\d{3})+")
_DECIMAL_RE = re.compile(r"[+-]?\d+(\.\d*)?")


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


def grade(answers: list[str | None], golds: list[str], sandbox=None) -> list[float | None]:
    """Verdicts for a batch: 1.0 (equivalent) or 0.0 (not, no answer, or the check failed on it); None
    where the sandbox failed (a worker died or hung), which says nothing of the answer: `score` leaves such
    a sample out. math-verify runs in one batch in the sandbox's workers, under their hard timeout;
    without a sandbox, in this process (never None): for scripts and tests, not training, where a
    pathological answer could hang the trainer."""
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
            rewards[i] = None if ok is None else float(ok)
    return rewards


def reward(traj: Trajectory, cfg: RolloutConfig) -> float:
    """The reward the update optimises, from the graded trajectory and the run's rollout settings (its
    budget, turns, tools) (docs/design.md §3). The paper's: 1 if the answer is correct and the trajectory
    was not cut by the token budget, else 0; no format or tool penalties. This is the one place to change
    for reward shaping: accuracy, pass@k and the stage-3 filter read `correct`, never the reward."""
    return float(traj.correct and traj.finish_reason != "length")


def score(trajs: list[Trajectory], sandbox, cfg: RolloutConfig) -> None:
    """Grade the finished trajectories (`correct`; a check the sandbox could not finish marks the
    trajectory sandbox_failed instead), then compute each one's reward. Their tokens become arrays."""
    verdicts = grade([t.answer for t in trajs], [t.gold for t in trajs], sandbox)
    for t, verdict in zip(trajs, verdicts):
        t.sandbox_failed = t.sandbox_failed or verdict is None
        t.correct = bool(verdict)
        t.reward = reward(t, cfg)
        for name, dtype in TOKENS.items():
            setattr(t, name, np.asarray(getattr(t, name), dtype))


def trajectory_metrics(trajs: list[Trajectory]) -> dict:
    """What every script reports of a batch of trajectories (train.py's log, eval.py's table, the
    drivers' stats). Rates are over the graded trajectories: those the sandbox failed are only counted."""
    graded = [t for t in trajs if not t.sandbox_failed]
    n = max(len(graded), 1)
    calls = sum(t.tool_calls for t in graded)
    correct_tool_users = [t for t in graded if t.correct and t.tool_calls]
    lengths = [t.response_length for t in graded]
    return {
        "trajectories": len(trajs),
        "sandbox_failures": len(trajs) - len(graded),
        "accuracy": sum(t.correct for t in graded) / n,
        "reward": sum(t.reward for t in graded) / n,
        "response_length": sum(lengths) / n,
        "response_length_max": max(lengths, default=0),
        "generated_tokens": sum(t.num_loss_tokens for t in trajs),
        "truncated": sum(t.finish_reason == "length" for t in graded) / n,
        "turns": sum(t.num_turns for t in graded) / n,
        "void_turn_rate": sum(t.void_turns > 0 for t in graded) / n,  # trajectories with a void turn
        "tool_use": sum(t.tool_calls > 0 for t in graded) / n,
        "tool_calls": calls / n,
        "tool_error_ratio": sum(t.num_tool_failures for t in graded) / max(calls, 1),
        # GRPO-RoC's p_err on the correct trajectories that called the tool (the paper's Fig. 4)
        "tool_error_ratio_pos": sum(min(1.0, t.num_tool_failures / t.tool_calls) for t in correct_tool_users)
        / max(len(correct_tool_users), 1),
    }
