"""GSM8K for the real recipe: RL problems, a held-out slice and tool-using SFT conversations, disjoint.

    python data/prepare_gsm8k.py                                  # openai/gsm8k (main), train split
    python data/prepare_gsm8k.py --local gsm8k=../shared/data/gsm8k/train.jsonl --out data/gsm8k

GSM8K's worked solutions carry calculator annotations: "Natalia sold 48/2 = <<48/2=24>>24 clips in
May." ends in "#### 72". What it writes into --out, deterministically from --seed:
1. test.jsonl: --n-test held-out problems {"question", "answer"}; never trained on.
2. sft.jsonl: --n-sft conversations {"messages"} in the rollout's format, each built from a solution:
   - the reasoning in words: the solution's sentences, the annotations taken out;
   - a tool call whose code computes the chain: each annotation becomes a named quantity
     (`clips_in_may = 48 / 2`, the name from the words after it), an earlier result used again is
     used by its name, and the last one is printed;
   - the tool's output as the sandbox prints it (the code is run here; nothing is invented);
   - the answer in \\boxed{}: the solution's own final answer.
   A share (--error-share) first makes a call that fails (an unclosed parenthesis, or a name that
   was never defined) and fixes it in the next turn, as the toy SFT data does: RoC then has clean
   and unclean positives to choose between. A solution whose annotations do not compute its final
   answer (about 6%: an unannotated last step) is left out and counted.
3. train.jsonl: the remaining problems with an integer answer, for RL; each records the calculator
   steps its solution takes ("steps"), and easy.jsonl holds those of at most --easy-steps, for a
   first RL stage whose groups are not all wrong (a 135M model solves few of the rest).
The three sets are disjoint by construction (one shuffled list, cut in three). Unlike the paper's SFT,
this one carries reasoning: a 135M model has none of its own to call a tool from (docs/paper_differences.md).
"""
import argparse
import os
import random
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hub  # noqa: E402  (data/hub.py)
from chains import Skip, chain_code, conversations, plan_calls, quantity_name, write_sets  # noqa: E402
from rollout import as_number  # noqa: E402

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
ANNOTATION = re.compile(r"<<([^=<>]*)=([^<>]*)>>")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


# -----------------------------------------------------------------------------
# A solution -> the reasoning in words, the steps of the chain, the final answer

def parse_solution(answer: str) -> tuple[str, list[tuple[str, str, str]], str]:
    """(reasoning, [(name, expression, result as annotated)], final answer) of a GSM8K answer field."""
    body, sep, final = answer.rpartition("####")
    if not sep:
        raise Skip("no #### final answer")
    steps, used = [], set()
    for match in ANNOTATION.finditer(body):
        expression, result = match.group(1).strip(), match.group(2).strip()
        after = body[match.end():].split("\n")[0]
        words = after[len(result):] if after.startswith(result) else after
        steps.append((quantity_name(words, used, f"step{len(steps) + 1}"), expression, result))
    reasoning = "\n".join(line.strip() for line in ANNOTATION.sub("", body).strip().split("\n"))
    return reasoning, steps, final.strip().replace(",", "")


def integer(text: str) -> str | None:
    value = as_number(text)
    return str(value) if isinstance(value, int) else None


# -----------------------------------------------------------------------------
# The script: read, split, convert (every call run in the sandbox), write

def read_rows(local: str | None) -> list[dict]:
    from datasets import load_dataset  # (here: the conversion above is tested without it)
    if local:  # a copy of the hub set on disk, read through the same call
        kind = "parquet" if local.endswith(".parquet") else "json"
        return list(load_dataset(kind, data_files=local, split="train"))
    if hub_down := hub.unreachable():  # (asked once, at once: the library would retry for ~24 s)
        sys.exit(f"gsm8k: cannot read {HUB_ID} from the hub: {hub_down}\n"
                 f"---> HINT: {hub.hint('--local gsm8k=FILE')}")
    return list(load_dataset(HUB_ID, HUB_CONFIG, split="train"))


def main():
    parser = argparse.ArgumentParser(description="GSM8K -> RL problems, held-out problems, SFT conversations.")
    parser.add_argument("--out", default="data/gsm8k", help="output folder")
    parser.add_argument("--local", default=None, metavar="gsm8k=PATH",
                        help="read GSM8K's train split from a JSONL or parquet file instead of the hub")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle and the failing calls")
    parser.add_argument("--n-test", type=int, default=300, help="held-out problems (never trained on)")
    parser.add_argument("--n-sft", type=int, default=2000,
                        help="problems whose solutions become SFT conversations")
    parser.add_argument("--error-share", type=float, default=0.25, help="share of SFT conversations whose "
                        "first call fails and is fixed")
    parser.add_argument("--easy-steps", type=int, default=2,
                        help="easy.jsonl: the RL problems whose solution takes at most this many steps")
    args = parser.parse_args()
    name, _, local = (args.local or "gsm8k=").partition("=")
    if name != "gsm8k" or (args.local and not local):
        parser.error(f"--local takes gsm8k=PATH, not {args.local}")

    rows = read_rows(local or None)
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    test_ids, sft_ids = order[:args.n_test], order[args.n_test:args.n_test + args.n_sft]
    train_ids = order[args.n_test + args.n_sft:]
    counts, rng = Counter(), random.Random(args.seed + 1)

    plans = []  # (question, reasoning, calls, final answer)
    for i in sft_ids:
        try:
            reasoning, steps, final = parse_solution(rows[i]["answer"])
            code = chain_code(steps)
        except Skip as e:
            counts[str(e)] += 1
            continue
        plans.append((rows[i]["question"], reasoning, plan_calls(code, rng, args.error_share), final))
    made = conversations(plans, counts)

    def problems(ids):
        kept = [{"question": rows[i]["question"], "answer": integer(rows[i]["answer"].rpartition("####")[2]),
                 "steps": len(ANNOTATION.findall(rows[i]["answer"]))} for i in ids]
        return [p for p in kept if p["answer"] is not None]

    train = problems(train_ids)
    easy = [p for p in train if p["steps"] <= args.easy_steps]
    write_sets(args.out, {"test.jsonl": problems(test_ids), "train.jsonl": train, "easy.jsonl": easy,
                          "sft.jsonl": made})
    n_fixed = sum(len(c["messages"]) > 4 for c in made)
    print(f"SFT: {len(made)} of {len(sft_ids)} solutions converted, {n_fixed} with a failing first "
          f"call; left out: {dict(counts) or 'none'}")


if __name__ == "__main__":
    main()
