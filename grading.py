"""The grading behind the reward (docs/design.md §3): is the model's answer equivalent to the gold one.

Plain numbers (all RL answers are integers) are compared exactly here; math-verify decides the rest.
"""
import re

_NUMBER_WRAPPERS = [re.compile(p, re.DOTALL) for p in
                    (r"^\$+(.*?)\$+$", r"^\\\((.*)\\\)$", r"^\\\[(.*)\\\]$", r"^\\boxed\s*\{(.*)\}$")]
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}([, ]\d{3})+")
_DECIMAL_RE = re.compile(r"[+-]?\d+(\.\d*)?")


def as_number(text: str) -> int | float | None:
    """A plain number as written, else None (fractions, expressions, units, lists...). Accepted around
    it: whitespace, $...$, \\(...\\), \\[...\\], \\boxed{...} and a final period, in any order; within
    it: a sign, leading zeros, thousands separators ("1,000", "1{,}000", "1\\,000", "1 000") and a
    decimal point. An integer ("12.0" included) comes back as an int, exact however large."""
    s, before = str(text).strip(), None
    while s != before:  # peel the wrappers: "$\\boxed{12}$", "\\boxed{$12$}."
        before = s
        s = s.rstrip(".").strip()
        for wrapper in _NUMBER_WRAPPERS:
            s = wrapper.sub(r"\1", s).strip()
    s = s.replace("{,}", ",").replace("\\,", ",").replace("\\!", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    if not _DECIMAL_RE.fullmatch(s):
        return None
    whole, _, fraction = s.partition(".")
    return float(s) if fraction.strip("0") else int(whole)


def grade(answers: list[str | None], golds: list[str], sandbox=None) -> list[float | None]:
    """Verdicts for a batch: 1.0 (equivalent) or 0.0 (not, or no answer); None where the check did not
    complete because the sandbox failed (sandbox.SANDBOX_FAILURE: a worker died or hung), which says nothing
    about the answer: the caller must not score it 0 (rollout.score leaves such a sample out). An answer
    that makes the check fail (error, timeout) scores 0.0. Plain numbers are compared exactly here;
    math-verify decides the rest, in one batch in the sandbox's workers (under their hard timeout). Without
    a sandbox it runs in this process (never None): fine for scripts and tests, but in training pass the
    sandbox, so that a pathological answer cannot hang the trainer."""
    rewards, undecided = [0.0] * len(answers), []
    for i, (answer, gold) in enumerate(zip(answers, golds)):
        if answer is None:
            continue
        a, g = as_number(answer), as_number(gold)
        if a is None or g is None:
            undecided.append(i)
        else:
            rewards[i] = float(a == g)
    if undecided:
        pairs = [(answers[i], golds[i]) for i in undecided]
        if sandbox is not None:
            verdicts = sandbox.verify_batch(pairs)
        else:  # math-verify returns False (never raises) for what it cannot read
            from math_verify import parse, verify
            verdicts = [verify(parse("\\boxed{" + g + "}"), parse("\\boxed{" + a + "}")) for a, g in pairs]
        for i, ok in zip(undecided, verdicts):
            rewards[i] = None if ok is None else float(ok)
    return rewards
