"""RL problems for train.py: public math sets, integer answers only, de-duplicated, decontaminated.

    python data/prepare_eval.py                       # first: the benchmarks to decontaminate against
    python data/prepare_rl.py                         # DAPO-Math-17k (English) -> data/rl.jsonl
    python data/prepare_rl.py --openmath-rows 200000  # also scan OpenMathReasoning (paper §4.2)

What it does, in order (paper §4.2):
1. reads the benchmark problems (data/eval/<name>.jsonl, written by prepare_eval.py);
2. downloads the sources through the Hugging Face datasets-server /rows API (JSON, 100 rows a
   request, standard library only): open-r1/DAPO-Math-17k-Processed (config en), and optionally
   nvidia/OpenMathReasoning, keeping its problems with an extracted answer that Qwen2.5-72B-TIR
   reached at least --openmath-min-pass-rate of the time (the paper instead kept problems whose
   answer Qwen3-32B reproduced at least twice in 16 samples; we have no such run);
3. keeps integer answers only (integer_answer below says exactly what counts);
4. drops repeated questions (same normalised words, see `words`), the first one wins;
5. drops every problem that shares an 8-gram of normalised words with any benchmark problem;
6. writes {"question", "answer"} JSONL and prints what each step kept and dropped, per source.
The helpers at the top (HTTP rows download, JSONL, text normalisation) are shared with
prepare_eval.py and prepare_sft.py.
"""
import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

# -----------------------------------------------------------------------------
# Download: the datasets-server /rows API, 100 rows a request. HF_TOKEN (if set) is sent for
# gated sets. Everything else in these scripts is pure functions of the downloaded rows.

HUB_ROWS_URL = "https://datasets-server.huggingface.co"
PAGE = 100  # the API's maximum


class FetchError(RuntimeError):
    pass


def get_json(url, retries=4):
    """GET a JSON document; retries rate limits (429), server errors and network errors with backoff."""
    headers = {"User-Agent": "rstar2-agent-data"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
                return json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            if e.code not in (429, 500, 502, 503, 504) or attempt == retries:
                raise
        except urllib.error.URLError:
            if attempt == retries:
                raise
        time.sleep(2 ** attempt)


def fetch_hint(dataset, http_code):
    page = f"https://huggingface.co/datasets/{dataset}"
    if http_code in (401, 403):
        return f"the set is gated: accept its terms on {page} and export HF_TOKEN=<a read token>"
    if http_code in (404, 422):
        return f"its name, config or split may have changed: check {page}"
    if http_code:
        return "the datasets-server is busy or still preparing this set: wait a few minutes and run again"
    return "this needs internet access to huggingface.co (behind a proxy: export https_proxy=...)"


def fetch_rows(dataset, config, split, max_rows=None, fields=None, base_url=HUB_ROWS_URL):
    """Yield the rows (dicts, only `fields` if given) of one split in order. The API cuts very long
    cells short: a row lists such cells among `fields` under "_truncated" so the caller can drop it.
    Raises FetchError with a hint."""
    offset = 0
    while max_rows is None or offset < max_rows:
        query = urllib.parse.urlencode(dict(dataset=dataset, config=config, split=split, offset=offset, length=PAGE))
        url = f"{base_url}/rows?{query}"
        try:
            page = get_json(url)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise FetchError(f"could not download {dataset} ({config}/{split}) at offset {offset}: {e}\n"
                             f"    url: {url}\n---> HINT: {fetch_hint(dataset, getattr(e, 'code', None))}") from None
        for item in page.get("rows", []):
            if max_rows is not None and offset >= max_rows:
                return
            row, cut = item["row"], item.get("truncated_cells") or []
            if fields is not None:
                row, cut = {k: row.get(k) for k in fields}, [c for c in cut if c in fields]
            yield dict(row, _truncated=cut)
            offset += 1
        if not page.get("rows") or offset >= page.get("num_rows_total", 0):
            return


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# -----------------------------------------------------------------------------
# Integer answers. Accepted, and written as the plain integer: surrounding whitespace, $...$,
# \(...\), \boxed{...}, a trailing period, a leading + or -, leading zeros ("033" -> "33"),
# thousands separators ("1,000", "1{,}000", "1\,000", "1 000"), and a decimal point followed only
# by zeros ("12.0" -> "12": the same number, which the grader also accepts). Rejected: anything
# else (fractions, other decimals, expressions, units, lists, several answers) and integers of
# more than max_digits digits (like the paper's Project Euler giants, most likely a bad label).

_WRAPPERS = [re.compile(p, re.DOTALL) for p in
             (r"^\$+(.*?)\$+$", r"^\\\((.*)\\\)$", r"^\\\[(.*)\\\]$", r"^\\boxed\s*\{(.*)\}$")]
_INTEGER = re.compile(r"[+-]?\d+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}([, ]\d{3})+")


def integer_answer(raw, max_digits=20):
    """(the answer as a canonical integer string, "ok") or (None, the reason it is not one)."""
    s = str(raw).strip()
    changed = True
    while changed:  # peel wrappers in any order: "$\boxed{12}$", "\boxed{$12$}."
        before = s
        s = s.rstrip(".").strip()
        for w in _WRAPPERS:
            s = w.sub(r"\1", s).strip()
        changed = s != before
    s = s.replace("{,}", ",").replace("\\,", ",").replace("\\!", "")
    if not s:
        return None, "empty answer"
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    if re.fullmatch(r"[+-]?\d+\.0*", s):
        s = s.split(".")[0]
    if not _INTEGER.fullmatch(s):
        return None, "not an integer"
    n = int(s)
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
_ALIASES = {"dfrac": "frac", "tfrac": "frac", "dbinom": "binom", "tbinom": "binom", "leq": "le", "geq": "ge", "neq": "ne"}
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
# Sources: each turns one downloaded row into (record, "ok") or (None, why it is skipped).

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
    parser = argparse.ArgumentParser(description="Build the RL problem set: integer answers, de-duplicated, decontaminated.")
    parser.add_argument("--out", default="data/rl.jsonl", help="output JSONL of {question, answer}")
    parser.add_argument("--eval-dir", default="data/eval", help="where prepare_eval.py wrote the benchmarks")
    parser.add_argument("--benchmarks", nargs="+", default=["aime24", "aime25", "hmmt25", "math500"], help="benchmark names (files in --eval-dir) or JSONL paths to decontaminate against")
    parser.add_argument("--ngram", type=int, default=8, help="a problem sharing this many consecutive words with a benchmark problem is dropped")
    parser.add_argument("--max-digits", type=int, default=20, help="longest integer answer kept")
    parser.add_argument("--dapo-rows", type=int, default=None, help="read at most this many DAPO rows (default: all)")
    parser.add_argument("--openmath-rows", type=int, default=0, help="also scan this many OpenMathReasoning rows (0: skip; rows repeat each problem many times)")
    parser.add_argument("--openmath-split", default="cot", help="OpenMathReasoning split to scan")
    parser.add_argument("--openmath-min-pass-rate", type=float, default=0.125, help="keep OpenMathReasoning problems Qwen2.5-72B-TIR solved at least this often")
    parser.add_argument("--hub-url", default=HUB_ROWS_URL, help="datasets-server base URL")
    args = parser.parse_args(argv)

    # benchmarks first: a missing file should fail before a long download
    benchmarks = {}
    for b in args.benchmarks:
        path = b if os.path.exists(b) else os.path.join(args.eval_dir, f"{b}.jsonl")
        if not os.path.exists(path):
            sys.exit(f"benchmark {b!r} not found at {path}\n---> HINT: run `python data/prepare_eval.py "
                     f"--out-dir {args.eval_dir}` first (decontamination needs the benchmark problems)")
        benchmarks[b] = read_jsonl(path)
    grams = benchmark_ngrams(benchmarks, n=args.ngram)
    print(f"decontaminating against {', '.join(f'{k} ({len(v)})' for k, v in benchmarks.items())}: {len(grams)} grams")

    sources = [("dapo", "open-r1/DAPO-Math-17k-Processed", "en", "train", args.dapo_rows, ["prompt", "solution"], from_dapo)]
    if args.openmath_rows:
        sources.append(("openmath", "nvidia/OpenMathReasoning", "default", args.openmath_split, args.openmath_rows,
                        ["problem", "expected_answer", "problem_type", "pass_rate_72b_tir"],
                        lambda row: from_openmath(row, args.openmath_min_pass_rate)))
    records, stats = [], Counter()
    for name, dataset, config, split, max_rows, fields, convert in sources:
        print(f"downloading {dataset} ({config}/{split}) ...", flush=True)
        try:
            for row in fetch_rows(dataset, config, split, max_rows, fields, base_url=args.hub_url):
                rec, why = (None, "cut short by the rows API") if row["_truncated"] else convert(row)
                if rec is None:
                    stats[name, why] += 1
                else:
                    records.append(dict(rec, source=name))
        except FetchError as e:
            sys.exit(str(e))
    kept, clean_stats = clean(records, grams, args.max_digits)
    stats.update(clean_stats)
    write_jsonl(args.out, kept)

    for name, *_ in sources:
        rows = {why: c for (src, why), c in stats.items() if src == name}
        print(f"{name}: {sum(rows.values())} rows, kept {rows.pop('kept', 0)}")
        for why, c in sorted(rows.items(), key=lambda kv: -kv[1]):
            print(f"    dropped {c:6d}  {why}")
    print(f"wrote {len(kept)} problems to {args.out}")
    return kept


if __name__ == "__main__":
    main()
