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
   - --style stepwise (the default): a reasoning that states each operation on numbers and its
     value, every operation a step of one shape ("First, 15 - 6 = 9. Then, 9 * 7 = 63."), and a call
     whose code repeats it (`step1 = 15 - 6`, `step2 = step1 * 7`, `print(step2)`): the answer is what
     the code prints; --style formulaic: the last operation is the answer's own sentence ("So the
     answer is 9 * 7 = 63."; `answer = step1 * 7`); --style counted: stepwise after a sentence that
     lists the problem's numbers ("The numbers are 15, 6 and 7."), the cue for a second operation;
     --style symbolic: stepwise's code lines as the reasoning, no value written ("First, step1 =
     15 - 6. Then, step2 = step1 * 7."); --style quoted: stepwise, each operation after the question's
     words for the numbers it brings in ('First, "Ned had 15 video games" and "video games but 6 of
     them": 15 - 6 = 9. Then, "games for $7 each": 7 * 9 = 63.'), the words that decide an operation
     next to its sum;
     --style named: a reasoning in words (which quantities combine and why, never the result), and
     code that names each quantity from the problem's words (`books = 56`, `bookshelves = 9`,
     `total_books = books * bookshelves`);
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
from chains import (Skip, chain_code, conversations, formulaic, plan_calls, quantity_name,  # noqa: E402
                    symbolic, write_sets)

CSV = "../shared/data/mawps_asdiv/train.csv"
MASK = re.compile(r"\bnumber(\d+)\b")
OPERATORS = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}
# Words that end a quantity's name ("books in each" is named books) or never start one ("them").
STOP = {"in", "on", "at", "to", "of", "for", "from", "with", "and", "but", "or", "each", "per", "every",
        "if", "than", "more", "less", "times", "into", "by", "that", "which", "who", "he", "she", "it",
        "they", "them", "his", "her", "their", "its", "this", "these", "those", "how", "what", "was", "were",
        "is", "are", "did", "does", "do", "will", "has", "have", "had", "can", "would", "could", "left"}
# What an operation's result is called when it is not the answer, and how the answer's noun is dressed.
PARTIAL = {"+": "total", "-": "difference", "*": "product", "/": "quotient"}
ANSWER = {"+": "total {}", "-": "{} left", "*": "total {}", "/": "{} each"}
WHY = {"+": "{a} and {b} together make the {r}, so I add them.",
       "-": "Taking {b} away from {a} leaves the {r}, so I subtract.",
       "*": "{a} for each of {b} makes the {r}, so I multiply.",
       "/": "{a} shared out by {b} gives the {r}, so I divide."}


# -----------------------------------------------------------------------------
# A record -> the question as people read it, the named chain, the reasoning, the answer

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


def leaf_names(question: str, numbers: list[str], leaves: list[str]) -> dict[str, str]:
    """Each used number's Python name, from the words after it in the (masked, tokenized) question,
    else the word before it ("washed number2 of them" -> washed), else quantity{k}."""
    tokens, used, names = question.split(), set(), {}
    for leaf in sorted(set(leaves), key=lambda leaf: int(leaf[6:])):
        at = tokens.index(leaf) if leaf in tokens else None
        after = tokens[at + 1:at + 4] if at is not None else []
        if len(after) > 2 and after[1] == "of":  # "0.25 gallon of grape juice" is named grape_juice
            after = tokens[at + 3:at + 6]
        after = " ".join(after)
        before = tokens[at - 1].lower() if at else ""
        fallback = before if before.isalpha() and before not in STOP else f"quantity{int(leaf[6:])}"
        names[leaf] = quantity_name(after, used, fallback, stop=STOP, most=2)
    return names


def spoken(name: str) -> str:
    """A quantity's name as words: grape_juice_2 -> grape juice."""
    return re.sub(r"_\d+$", "", name).replace("_", " ")


def asked_noun(ask: str) -> str:
    """The thing a question asks for: "how many books does he have" -> books; "" when it says none."""
    words = re.findall(r"[a-z]+", ask.lower())
    for i, word in enumerate(words[:-1]):
        if word == "how" and words[i + 1] in ("many", "much"):
            noun = [w for w in words[i + 2:i + 4]]
            picked = []
            for w in noun:
                if w in STOP:
                    break
                picked.append(w)
            return "_".join(picked)
    return ""


def quote(question: str, numbers: list[str], leaf: str) -> str:
    """The words around a number where the question states it, in its clause: at most three words before
    it and two after ("he spent $24 on video games" -> "he spent $24 on video"), so that the verb that
    decides an operation (spent, deleted, each) stands next to the sum it decides; the bare number when
    the question's text does not hold its mask."""
    tokens = question.split()
    if leaf not in tokens:
        return number_text(numbers[int(leaf[6:])])
    at = tokens.index(leaf)
    start, end = max(0, at - 3), min(len(tokens), at + 3)
    for i in range(at - 1, start - 1, -1):  # (a clause ends at punctuation)
        if re.fullmatch(r"[.,?!;:]", tokens[i]):
            start = i + 1
            break
    for i in range(at + 1, end):
        if re.fullmatch(r"[.,?!;:]", tokens[i]):
            end = i
            break
    return detokenize(unmask(" ".join(tokens[start:end]), numbers))


def said(numbers: list[str]) -> str:
    """A problem's numbers as a sentence lists them: "9, 27 and 20"."""
    listed = [number_text(n) for n in numbers]
    return " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 1 else listed)


def convert(record: dict, style: str = "stepwise", cue: bool = False) -> tuple[str, str, list, str, int]:
    """(question, reasoning, chain of steps for chains.chain_code, answer, operations) of one record,
    in the stepwise or formulaic style (each operation on numbers) or the named one (each quantity a
    name); with cue, the question ends with its numbers listed, a count the policy cannot rewrite."""
    numbers = record["Numbers"].split()
    tree = parse_prefix(record["Equation"])
    leaves, operations = [], []

    def walk(node):  # the operations in the order they are computed (children first)
        if isinstance(node, str):
            leaves.append(node)
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

    # a number as printed, a result by its value
    if style in ("formulaic", "stepwise", "counted", "symbolic", "quoted"):
        def shown(node):
            if isinstance(node, str):
                return number_text(numbers[int(node[6:])])
            return number_text(str(round(value_of(node), 6)))
        reasoning, steps = formulaic([(f"{shown(op[1])} {op[0]} {shown(op[2])}", shown(op))
                                      for op in operations], stepwise=style != "formulaic")
        if style == "counted":  # two numbers take one operation in 629 of 630 problems, three take two in 79%
            reasoning = f"The numbers are {said(numbers)}. {reasoning}"
        if style == "symbolic":
            reasoning = symbolic(steps)
        if style == "quoted":  # each operation after the question's words for the numbers it brings in
            sentences = []
            for i, (op, (_, expression, result)) in enumerate(zip(operations, steps)):
                quoted = " and ".join(f'"{quote(record["Question"], numbers, leaf)}"'
                                      for leaf in op[1:] if isinstance(leaf, str))
                sentences.append(f"{'Then,' if i else 'First,'} {quoted + ': ' if quoted else ''}"
                                 f"{expression} = {result}.")
            reasoning = " ".join(sentences)
        return question, reasoning, steps, answer, len(operations)
    names = leaf_names(record["Question"], numbers, leaves)
    steps = [(names[leaf], number_text(numbers[int(leaf[6:])]), number_text(numbers[int(leaf[6:])]))
             for leaf in sorted(names, key=lambda leaf: int(leaf[6:]))]
    used, words = set(names.values()), {}  # words: a node's name as the reasoning says it

    def name_of(node):
        return names[node] if isinstance(node, str) else words[id(node)][0]

    noun = asked_noun(record["Ques"])
    sentences = [f"The question: {detokenize(unmask(record['Ques'], numbers))}"]
    for node in operations:
        op, left, right = node
        final = node is tree
        if final:  # the answer is named after what the question asks for, when it says
            name = ANSWER[op].format(noun.replace("_", " ")) if noun else "answer"
        else:
            name = PARTIAL[op]
        name = quantity_name(name, used, "answer", most=4)
        words[id(node)] = (name,)
        expression = f"{number_text(str(value_of(left)))} {op} {number_text(str(value_of(right)))}"
        steps.append((name, expression, number_text(str(value_of(node)))))

        def say(n):
            if isinstance(n, str):
                return f"the {number_text(numbers[int(n[6:])])} {spoken(names[n])}"
            return f"the {spoken(name_of(n))}"
        sentence = WHY[op].format(a=say(left), b=say(right), r=spoken(name))
        sentences.append(sentence[0].upper() + sentence[1:])
    sentences.append("I will let the code compute it.")
    return question, " ".join(sentences), steps, answer, len(operations)


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
    parser.add_argument("--style", default="stepwise",
                        choices=["stepwise", "formulaic", "named", "counted", "symbolic", "quoted"],
                        help="stepwise: each operation on numbers, a step in the reasoning and the code "
                             "(6.7 points over formulaic on training problems: docs/words.md); formulaic: "
                             "the last step the answer's sentence; named: each quantity a Python name from "
                             "the problem's words; counted: stepwise after the problem's numbers listed; "
                             "symbolic: stepwise's code lines as the reasoning, no value written (10.5 "
                             "points below stepwise after 48 SFT steps); quoted: stepwise, each operation "
                             "after the question's words for the numbers it brings in (15.8 points below "
                             "stepwise after an epoch)")
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
            question, reasoning, steps, answer, operations = convert(record, args.style, cue)
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
    print(f"{len(records)} distinct problems; SFT ({args.style}): {n_made} of {len(sft)} converted, "
          f"{n_fixed} with a failing first call, {len(multi)} of two or more operations, "
          f"{len(made) - n_made} repeats of those; left out: {dict(counts) or 'none'}")


if __name__ == "__main__":
    main()
