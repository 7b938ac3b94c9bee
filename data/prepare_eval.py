"""The evaluation benchmarks as {"question", "answer"} JSONL, one file per benchmark.

    python data/prepare_eval.py                          # all four -> data/eval/<name>.jsonl
    python data/prepare_eval.py --benchmarks aime24 --force

eval.py imports load_benchmark(name_or_path, cache_dir="data/eval"): a known name reads the cached
file (downloading it first if it is missing), anything else is a path to a local JSONL with
"question" and "answer" on every line. Downloads use the Hugging Face datasets-server /rows API
(see prepare_rl.fetch_rows); answers are kept as the source writes them (strings), since HMMT and
MATH-500 have non-integer answers that the grader compares with math-verify.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_rl import HUB_ROWS_URL, FetchError, fetch_rows, write_jsonl  # noqa: E402

# name: (dataset, config, split, question field, answer field, number of problems)
BENCHMARKS = {
    "aime24": ("HuggingFaceH4/aime_2024", "default", "train", "problem", "answer", 30),
    "aime25": ("MathArena/aime_2025", "default", "train", "problem", "answer", 30),
    "hmmt25": ("MathArena/hmmt_feb_2025", "default", "train", "problem", "answer", 30),
    "math500": ("HuggingFaceH4/MATH-500", "default", "test", "problem", "answer", 500),
}


def convert(rows, question_field, answer_field):
    """Source rows -> [{"question", "answer"}]; raises if a row lacks either field."""
    out = []
    for i, row in enumerate(rows):
        q, a = row.get(question_field), row.get(answer_field)
        if not isinstance(q, str) or not q.strip() or a is None or not str(a).strip() or row.get("_truncated"):
            raise ValueError(f"row {i} has no usable {question_field!r}/{answer_field!r}: {str(row)[:200]}\n"
                             f"---> HINT: the dataset's columns may have changed; update BENCHMARKS in data/prepare_eval.py")
        out.append({"question": q.strip(), "answer": str(a).strip()})
    return out


def download_benchmark(name, cache_dir="data/eval", base_url=HUB_ROWS_URL):
    """Download one known benchmark into cache_dir/<name>.jsonl; returns its problems."""
    dataset, config, split, qf, af, expected = BENCHMARKS[name]
    problems = convert(fetch_rows(dataset, config, split, fields=[qf, af], base_url=base_url), qf, af)
    if len(problems) != expected:
        print(f"warning: {name} has {len(problems)} problems, expected {expected} ({dataset} may have changed)")
    write_jsonl(os.path.join(cache_dir, f"{name}.jsonl"), problems)
    return problems


def read_problems(path):
    """A local {"question", "answer"} JSONL, checked line by line."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})\n---> HINT: one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or row.get("answer") is None:
                raise ValueError(f'{path}:{n}: expected {{"question": str, "answer": ...}}, got {line.strip()[:200]}\n'
                                 f'---> HINT: every line needs a "question" and an "answer"')
            problems.append({"question": row["question"], "answer": str(row["answer"])})
    return problems


def load_benchmark(name_or_path, cache_dir="data/eval", base_url=HUB_ROWS_URL):
    """Problems [{"question", "answer"}] of a benchmark: a name in BENCHMARKS (read from
    cache_dir/<name>.jsonl, downloaded first if missing) or the path of a local JSONL."""
    if name_or_path in BENCHMARKS:
        path = os.path.join(cache_dir, f"{name_or_path}.jsonl")
        if not os.path.exists(path):
            try:
                download_benchmark(name_or_path, cache_dir, base_url)
            except FetchError as e:
                raise FetchError(f"{e}\n---> HINT: or run `python data/prepare_eval.py --out-dir {cache_dir}` on a "
                                 f"machine with internet and copy {path} here") from None
        return read_problems(path)
    if os.path.isfile(name_or_path):
        return read_problems(name_or_path)
    raise FileNotFoundError(f"unknown benchmark {name_or_path!r}: not one of {', '.join(BENCHMARKS)} and no such file\n"
                            f"---> HINT: pass a benchmark name or the path of a JSONL with \"question\" and \"answer\" per line")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download the evaluation benchmarks as {question, answer} JSONL.")
    parser.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS), help="which benchmarks")
    parser.add_argument("--out-dir", default="data/eval", help="cache folder: <out-dir>/<name>.jsonl")
    parser.add_argument("--force", action="store_true", help="download again even if the file exists")
    parser.add_argument("--hub-url", default=HUB_ROWS_URL, help="datasets-server base URL")
    args = parser.parse_args(argv)

    failed = []
    for name in args.benchmarks:
        path = os.path.join(args.out_dir, f"{name}.jsonl")
        if os.path.exists(path) and not args.force:
            print(f"{name}: {len(read_problems(path))} problems already in {path} (--force to download again)")
            continue
        try:
            problems = download_benchmark(name, args.out_dir, args.hub_url)
            print(f"{name}: {len(problems)} problems from {BENCHMARKS[name][0]} -> {path}")
        except (FetchError, ValueError) as e:
            print(f"{name}: FAILED\n{e}", file=sys.stderr)
            failed.append(name)
    if failed:
        sys.exit(f"could not prepare {', '.join(failed)} (see above)")


if __name__ == "__main__":
    main()
