"""MAWPS and ASDiv-A for the real recipe: elementary word problems people wrote, at a 135M model's level.

    python data/prepare_mawps.py --csv ../shared/data/mawps_asdiv/train.csv --out data/mawps

The file is the SVAMP authors' training set: 3,138 one- and two-step problems, word-tokenized, each
number masked ("If Bryan has number0 books in each of his number1 bookshelves , how many books does he
have in total ?", numbers "56.0 9.0"), with the solution as a prefix equation ("* number0 number1").
What it writes into --out, deterministically from --seed:
1. test.jsonl: --n-test held-out problems {"question", "answer", "steps"}; never trained on.
2. sft.jsonl: --n-sft conversations {"messages"} in the rollout's format, each built from an equation:
   - the question as people read it: numbers put back, the tokenization undone (`books in total ?` ->
     `books in total?`, `$ 5` -> `$5`); lower-cased problems stay lower-cased, as published;
     with --numbers-in-question, every question in the three files ends with its numbers listed
     ("... each? (The numbers: 15, 6 and 7.)");
   - the stepwise style: a reasoning that states each operation on numbers and its value, every
     operation a step of one shape ("First, 15 - 6 = 9. Then, 9 * 7 = 63."), and a call whose code
     repeats it (`step1 = 15 - 6`, `step2 = step1 * 7`, `print(step2)`): the answer is what the code
     prints (the other styles measured in docs/words.md are in git history at ca5a665);
   - the tool's output as the sandbox prints it, then the answer in \\boxed{}.
   A share (--error-share, a tenth) first makes a call that fails and is fixed in the next turn;
   --multi-share repeats conversations of two or more operations until they are that share of the
   file. The chain's code, its failing calls and the messages come from data/chains.py, as GSM8K's do.
3. train.jsonl: the remaining problems with an integer answer, for RL, each with its number of
   operations ("steps").
Problems are de-duplicated by their text first (the two sources share some), so the three sets are
disjoint: one shuffled list, cut in three.
"""
import argparse
import csv
import os
import random
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chains import Skip, chain_code, conversations, plan_calls, stepwise, write_sets  # noqa: E402

CSV = "../shared/data/mawps_asdiv/train.csv"
MASK = re.compile(r"\bnumber(\d+)\b")
OPERATORS = ("+", "-", "*", "/")


# -----------------------------------------------------------------------------
# A record -> the question as people read it, the stepwise chain and reasoning, the answer

def number_text(value: str) -> str:
    """A masked number as the problem printed it: 56.0 -> 56, 10.22 -> 10.22."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def detokenize(text: str) -> str:
    """Undo the word tokenization: no space before punctuation or 's, none after $ or ( ."""
    text = re.sub(r" ([.,?!;:%)])", r"\1", text)
    text = re.sub(r" (n't|'t|'s|'re|'ll|'ve|'m|'d)\b", r"\1", text)
    text = re.sub(r"([$(]) (?=\S)", r"\1", text)
    return re.sub(r" ' ", "' ", text).strip()


def unmask(text: str, numbers: list[str]) -> str:
    return MASK.sub(lambda m: number_text(numbers[int(m.group(1))]), text)


def parse_prefix(equation: str):
    """A prefix equation -> a tree: "numberK" at the leaves, (operator, left, right) above them."""
    tokens = equation.split()

    def take():
        if not tokens:
            raise Skip("an equation that ends too soon")
        token = tokens.pop(0)
        if token in OPERATORS:
            return token, take(), take()
        if not MASK.fullmatch(token):
            raise Skip(f"an equation with a constant ({token})")
        return token
    tree = take()
    if tokens:
        raise Skip("an equation with tokens left over")
    return tree


def said(numbers: list[str]) -> str:
    """A problem's numbers as a sentence lists them: "9, 27 and 20"."""
    listed = [number_text(n) for n in numbers]
    return " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 1 else listed)


def convert(record: dict, cue: bool = False) -> tuple[str, str, list, str, int]:
    """(question, reasoning, chain of steps for chains.chain_code, answer, operations) of one record,
    in the stepwise style (each operation on numbers, a step); with cue, the question ends with its
    numbers listed, a count the policy cannot rewrite."""
    numbers = record["Numbers"].split()
    tree = parse_prefix(record["Equation"])
    operations = []

    def walk(node):  # the operations in the order they are computed (children first)
        if isinstance(node, str):
            return
        walk(node[1])
        walk(node[2])
        operations.append(node)
    walk(tree)
    question, answer = detokenize(unmask(record["Question"], numbers)), number_text(record["Answer"])
    if cue:
        question = f"{question} (The numbers: {said(numbers)}.)"

    def value_of(node):
        if isinstance(node, str):
            return float(numbers[int(node[6:])])
        a, b = value_of(node[1]), value_of(node[2])
        return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[node[0]]

    def shown(node):  # a number as printed, a result by its value
        if isinstance(node, str):
            return number_text(numbers[int(node[6:])])
        return number_text(str(round(value_of(node), 6)))
    reasoning, steps = stepwise([(f"{shown(op[1])} {op[0]} {shown(op[2])}", shown(op)) for op in operations])
    return question, reasoning, steps, answer, len(operations)


def integer(answer: str) -> str | None:
    value = float(answer)
    return str(int(value)) if value.is_integer() else None


# -----------------------------------------------------------------------------
# The script: read, de-duplicate, split, convert (every call run in the sandbox), write

def main():
    parser = argparse.ArgumentParser(description="MAWPS + ASDiv-A -> RL problems, held-out problems, SFT "
                                                 "conversations.")
    parser.add_argument("--csv", default=CSV, help="the SVAMP authors' mawps-asdiv-a train.csv")
    parser.add_argument("--out", default="data/mawps", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle and the failing calls")
    parser.add_argument("--n-test", type=int, default=300, help="held-out problems (never trained on)")
    parser.add_argument("--n-sft", type=int, default=1200,
                        help="problems whose equations become SFT conversations")
    parser.add_argument("--error-share", type=float, default=0.1, help="share of SFT conversations whose "
                        "first call fails and is fixed (a quarter was 4.3 points worse on training "
                        "problems: docs/words.md)")
    parser.add_argument("--numbers-in-question", action="store_true",
                        help="end every question (held-out, RL and SFT alike) with its numbers listed, a cue "
                             "for a second operation that RL cannot rewrite (docs/words.md)")
    parser.add_argument("--multi-share", type=float, default=0.0,
                        help="repeat SFT conversations of two or more operations until they are this share "
                             "of sft.jsonl (0: as drawn)")
    args = parser.parse_args()
    if not os.path.exists(args.csv):
        sys.exit(f"mawps: no file {args.csv}\n---> HINT: pass --csv with the path of the SVAMP authors' "
                 f"data/mawps-asdiv-a_svamp/train.csv")
    with open(args.csv, newline="", encoding="utf-8") as f:
        records, seen = [], set()
        for record in csv.DictReader(f):
            key = unmask(record["Question"], record["Numbers"].split()).lower()
            if key not in seen:
                seen.add(key)
                records.append(record)
    random.Random(args.seed).shuffle(records)

    counts, rng, converted = Counter(), random.Random(args.seed + 1), []
    cue = args.numbers_in_question
    for record in records:
        try:
            question, reasoning, steps, answer, operations = convert(record, cue)
            code = chain_code(steps)
        except (Skip, ValueError, ZeroDivisionError) as e:
            counts[str(e) if isinstance(e, Skip) else "an equation that does not compute"] += 1
            continue
        converted.append((record, question, reasoning, code, answer, operations))

    def problem(item):
        record, question, _, _, answer, operations = item
        return {"question": question, "answer": integer(record["Answer"]), "steps": operations}
    integers = [item for item in converted if integer(item[0]["Answer"]) is not None]
    test = integers[:args.n_test]
    rest = [item for item in converted if item not in test]
    sft, train = rest[:args.n_sft], [item for item in rest[args.n_sft:] if integer(item[0]["Answer"])]

    plans = [(question, reasoning, plan_calls(code, rng, args.error_share), answer)
             for _, question, reasoning, code, answer, _ in sft]
    made = conversations(plans, counts)
    n_made, n_fixed = len(made), sum(len(c["messages"]) > 4 for c in made)
    operations = {item[1]: item[5] for item in sft}  # (a question -> its operations; questions are distinct)
    multi = [c for c in made if operations[c["messages"][0]["content"]] > 1]
    if multi and args.multi_share > len(multi) / len(made):
        repeats = round(args.multi_share * (len(made) - len(multi)) / (1 - args.multi_share)) - len(multi)
        made += rng.choices(multi, k=repeats)
        rng.shuffle(made)
    write_sets(args.out, {"test.jsonl": [problem(i) for i in test], "train.jsonl": [problem(i) for i in train],
                          "sft.jsonl": made})
    print(f"{len(records)} distinct problems; SFT: {n_made} of {len(sft)} converted, "
          f"{n_fixed} with a failing first call, {len(multi)} of two or more operations, "
          f"{len(made) - n_made} repeats of those; left out: {dict(counts) or 'none'}")


if __name__ == "__main__":
    main()
