"""The toy world: arithmetic that a tiny model cannot do in its head and Python does at once.

    python data/prepare_toy.py                 # writes data/toy/ in a few seconds
    python data/prepare_toy.py --out /tmp/toy --seed 1

What it writes, deterministically from --seed, into --out:
1. train.jsonl / test.jsonl: {"question", "answer"} problems with integer answers, no overlap:
   "What is 4578 * 9268?", "What is 7634 + 5969?", "What is 7890 - 1663?" (4-digit operands),
   hopeless in the head of a model of a million parameters, one print() away with the tool.
2. sft.jsonl: {"messages": [...]} conversations in the rollout's format, deliberately imperfect so
   that RL has something to fix: on about half of the problems the assistant answers directly
   (always wrong: a near miss), and about one tool call in four fails
   first (an undefined name or an unclosed parenthesis) and is fixed in the next turn. Tool
   outputs are what the sandbox returns for that code, shown through format_tool_response.
3. init_model/: a byte-level BPE tokenizer trained on that corpus (digits split one by one so that
   copying a number is copying tokens; no split at spaces, so the constant system prompt and
   the templated sentences compress to a few tokens) with a chat template, and an untrained
   Qwen3-architecture model, saved together so transformers and vLLM load the one directory.
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conversation import (CHAT_TEMPLATE, IM_END, IM_START, format_tool_response,  # noqa: E402
                          render_assistant_turn, render_prompt, render_tool_turn, tool_call)

# -----------------------------------------------------------------------------
# Arguments

parser = argparse.ArgumentParser(description="Write the toy world: problems, SFT conversations, tokenizer, untrained model.")
parser.add_argument("--out", default="data/toy", help="output folder")
parser.add_argument("--seed", type=int, default=0, help="everything is a deterministic function of this")
parser.add_argument("--n-train", type=int, default=4000, help="RL training problems")
parser.add_argument("--n-test", type=int, default=200, help="held-out problems (no overlap with train or SFT)")
parser.add_argument("--n-sft", type=int, default=4000, help="SFT conversations (their problems are disjoint from train and test)")
parser.add_argument("--digits", type=int, default=4, help="digits of each operand of a hard problem")
parser.add_argument("--mix", type=float, nargs=3, default=[2, 1, 1], help="weights of a*b, a+b, a-b among hard problems")
parser.add_argument("--easy-share", type=float, default=0.0, help="share of one-digit problems (see make_problem)")
parser.add_argument("--words", type=float, default=0.0,
                    help="share of problems phrased in words (a story or a sentence): the model must read them")
parser.add_argument("--tool-share", type=float, default=0.5, help="share of SFT conversations that use the tool")
parser.add_argument("--tool-share-easy", type=float, default=0.3, help="the same on easy problems")
parser.add_argument("--error-share", type=float, default=0.25, help="share of SFT tool uses whose first call fails")
parser.add_argument("--vocab-size", type=int, default=2048, help="largest BPE vocabulary (specials included); training stops earlier when no pair is left to merge")
parser.add_argument("--hidden-size", type=int, default=128, help="model width")
parser.add_argument("--layers", type=int, default=4, help="decoder layers")
parser.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = width / heads must be >= 32 for vLLM on CPU)")
parser.add_argument("--max-positions", type=int, default=1024, help="context length of the model")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# Problems. A question is "What is <expr>?"; the code that solves it is print(<expr>).

rng = random.Random(args.seed)


def value(expr):  # the expressions are integer arithmetic on literals: evaluating them is safe
    return eval(expr, {"__builtins__": {}})


def number(digits):
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def make_problem():
    """A question's expression and its level. Hard: d-digit operands with a result of fixed width
    per operation (2d digits for a*b, d + 1 for a+b, d for a-b), because a tiny model learns to
    copy a number of a known width far sooner than one of any width (measured after 600 SFT
    steps, sampling at temperature 1: 45% of tool-using answers right with free widths, 98% with
    fixed ones). Easy (off by default): one-digit sums and products; measured, a tiny model
    neither learns them by heart in 600 steps nor copies their shorter operands."""
    if rng.random() < args.easy_share:
        return f"{rng.randint(0, 9)} {rng.choice('+*')} {rng.randint(0, 9)}", "easy"
    op = rng.choices("*+-", weights=args.mix)[0]
    d = args.digits
    width = {"*": 2 * d, "+": d + 1, "-": d}[op]
    while True:
        expr = f"{number(d)} {op} {number(d)}"
        if len(str(value(expr))) == width:
            return expr, "hard"


WORDS = {  # the same problems in words: reading them, not the arithmetic, is the model's part
    "*": ["What is the product of {a} and {b}?", "Multiply {a} by {b}.",
          "A crate holds {a} bottles. How many bottles are there in {b} crates?"],
    "+": ["What is the sum of {a} and {b}?", "Add {a} to {b}.",
          "A library has {a} books and buys {b} more. How many books does it have now?"],
    "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.",
          "A tank holds {a} litres and {b} litres are drained. How many litres are left?"],
}


def question(expr):
    """"What is a * b?", or with probability --words the same problem in words."""
    if not (args.words and rng.random() < args.words):  # (no draw at all without --words)
        return f"What is {expr}?"
    a, op, b = expr.split()
    return rng.choice(WORDS[op]).format(a=a, b=b)


problems, seen = [], set()
while len(problems) < args.n_test + args.n_train + args.n_sft:
    expr, level = make_problem()
    if expr not in seen:
        seen.add(expr)
        problems.append({"question": question(expr), "answer": str(value(expr)), "expr": expr, "level": level})
test = problems[:args.n_test]
train = problems[args.n_test:args.n_test + args.n_train]
sft_problems = problems[args.n_test + args.n_train:]

# -----------------------------------------------------------------------------
# SFT conversations: templated, short, and imperfect on purpose.

# The reasoning restates the numbers it works with: every conversation, direct answers included,
# practises copying digits (measured: operands copied right 92% vs 68% without, after 300 steps).
SAY_TOOL = "I will compute {expr} with Python.</reason>"
SAY_DIRECT = "I can do {expr} in my head.</reason>"
SAY_RESULT = "The code printed {out}.</reason>"
SAY_FIX = "The code failed, so I will fix it.</reason>"


def answer_text(x):
    return f"<answer>\\boxed{{{x}}}</answer>"


def near_miss(ans):
    """A direct answer to a hard problem: the leading digits right, the rest guessed (never right)."""
    digits = list(ans.lstrip("-"))
    for i in range(len(digits) // 2, len(digits)):
        digits[i] = str(rng.randint(0, 9))
    guess = ("-" if ans.startswith("-") else "") + "".join(digits).lstrip("0") or "0"
    return guess if guess != ans else str(int(ans) + rng.choice([-1, 1]) * rng.randint(1, 9))


def broken_code(expr):
    """A first call that fails: a name never defined, or a parenthesis never closed."""
    return "print(result)" if rng.random() < 0.5 else f"print({expr}"


# First the plan of each conversation: a direct answer, or the code of each tool call.
plans = []
for p in sft_problems:
    share = args.tool_share_easy if p["level"] == "easy" else args.tool_share
    if rng.random() >= share:
        plans.append(p["answer"] if p["level"] == "easy" else near_miss(p["answer"]))
    else:
        code = f"print({p['expr']})"
        plans.append([broken_code(p["expr"]), code] if rng.random() < args.error_share else [code])

# Then every tool call runs in the sandbox (one batch), so the model sees exactly what it will see in RL.
from sandbox import Sandbox  # noqa: E402

t0 = time.time()
codes = sorted({c for plan in plans if isinstance(plan, list) for c in plan})
with Sandbox() as sandbox:
    results = dict(zip(codes, sandbox.run_batch(codes)))
sandbox_seconds = time.time() - t0

conversations = []
for p, plan in zip(sft_problems, plans):
    msgs = [{"role": "user", "content": p["question"]}]
    if isinstance(plan, str):
        msgs.append({"role": "assistant", "content": SAY_DIRECT.format(expr=p["expr"]) + answer_text(plan)})
    else:
        for i, code in enumerate(plan):
            say = SAY_TOOL.format(expr=p["expr"]) if i == 0 else SAY_FIX
            call = tool_call("python", code=code, input="")
            msgs.append({"role": "assistant", "content": say, "tool_call": call})
            msgs.append({"role": "tool", "content": format_tool_response(results[code])})
        out = msgs[-1]["content"]
        if results[plan[-1]].status != "ok" or out != p["answer"]:
            sys.exit(f"the sandbox printed {out!r} for {plan[-1]!r}, expected {p['answer']}\n"
                     f"---> HINT: check that sandbox.py runs plain Python (python sandbox.py --help)")
        msgs.append({"role": "assistant", "content": SAY_RESULT.format(out=out) + answer_text(out)})
    conversations.append(msgs)

# -----------------------------------------------------------------------------
# Write the problems and conversations.

os.makedirs(args.out, exist_ok=True)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


write_jsonl(os.path.join(args.out, "train.jsonl"), [{"question": p["question"], "answer": p["answer"]} for p in train])
write_jsonl(os.path.join(args.out, "test.jsonl"), [{"question": p["question"], "answer": p["answer"]} for p in test])
write_jsonl(os.path.join(args.out, "sft.jsonl"), [{"messages": m} for m in conversations])

# -----------------------------------------------------------------------------
# Tokenizer: byte-level BPE on the rendered corpus, the pieces exactly as render_messages cuts them.

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

SPECIALS = [IM_START, IM_END, "<|endoftext|>"]


def pieces(msgs):
    yield render_prompt(msgs[0]["content"])
    for m in msgs[1:]:
        yield render_assistant_turn(m) if m["role"] == "assistant" else render_tool_turn(m["content"])


corpus = [piece for m in conversations for piece in pieces(m)]
corpus += [render_prompt(p["question"]) for p in train]
tok = Tokenizer(models.BPE())
# Digits one by one; no split at spaces (use_regex=False), so merges may span words and the
# constant system prompt becomes 14 tokens (split at spaces and punctuation, as GPT-2 does, it
# could not go below 331).
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
])
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(corpus, trainers.BpeTrainer(
    vocab_size=args.vocab_size, special_tokens=SPECIALS, show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token=IM_END,
                                    pad_token="<|endoftext|>", unk_token=None)
tokenizer.chat_template = CHAT_TEMPLATE  # the project's format: the text render_messages renders

# -----------------------------------------------------------------------------
# The untrained model: Qwen3 architecture, untied embeddings, head_dim >= 32 (vLLM's CPU kernels).

import torch  # noqa: E402
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

head_dim = args.hidden_size // args.heads
if head_dim < 32:
    sys.exit(f"head_dim = {args.hidden_size} / {args.heads} = {head_dim} < 32\n---> HINT: vLLM's CPU attention "
             f"needs head_dim >= 32: use fewer --heads or a larger --hidden-size")
config = Qwen3Config(
    vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
    num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
    head_dim=head_dim, max_position_embeddings=args.max_positions, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id, dtype="float32",
)
torch.manual_seed(args.seed)
model = Qwen3ForCausalLM(config)
model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                           bos_token_id=tokenizer.pad_token_id)
model_dir = os.path.join(args.out, "init_model")
model.save_pretrained(model_dir)
tokenizer.save_pretrained(model_dir)

# -----------------------------------------------------------------------------
# Summary

n_tool = sum(len(m) > 2 for m in conversations)
n_err = sum(len(m) > 4 for m in conversations)
lengths = [sum(len(tokenizer.encode(x, add_special_tokens=False)) for x in pieces(m)) for m in conversations]
prompt_len = len(tokenizer.encode(render_prompt(test[0]["question"]), add_special_tokens=False))
print(f"wrote {args.out}: {len(train)} train, {len(test)} test problems ({sum(p['level'] == 'easy' for p in test)} easy in test), "
      f"{len(conversations)} SFT conversations")
print(f"SFT: tool use {n_tool / len(conversations):.0%}, failing first call {n_err / max(n_tool, 1):.0%} of tool uses, "
      f"{len(codes)} distinct calls run in the sandbox ({sandbox_seconds:.1f} s)")
print(f"tokens: vocab {len(tokenizer)}, prompt {prompt_len}, conversation mean {sum(lengths) / len(lengths):.0f} / max {max(lengths)}")
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
      f"({args.layers} layers, width {args.hidden_size}, {args.heads} heads of {head_dim}) -> {model_dir}")
