"""A solution chain -> a tool-using SFT conversation: the one converter the word-problem scripts share.

A chain is a list of steps (name, expression, result): `clips_in_may = 48 / 2`, then
`total = 48 + clips_in_may`. data/prepare_gsm8k.py reads its chains from GSM8K's calculator
annotations, data/prepare_mawps.py from MAWPS's and ASDiv-A's prefix equations, each in its style:
1. GSM8K's: the solution's sentences, and quantity_name for each quantity ("24 clips in May" ->
   clips_in_may, unique in the chain); MAWPS's, stepwise: the reasoning states each operation on
   numbers and its value, every operation a step ("First, 15 - 6 = 9. Then, 9 * 7 = 63."), and the
   code repeats it (`step1 = 15 - 6`, `step2 = step1 * 7`). A 135M model copies numbers it has just
   read far better than names it makes up (docs/words.md, "The SFT style"; the other styles are in
   git history at ca5a665);
2. chain_code: the code of the chain, each step a named line, a number that an earlier step computed
   used by that step's name, the last result printed;
3. broken_code: a first call that fails (an unclosed parenthesis, or a name never defined), which
   the next turn fixes, so that RoC has clean and unclean positives to choose between;
4. run_calls: every call run in the sandbox, so the conversation shows what RL will show;
5. conversation: the messages in the rollout's format: reasoning and a call, the tool's output as
   a tool turn, then what the code printed and the answer in \\boxed{}.
"""
import ast
import json
import keyword
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conversation import format_tool_response, tool_call  # noqa: E402
from rollout import as_number  # noqa: E402

NAME_WORD = re.compile(r"[A-Za-z]+")
# Words that do not start a name: "48 of her friends" is named friends, not of_her_friends.
LEADING = {"a", "an", "the", "of", "in", "on", "at", "to", "is", "are", "and", "so", "for"}
SAY_RESULT = "The code printed {out}.</reason>"
SAY_FIX = "The code failed, so I will fix it.</reason>"


class Skip(Exception):
    """A solution that cannot be turned into a conversation; the message is the counted reason."""


def quantity_name(words: str, used: set, fallback: str) -> str:
    """A Python name from the first words of `words` ("clips in May." -> clips_in_may): leading
    filler words skipped, at most three words, up to punctuation or a number; `fallback` when the
    words give none. Unique in `used`, which it joins (apples, apples_2, ...)."""
    picked = []
    for token in words.split():
        word = token.strip(",.;:!?()$%'\"")
        if not NAME_WORD.fullmatch(word) or len(picked) == 3:
            break
        if picked or word.lower() not in LEADING:
            picked.append(word.lower())
        if token[-1] in ",.;:!?)":  # (the sentence or clause ends with this word)
            break
    name = "_".join(picked) or fallback
    if keyword.iskeyword(name) or not name.isidentifier():
        name = fallback
    base, n = name, 2
    while name in used:
        name, n = f"{base}_{n}", n + 1
    used.add(name)
    return name


def stepwise(operations: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str, str]]]:
    """(expression, result) per operation, in the order computed -> (the reasoning, the chain's steps).
    Every operation is a step of the same shape ("First, 95 - 3 = 92."; `step1 = 95 - 3`), its value
    stated, an earlier result by its value; the steps are step1, step2, ... for chain_code, which puts
    the names back and prints the last. So a sentence is a line of code, and whether a problem takes
    another operation is said after the first one, not before it. The reasoning names no answer of its
    own: the answer is what the code printed (measured: with a closing "So the answer is 92." the SFT
    model boxed that sentence's number, often its own wrong sum, instead of the printed one)."""
    if not operations:
        raise Skip("no calculator annotation")
    sentences, steps = [], []
    for i, (expression, result) in enumerate(operations, 1):
        try:
            expression = ast.unparse(ast.parse(expression, mode="eval"))  # "48/2" -> "48 / 2"
        except SyntaxError:
            raise Skip("an annotation that is not Python") from None
        sentences.append(f"{'First,' if i == 1 else 'Then,'} {expression} = {result}.")
        steps.append((f"step{i}", expression, result))
    return " ".join(sentences), steps


def chain_code(steps: list[tuple[str, str, str]]) -> str:
    """The code of the chain: `name = expression` per step, an earlier result by its name, the last printed."""
    if not steps:
        raise Skip("no calculator annotation")
    lines, known = [], []  # known: (value, name) of the results so far, newest last
    for name, expression, result in steps:
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            raise Skip("an annotation that is not Python") from None
        if any(not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator,
                                     ast.unaryop)) for node in ast.walk(tree)):
            raise Skip("an annotation that is not arithmetic")
        # a step that is a bare number states a quantity: it keeps its number even if an earlier one equals it
        body = tree.body if isinstance(tree.body, ast.Constant) else by_name(tree.body, known)
        lines.append(f"{name} = {ast.unparse(body)}")
        value = as_number(result)
        if value is not None:
            known.append((value, name))
    return "\n".join(lines + [f"print({steps[-1][0]})"])


def by_name(node: ast.AST, known: list) -> ast.AST:
    """The expression with each number that an earlier step computed replaced by that step's name."""
    class Rename(ast.NodeTransformer):
        def visit_Constant(self, constant):
            for value, name in reversed(known):
                if isinstance(constant.value, (int, float)) and constant.value == value:
                    return ast.Name(id=name, ctx=ast.Load())
            return constant
    return Rename().visit(node)


def broken_code(code: str, rng: random.Random) -> str:
    """A first call that fails: the print's parenthesis never closed, or a name never defined."""
    head, _, last = code.rpartition("\n")
    return f"{head}\n{last[:-1]}" if rng.random() < 0.5 else f"{head}\nprint(result)"


def plan_calls(code: str, rng: random.Random, error_share: float) -> list[str]:
    """The calls a conversation makes: the code, after a failing first call in `error_share` of them."""
    return [broken_code(code, rng), code] if rng.random() < error_share else [code]


def run_calls(plans: list[list[str]]) -> dict:
    """Every call of every plan run once in the sandbox: {code: ExecResult}. A call meant to fail that
    ran is a bug of broken_code, and stops the script."""
    from sandbox import Sandbox  # (here: the conversion is tested without a sandbox)
    codes = sorted({code for calls in plans for code in calls})
    with Sandbox() as sandbox:
        results = dict(zip(codes, sandbox.run_batch(codes)))
    for calls in plans:
        if len(calls) > 1 and results[calls[0]].status != "error":
            sys.exit(f"a call meant to fail ran: {calls[0]!r}\n"
                     f"---> HINT: broken_code must make code that fails")
    return results


def printed_matches(result, final: str) -> bool:
    """Whether the last call printed the final answer (what a chain that computes it does)."""
    printed = as_number(result.stdout.strip()) if result.status == "ok" else None
    return printed is not None and as_number(final) is not None and abs(printed - as_number(final)) <= 1e-6


def conversations(plans: list[tuple[str, str, list[str], str]], counts) -> list[dict]:
    """The SFT conversations {"messages"} of (question, reasoning, calls, answer) plans, every call run
    once in the sandbox; a plan whose last call does not print its answer is left out and counted."""
    results = run_calls([calls for _, _, calls, _ in plans])  # the model sees exactly what it sees in RL
    made = []
    for question, reasoning, calls, answer in plans:
        if not printed_matches(results[calls[-1]], answer):
            counts["the code does not print the answer"] += 1
            continue
        messages = conversation(question, reasoning, calls, [results[c] for c in calls], answer)
        made.append({"messages": messages})
    return made


def write_sets(out: str, sets: dict) -> None:
    """Each {file name: items} as a JSONL file in `out`, an item a line; prints each file's count."""
    os.makedirs(out, exist_ok=True)
    for file, items in sets.items():
        with open(os.path.join(out, file), "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        print(f"{os.path.join(out, file)}: {len(items)}")


def conversation(question: str, reasoning: str, calls: list[str], results: list, answer: str) -> list[dict]:
    """The messages: the reasoning and the first call, each call's output as a tool turn (a fixed call
    after a failing one), then what the code printed and the answer."""
    msgs = [{"role": "user", "content": question}]
    for i, (code, result) in enumerate(zip(calls, results)):
        say = reasoning + "</reason>" if i == 0 else SAY_FIX
        call = tool_call("python", code=code, input="")
        msgs.append({"role": "assistant", "content": say, "tool_call": call})
        msgs.append({"role": "tool", "content": format_tool_response(result)})
    out = msgs[-1]["content"]
    final = SAY_RESULT.format(out=out) + f"<answer>\\boxed{{{answer}}}</answer>"
    msgs.append({"role": "assistant", "content": final})
    return msgs
