"""RL problems for train.py: public math sets, integer answers only, de-duplicated, decontaminated.

    python data/prepare_eval.py                       # first: the benchmarks to decontaminate against
    python data/prepare_rl.py                         # DAPO-Math-17k (English) -> data/rl.jsonl
    python data/prepare_rl.py --openmath-rows 200000  # also scan OpenMathReasoning (paper §4.2)
    python data/prepare_rl.py --local dapo=dapo.parquet   # a copy of a source on disk instead of the hub

What it does, in order (paper §4.2):
1. reads the benchmark problems (data/eval/<name>.jsonl, written by prepare_eval.py);
2. reads the sources with datasets.load_dataset: open-r1/DAPO-Math-17k-Processed (config en,
   downloaded once and cached), and optionally nvidia/OpenMathReasoning (millions of rows: streamed,
   so --openmath-rows N reads only N of them), keeping its problems with an extracted answer that
   Qwen2.5-72B-TIR reached at least --openmath-min-pass-rate of the time (the paper instead kept
   problems whose answer Qwen3-32B reproduced at least twice in 16 samples; we have no such run);
   --local NAME=PATH reads a JSONL or parquet file with the source's columns through the same call;
3. keeps integer answers only (integer_answer below says exactly what counts);
4. drops repeated questions (same normalised words, see `words`), the first one wins;
5. drops every problem that shares an 8-gram of normalised words with any benchmark problem;
6. writes {"question", "answer"} JSONL and prints what each step kept and dropped, per source.
Downloads are cached by the library (HF_HOME or HF_DATASETS_CACHE say where); HF_HUB_OFFLINE=1
reads only that cache; HF_TOKEN is used if set. Whether the hub answers is asked once, before the
first source read from it (data/hub.py): without network the script stops at once, saying what to do.
"""
import argparse
import itertools
import json
import os
import re
import sys
from collections import Counter

from datasets import load_dataset
from datasets.exceptions import DatasetsError

import hub

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout import as_number  # noqa: E402


# -----------------------------------------------------------------------------
# Integer answers: rollout.as_number reads the number (it says what it accepts around and within
# one: $...$, \boxed{...}, a sign, leading zeros, thousands separators, a decimal point); an
# integer is kept as its plain digits ("033" -> "33", "1{,}000" -> "1000", "12.0" -> "12": the same
# number, which the grader also accepts). Rejected: anything else (fractions, other decimals,
# expressions, units, lists, several answers) and integers of more than max_digits digits (like the
# paper's Project Euler giants, most likely a bad label).

_WRAPPING = re.compile(r"\\boxed|[\s$.{}()\[\]\\]")  # an answer made of these alone is empty


def integer_answer(raw, max_digits=20):
    """(the answer as a canonical integer string, "ok") or (None, the reason it is not one)."""
    if not _WRAPPING.sub("", str(raw)):
        return None, "empty answer"
    n = as_number(raw)
    if not isinstance(n, int):
        return None, "not an integer"
    if len(str(abs(n))) > max_digits:
        return None, f"more than {max_digits} digits"
    return str(n), "ok"


# -----------------------------------------------------------------------------
# Text normalisation for de-duplication and decontamination: lowercase; a LaTeX command counts as
# its name ("\le" -> "le"; "\dfrac", "\leq" count as "frac", "le"), except layout commands, which
# vanish (\left, \right, \displaystyle, \text, \mathrm, spacing...); everything that is not a letter
# or digit ($ { } ^ _ punctuation, whitespace) separates words. A problem is then its list of words.

_LAYOUT = {"left", "right", "big", "bigl", "bigr", "displaystyle", "textstyle", "text", "textbf", "mathrm",
           "mathbf", "mbox", "operatorname", "quad", "qquad", "hspace", "vspace"}
_ALIASES = {"dfrac": "frac", "tfrac": "frac", "dbinom": "binom", "tbinom": "binom",
            "leq": "le", "geq": "ge", "neq": "ne"}
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
_WORD = re.compile(r"[^\W_]+")


def words(text):
    def command(m):
        name = m.group(1).lower()
        return " " if name in _LAYOUT else " " + _ALIASES.get(name, name) + " "
    return _WORD.findall(_COMMAND.sub(command, text).lower())


def ngrams(ws, n):
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def benchmark_ngrams(benchmarks, n=8, min_words=3):
    """{n-gram: benchmark name} over all benchmark problems. A problem shorter than n words (MATH-500
    has some: "Compute $\\dbinom{16}{5}$.") contributes its whole word sequence, if at least
    min_words long, so a training problem that contains it is still caught."""
    grams = {}
    for name, problems in benchmarks.items():
        for p in problems:
            ws = words(p["question"])
            for g in (ngrams(ws, n) if len(ws) >= n else [tuple(ws)] if len(ws) >= min_words else []):
                grams.setdefault(g, name)
    return grams


def contamination(question, grams):
    """The benchmark that `question` shares a gram with, or None."""
    ws = words(question)
    for size in sorted({len(g) for g in grams}):
        for g in ngrams(ws, size):
            if g in grams:
                return grams[g]
    return None


def clean(records, grams, max_digits=20):
    """records: {"question", "answer", "source"}. Returns (kept {"question", "answer"} rows,
    Counter of (source, outcome)), outcome being "kept" or why the record was dropped."""
    kept, seen, stats = [], set(), Counter()
    for r in records:
        answer, why = integer_answer(r["answer"], max_digits)
        key = " ".join(words(r["question"]))
        if answer is None:
            stats[r["source"], why] += 1
        elif not key:
            stats[r["source"], "empty question"] += 1
        elif key in seen:
            stats[r["source"], "duplicate question"] += 1
        elif (bench := contamination(r["question"], grams)) is not None:
            seen.add(key)
            stats[r["source"], f"overlaps {bench}"] += 1
        else:
            seen.add(key)
            kept.append({"question": r["question"].strip(), "answer": answer})
            stats[r["source"], "kept"] += 1
    return kept, stats


# -----------------------------------------------------------------------------
# Sources: each turns one row (its columns listed in main) into (record, "ok") or (None, why it is skipped).

_DAPO_HEAD = re.compile(r"^Solve the following math problem step by step\..*?"
                        r"where \$Answer is the answer to the problem\.\s*", re.DOTALL)
_DAPO_TAIL = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def from_dapo(row):
    """open-r1/DAPO-Math-17k-Processed: "prompt" (the problem) and "solution" (the final answer). The
    original DAPO instruction wrapper is removed if a row still has it."""
    q = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", row.get("prompt") or ""))
    return {"question": q, "answer": row.get("solution") or ""}, "ok"


def from_openmath(row, min_pass_rate=0.125):
    """nvidia/OpenMathReasoning: "problem", "expected_answer", "problem_type", "pass_rate_72b_tir"."""
    if row.get("problem_type") != "has_answer_extracted":
        return None, "no extracted answer"
    try:
        rate = float(row.get("pass_rate_72b_tir"))
    except (TypeError, ValueError):
        return None, "no pass rate"
    if rate < min_pass_rate:
        return None, f"pass rate < {min_pass_rate}"
    return {"question": row.get("problem") or "", "answer": row.get("expected_answer") or ""}, "ok"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build the RL problem set: integer answers, de-duplicated, "
                                                 "decontaminated.")
    parser.add_argument("--out", default="data/rl.jsonl", help="output JSONL of {question, answer}")
    parser.add_argument("--eval-dir", default="data/eval", help="where prepare_eval.py wrote the benchmarks")
    parser.add_argument("--benchmarks", nargs="+", default=["aime24", "aime25", "hmmt25", "math500"],
                        help="benchmark names (files in --eval-dir) or JSONL paths to decontaminate against")
    parser.add_argument("--ngram", type=int, default=8,
                        help="drop a problem sharing this many consecutive words with a benchmark problem")
    parser.add_argument("--max-digits", type=int, default=20, help="longest integer answer kept")
    parser.add_argument("--dapo-rows", type=int, default=None,
                        help="read at most this many DAPO rows (default: all)")
    parser.add_argument("--openmath-rows", type=int, default=0,
                        help="also scan this many OpenMathReasoning rows (rows repeat each problem many "
                             "times; 0: skip it, or read all of a file given with --local)")
    parser.add_argument("--openmath-split", default="cot", help="OpenMathReasoning split to scan")
    parser.add_argument("--openmath-min-pass-rate", type=float, default=0.125,
                        help="keep OpenMathReasoning problems Qwen2.5-72B-TIR solved at least this often")
    parser.add_argument("--local", nargs="+", default=[], metavar="NAME=PATH",
                        help="read source NAME (dapo, openmath) from a JSONL or parquet file with the hub "
                             "set's columns")
    args = parser.parse_args(argv)
    local = dict(item.partition("=")[::2] for item in args.local)
    if bad := [k for k, path in local.items() if k not in ("dapo", "openmath") or not path]:
        parser.error(f"--local takes NAME=PATH, NAME dapo or openmath; not {', '.join(bad)}")

    # benchmarks first: a missing file should fail before a long download
    benchmarks = {}
    for b in args.benchmarks:
        path = b if os.path.exists(b) else os.path.join(args.eval_dir, f"{b}.jsonl")
        if not os.path.exists(path):
            sys.exit(f"benchmark {b!r} not found at {path}\n---> HINT: run `python data/prepare_eval.py "
                     f"--out-dir {args.eval_dir}` first (decontamination needs the benchmark problems)")
        with open(path, encoding="utf-8") as f:
            benchmarks[b] = [json.loads(line) for line in f if line.strip()]
    grams = benchmark_ngrams(benchmarks, n=args.ngram)
    counts = ", ".join(f"{k} ({len(v)})" for k, v in benchmarks.items())
    print(f"decontaminating against {counts}: {len(grams)} grams")

    # name: (dataset, config, split, columns, rows to read (None: all), streamed, converter)
    sources = {"dapo": ("open-r1/DAPO-Math-17k-Processed", "en", "train", ["prompt", "solution"],
                        args.dapo_rows, False, from_dapo)}
    if args.openmath_rows or "openmath" in local:
        sources["openmath"] = ("nvidia/OpenMathReasoning", "default", args.openmath_split,
                               ["problem", "expected_answer", "problem_type", "pass_rate_72b_tir"],
                               args.openmath_rows or None, True,
                               lambda row: from_openmath(row, args.openmath_min_pass_rate))
    from_hub = [name for name in sources if name not in local]
    if from_hub and (hub_down := hub.unreachable()):
        sys.exit(f"{', '.join(from_hub)}: cannot read from the hub: {hub_down}\n"
                 f"---> HINT: {hub.hint(f'--local {from_hub[0]}=FILE')}")
    records, stats = [], Counter()
    for name, (dataset, config, split, columns, max_rows, streaming, convert) in sources.items():
        file = local.get(name)
        where = file or f"{dataset} ({config}/{split})"
        print(f"{name}: reading {where} ...", flush=True)
        try:
            if file:  # load_dataset("json" | "parquet", data_files=...) reads a file as it reads a hub set
                kind = "parquet" if file.endswith(".parquet") else "json"
                rows = load_dataset(kind, data_files=file, split="train", streaming=streaming)
            else:
                rows = load_dataset(dataset, config, split=split, streaming=streaming)
            for row in itertools.islice(rows.select_columns(columns), max_rows):
                rec, why = convert(row)
                if rec is None:
                    stats[name, why] += 1
                else:
                    records.append(dict(rec, source=name))
        except (OSError, ValueError, DatasetsError) as e:  # no such file or set, no network, a renamed column
            if isinstance(e, ConnectionError):  # no network, or HF_DATASETS_OFFLINE=1 with nothing cached
                hint = (f"without network, read a copy on disk (--local {name}=FILE) or what an earlier run "
                        f"cached (HF_DATASETS_OFFLINE=1)")
            else:  # the columns are named in `sources` above
                hint = (f"{where} must exist and have the columns {', '.join(columns)} "
                        f"(`sources` in data/prepare_rl.py)")
            sys.exit(f"{name}: could not read {where}: {e}\n---> HINT: {hint}")
    kept, clean_stats = clean(records, grams, args.max_digits)
    stats.update(clean_stats)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)

    for name in sources:
        rows = {why: c for (src, why), c in stats.items() if src == name}
        print(f"{name}: {sum(rows.values())} rows, kept {rows.pop('kept', 0)}")
        for why, c in sorted(rows.items(), key=lambda kv: -kv[1]):
            print(f"    dropped {c:6d}  {why}")
    print(f"wrote {len(kept)} problems to {args.out}")
    return kept


if __name__ == "__main__":
    main()
