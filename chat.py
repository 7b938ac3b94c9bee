"""Talk to a checkpoint in the project's format from the terminal: type a problem, watch each assistant
turn stream by, each tool call run in the sandbox and its output come back, then the extracted answer.

    python chat.py --model runs/toy_sft                    # type problems; Ctrl-D quits
    echo "What is 1234 * 5678?" | python chat.py --model runs/toy_sft --temperature 0

The same template (conversation.py), turn logic (rollout.py), sandbox and engine (infra/engine.py) as
training and evaluation: this file only prints what they do, one turn at a time.
"""
import argparse
import os
import sys

from conversation import format_tool_response
from infra.engine import add_engine_flags, make_engine, model_eos_ids, turn_tokens
from rollout import (EVALUATION, add_rollout_flags, add_tool_turn, end_turn, rollout_config, sampling_params,
                     start_trajectories)
from sandbox import Sandbox

parser = argparse.ArgumentParser(description="Chat with a checkpoint: its turns, tool calls and answer.")
parser.add_argument("--model", required=True, help="an HF checkpoint folder (sft.py or train.py output)")
add_rollout_flags(parser, **EVALUATION)  # eval.py's settings
parser.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + response tokens (default: the model's context, at most 32768); it caps "
                         "--max-response")
add_engine_flags(parser, memory_fraction=0.5)
parser.add_argument("--seed", type=int, default=0, help="sampling seed")
args = parser.parse_args()

from transformers import AutoConfig, AutoTokenizer  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(args.model)
max_len = args.max_model_len or min(AutoConfig.from_pretrained(args.model).max_position_embeddings, 32768)
llm = make_engine(args.model, max_len, seed=args.seed, memory_fraction=args.memory_fraction,
                  kv_cache_tokens=args.kv_cache_tokens)
engine = llm.llm_engine
eos_ids = model_eos_ids(args.model)
tty = sys.stdin.isatty()
DIM, BOLD, RESET = ("\033[2m", "\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "", "")


def sample_turn(traj, cfg):
    """One assistant turn, printed as it is generated; returns its (token ids, log-probs)."""
    params = sampling_params(traj, cfg, tokenizer)
    params.output_kind = RequestOutputKind.CUMULATIVE  # every engine step: the turn so far
    request_id = f"{traj.index}-{traj.num_turns}"
    engine.add_request(request_id, {"prompt_token_ids": traj.prompt_ids + traj.response_ids}, params)
    shown, text, last = "", "", None
    try:
        while engine.has_unfinished_requests():
            for last in engine.step():
                text = tokenizer.decode(last.outputs[0].token_ids)
                if not text.endswith("\ufffd"):  # (else a character's bytes are still coming)
                    print(text[len(shown):], end="", flush=True)
                    shown = text
    except KeyboardInterrupt:  # Ctrl-C stops this problem, not the chat
        engine.abort_request([request_id])
        raise
    print(text[len(shown):], end="", flush=True)
    return turn_tokens(last.outputs[0])


def solve(index: int, question: str, sandbox) -> None:
    """Roll out one trajectory turn by turn, printing each turn, tool call and tool output."""
    traj = start_trajectories(tokenizer, [{"question": question, "answer": ""}], 1, index, args.tools)[0]
    cfg = rollout_config(args, seed=args.seed + index, eos_ids=eos_ids)
    cfg.max_response = min(cfg.max_response, max_len - len(traj.prompt_ids))
    if cfg.max_response <= 0:
        print(f"the problem takes {len(traj.prompt_ids)} tokens: more than --max-model-len {max_len}")
        return
    while True:
        print(f"{BOLD}assistant:{RESET} <reason>", end="", flush=True)
        call = end_turn(traj, *sample_turn(traj, cfg), tokenizer, cfg)
        print()
        if call is None:  # the trajectory has finished
            break
        # a malformed call's error is its own tool output
        result = call.error if call.error is not None else sandbox.run(call.code, call.stdin)
        add_tool_turn(traj, result, tokenizer, cfg)
        output = result if isinstance(result, str) else format_tool_response(result, cfg.max_tool_chars)
        status = "parse error" if isinstance(result, str) else result.status
        print(f"{DIM}tool ({status}):{RESET}\n{output}")
        if traj.finish_reason:  # the tool's output did not fit in the token budget
            break
    print(f"{BOLD}answer:{RESET} {traj.answer}   {DIM}({traj.num_turns} turns, {traj.tool_calls} tool calls, "
          f"{len(traj.response_ids)} tokens, ended: {traj.finish_reason}){RESET}\n", flush=True)


with Sandbox(workers=1) as sandbox:
    print(f"{args.model}: type a problem and press Enter; Ctrl-D quits.", file=sys.stderr)
    index = 0
    while True:
        try:
            question = input("problem> " if tty else "").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt
            break
        if question:
            if not tty:
                print(f"problem> {question}")
            try:
                solve(index, question, sandbox)
            except KeyboardInterrupt:
                print("\n(interrupted)")
            index += 1
del llm
