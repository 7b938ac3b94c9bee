"""The evaluation benchmarks as {"question", "answer"} JSONL, one file per benchmark, for eval.py.

    python data/prepare_eval.py                          # all four -> data/eval/<name>.jsonl
    python data/prepare_eval.py --benchmarks aime24 --force
    python data/prepare_eval.py --local aime24=aime_2024.parquet   # a copy of a set on disk

What it does, for each benchmark:
1. skips it if <out-dir>/<name>.jsonl already exists (--force writes it again);
2. reads the set with datasets.load_dataset (it is small: downloaded once and cached), or, with
   --local NAME=PATH, a JSONL or parquet file with the hub set's columns through the same call;
3. keeps the question and the answer of every row that has both (and counts the rows that do not),
   answers as the source writes them (strings, since HMMT and MATH-500 have non-integer answers that
   the grader compares with math-verify), and warns if the number of problems is not the expected one;
4. writes the file and prints the count; the benchmarks that could not be read are named at the end,
   with what to do, and the exit status is non-zero.
Downloads are cached by the library (HF_HOME or HF_DATASETS_CACHE say where); HF_HUB_OFFLINE=1
reads only that cache. Whether the hub answers is asked once, before the first read from it
(data/hub.py): without network every hub benchmark fails at once, with what to do.
"""
import argparse
import json
import os
import sys

from datasets import load_dataset
from datasets.exceptions import DatasetsError

import hub

# name: (dataset, config, split, question column, answer column, number of problems)
BENCHMARKS = {
    "aime24": ("HuggingFaceH4/aime_2024", "default", "train", "problem", "answer", 30),
    "aime25": ("MathArena/aime_2025", "default", "train", "problem", "answer", 30),
    "hmmt25": ("MathArena/hmmt_feb_2025", "default", "train", "problem", "answer", 30),
    "math500": ("HuggingFaceH4/MATH-500", "default", "test", "problem", "answer", 500),
}


def convert(rows, question_column, answer_column):
    """Source rows -> ([{"question", "answer"}], number of rows dropped for lacking either)."""
    out, dropped = [], 0
    for row in rows:
        q, a = row[question_column], row[answer_column]
        if isinstance(q, str) and q.strip() and a is not None and str(a).strip():
            out.append({"question": q.strip(), "answer": str(a).strip()})
        else:
            dropped += 1
    return out, dropped


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the benchmarks as {question, answer} JSONL.")
    parser.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS),
                        help="which benchmarks")
    parser.add_argument("--out-dir", default="data/eval", help="where to write <name>.jsonl")
    parser.add_argument("--force", action="store_true", help="write a benchmark even if its file exists")
    parser.add_argument("--local", nargs="+", default=[], metavar="NAME=PATH",
                        help="read benchmark NAME from a JSONL or parquet file with the hub set's columns")
    args = parser.parse_args(argv)
    local = dict(item.partition("=")[::2] for item in args.local)
    if bad := [k for k, path in local.items() if k not in BENCHMARKS or not path]:
        parser.error(f"--local takes NAME=PATH, NAME one of {', '.join(BENCHMARKS)}; not {', '.join(bad)}")

    failed, hub_down = [], None  # (whether the hub answers is asked once, before its first read)
    for name in args.benchmarks:
        path = os.path.join(args.out_dir, f"{name}.jsonl")
        if os.path.exists(path) and not args.force:
            with open(path, encoding="utf-8") as f:
                count = sum(1 for line in f if line.strip())
            print(f"{name}: {count} problems already in {path} (--force to write it again)")
            continue
        dataset, config, split, question_column, answer_column, expected = BENCHMARKS[name]
        file = local.get(name)
        source = file or f"{dataset} ({config}/{split})"
        if not file and hub_down is None:
            hub_down = hub.unreachable() or ""
        if not file and hub_down:
            hint = hub.hint(f"--local {name}=FILE")
            print(f"{name}: FAILED to read {source}: {hub_down}\n---> HINT: {hint}", file=sys.stderr)
            failed.append(name)
            continue
        try:
            if file:  # load_dataset("json" | "parquet", data_files=...) reads a file as it reads a hub set
                kind = "parquet" if file.endswith(".parquet") else "json"
                rows = load_dataset(kind, data_files=file, split="train")
            else:
                rows = load_dataset(dataset, config, split=split)
            rows = rows.select_columns([question_column, answer_column])
        except (OSError, ValueError, DatasetsError) as e:  # no such file or set, no network, a renamed column
            if isinstance(e, ConnectionError):  # no network, or HF_DATASETS_OFFLINE=1 and not cached
                hint = (f"run where huggingface.co is reachable (then HF_DATASETS_OFFLINE=1 reads the cache) "
                        f"or pass a copy on disk: --local {name}=FILE")
            else:  # the columns are named in BENCHMARKS
                hint = (f"{source} must exist and have the columns {question_column} and {answer_column} "
                        f"(BENCHMARKS in data/prepare_eval.py)")
            print(f"{name}: FAILED to read {source}: {e}\n---> HINT: {hint}", file=sys.stderr)
            failed.append(name)
            continue
        problems, dropped = convert(rows, question_column, answer_column)
        if dropped:
            print(f"{name}: dropped {dropped} rows without a question or an answer")
        if len(problems) != expected:
            print(f"warning: {name} has {len(problems)} problems, not {expected} ({source} may have changed)")
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in problems)
        print(f"{name}: {len(problems)} problems from {source} -> {path}")
    if failed:
        sys.exit(f"could not prepare {', '.join(failed)} (see above)")


if __name__ == "__main__":
    main()
