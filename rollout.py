"""Multi-turn tool rollouts: the trajectory record, the problems, and the agent loop.

The agent loop is a per-trajectory state machine that a driver steps (scheduler.py has two: the
turn-synchronous baseline and the load-balanced scheduler); conversation.py renders its turns.
Problems are {"question", "answer"} JSONL lines, checked when read.
Trajectories are built from token ids, never by re-tokenizing text: the trainer scores exactly the
sampled ids.
"""
import json
import os
from dataclasses import dataclass, field

from conversation import (IM_END, MAX_TOOL_RESPONSE_CHARS, encode, extract_answer, format_tool_response,
                          parse_tool_call, prompt_ids, tool_turn_pieces)
from grading import grade

# -----------------------------------------------------------------------------
# The trajectory record (DESIGN.md §4): everything downstream reads only this.

FAILURE_KINDS = ("error", "timeout", "oom", "parse")  # what counts as a failed tool call
FINISH_REASONS = ("answer", "no_tool_call", "length", "max_turns")


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
    answer: str | None = None       # the extracted \boxed{} answer, None if there is none
    gold: str = ""                  # the reference answer
    reward: float = 0.0             # 1.0 if the answer is equivalent to the gold answer, else 0.0
    finish_reason: str = ""         # one of FINISH_REASONS, set when the trajectory ends
    text: str = ""                  # the decoded response, for logs only

    @property
    def num_tool_failures(self) -> int:
        return sum(self.tool_failures.values())


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
    kv_budget: int | None = None   # the scheduler admits within this many KV tokens (None: the engine's)
    eos_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (model_eos_ids): they end a turn too


def model_eos_ids(model: str) -> tuple[int, ...]:
    """The model's end-of-sequence ids, from its generation_config.json (else config.json). vLLM stops a
    request at them whatever its stop ids say: Qwen3 base models end a turn with <|endoftext|>."""
    from transformers import AutoConfig, GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        eos = AutoConfig.from_pretrained(model).eos_token_id
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)


def end_of_turn_ids(tokenizer, cfg: RolloutConfig) -> list[int]:
    """The ids that end an assistant turn: <|im_end|>, the tokenizer's eos and the model's."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id, *cfg.eos_ids]
    return sorted({i for i in ids if i is not None})


def read_problems(path: str) -> list[dict]:
    """{"question": str, "answer": ...} per line (other fields kept, the answer made a string)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file\n---> HINT: `python data/prepare_rl.py` writes "
                                f"data/rl.jsonl, `python data/prepare_eval.py` the benchmarks, "
                                f"`python data/prepare_toy.py` the toy world")
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
    """The next turn's sampling: what is left of the budget, stop at the end of the turn, a seed of its
    own. The engine returns the finished turn's token ids only: no text (end_turn decodes it once) and
    no partial outputs (under the external launcher vLLM does that work in the trainer's thread)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=turn_seed(traj, cfg),
                          logprobs=0, max_tokens=cfg.max_response - len(traj.response_ids),
                          stop_token_ids=end_of_turn_ids(tokenizer, cfg),
                          output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def end_turn(traj: Trajectory, token_ids: list[int], logprobs: list[float], tokenizer, cfg: RolloutConfig):
    """Append a sampled turn (loss mask 1, its closing end-of-turn token included). Returns the tool call
    to run next, (code, stdin), or a parse error to show the model; None once the trajectory has finished
    (finish_reason)."""
    traj.response_ids += token_ids
    traj.loss_mask += [1] * len(token_ids)
    traj.logprobs += logprobs
    traj.num_turns += 1
    text = tokenizer.decode(token_ids)
    traj.text += text
    traj.num_answers += text.count("<answer>")  # GRPO-RoC's format penalty counts repeated answers
    traj.answer = extract_answer(text) or traj.answer  # the model's last answer counts
    call = parse_tool_call(text)
    ended = bool(token_ids) and token_ids[-1] in end_of_turn_ids(tokenizer, cfg)
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
    """Append the tool's output (an ExecResult, or a parse error) as a user turn (loss mask 0), counting a
    failed call by kind. A tool turn that does not fit the budget ends the trajectory ("length"). The
    output is plain text: whatever the code prints, it cannot end the turn or open another."""
    if isinstance(result, str):
        kind, output = "parse", result
    else:
        kind = result.status if result.status in FAILURE_KINDS else "error"
        output = format_tool_response(result, cfg.max_tool_chars)
    if isinstance(result, str) or result.status != "ok":
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
    return {"trajectories": len(trajs),
            "generated_tokens": sum(sum(t.loss_mask) for t in trajs),
            "turns_mean": sum(t.num_turns for t in trajs) / n,
            "tool_calls": sum(t.tool_calls for t in trajs),
            "accuracy": sum(t.reward for t in trajs) / n,
            **extra,
            **{f"tool_{k}": sum(t.tool_failures.get(k, 0) for t in trajs) for k in FAILURE_KINDS},
            **{f"finish_{r}": sum(t.finish_reason == r for t in trajs) for r in FINISH_REASONS}}
