"""Binary math reward: is the last ``\\boxed{...}`` of a completion equal to the reference answer?

Equality is math_verify's (``parse`` + ``verify``: ``\\frac{1}{2}`` == ``0.5``, ``049`` == ``49``),
behind a fast path for plain numbers, which covers the tiny task and GSM8K without sympy.

Timeouts: math_verify bounds its sympy work with ``signal.alarm``, which only works in the main
thread of a process. In the main thread we keep that bound (``SYMPY_TIMEOUT_S`` per call; it
replaces the SIGALRM handler meanwhile and cancels any alarm the caller had set); in any other
thread we turn it off, because otherwise math_verify raises. Off the main thread a
pathological answer (``\\boxed{9^{9^{9^{9}}}}``) can then run for a very long time, so callers
there must bound the wall-clock time themselves (reward/pool.py runs rewards in processes it can
kill).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

from math_verify import parse, verify
from math_verify.errors import TimeoutException

from ..data.jsonl import GSM8K_ANSWER_MARK, final_answer

SYMPY_TIMEOUT_S = 3  # whole seconds: signal.alarm's resolution
MAX_ANSWER_CHARS = 1000  # a longer boxed answer is not a real answer; don't hand it to sympy
MAX_SCAN_CHARS = 1 << 20    # the end of a completion searched for its answer (1 MiB of text)

_BOXED = "\\boxed{"
_BRACES = re.compile(r"\\boxed\{|[{}]")
# 42, -7, 1,000, 3.25, .5 (GSM8K writes thousands separators); not 1e3, not 1,00.
_PLAIN_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?|[+-]?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None if there is none; an
    unclosed one (e.g. a truncated completion) is skipped for an earlier, complete one.

    One pass over the braces with a stack (a box closes where the brace depth counted from its
    own ``{`` returns to 0), so text full of unclosed boxes costs no more than its length."""
    stack: list[int] = []       # the open braces: a box's content start, or -1 for a plain {
    best = None
    for m in _BRACES.finditer(text):
        if m.group() == "}":
            if stack and (start := stack.pop()) >= 0 and (best is None or start > best[0]):
                best = (start, m.start())
        else:
            stack.append(m.end() if m.group() == _BOXED else -1)
    return None if best is None else text[best[0]:best[1]]


_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)


def _after_mark(text: str) -> str | None:
    if GSM8K_ANSWER_MARK not in text:
        return None
    return final_answer(text).split("\n", 1)[0]


def _answer_line(text: str) -> str | None:
    found = _ANSWER_LINE.findall(text)
    return found[-1] if found else None


def _last_number(text: str) -> str | None:
    found = [m.group(0) for m in _PLAIN_NUMBER.finditer(text)]
    return found[-1] if found else None


# How the predicted answer is taken from a completion (reward.extractor; custom reward functions
# may use them through `extract_answer`).
EXTRACTORS = {
    "boxed": last_boxed,            # the last \boxed{...} (MATH, AIME, DeepScaleR)
    "gsm8k": _after_mark,           # the line after the last "#### " (GSM8K's format)
    "answer": _answer_line,         # the rest of the last "Answer: ..." line
    "last_number": _last_number,    # the last number anywhere in the text
}


def extract_answer(text: str, how: str = "boxed") -> str | None:
    """The predicted answer of `text` by extractor `how` (one of EXTRACTORS), trimmed of spaces
    and a final full stop; None when there is none."""
    if how not in EXTRACTORS:
        raise ValueError(f"unknown answer extractor {how!r} (one of {', '.join(EXTRACTORS)})")
    found = EXTRACTORS[how](text)
    if found is None:
        return None
    found = found.strip()
    return found[:-1].rstrip() if found.endswith(".") and how != "boxed" else found


def _plain_number(s: str) -> Decimal | None:
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _math_verify_equal(pred: str, answer: str) -> bool:
    timeout = SYMPY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"{_BOXED}{answer}}}", parsing_timeout=timeout)
    target = parse(f"{_BOXED}{pred}}}", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return verify(gold, target, timeout_seconds=timeout)


def math_reward(completion_text: str, answer: str, extractor: str = "boxed") -> float:
    """1.0 if the answer of ``completion_text`` (by default its last ``\\boxed{}``; see
    EXTRACTORS) equals ``answer``, else 0.0.

    ``answer`` is the bare reference (``"42"``, ``"\\frac{1}{2}"``), as data/jsonl.py loads it.
    Never raises: no answer, an empty one, unparsable text or a non-string input all give 0.0.
    """
    try:
        if not isinstance(completion_text, str) or not isinstance(answer, str):
            return 0.0
        pred = extract_answer(completion_text[-MAX_SCAN_CHARS:], extractor)
        if pred is None:
            return 0.0
        pred, answer = pred.strip(), answer.strip()
        if not pred or not answer or len(pred) > MAX_ANSWER_CHARS or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        if pred == answer:
            return 1.0
        pred_num, answer_num = _plain_number(pred), _plain_number(answer)
        if pred_num is not None and answer_num is not None:
            if pred_num == answer_num:
                return 1.0
            if all(x == x.to_integral_value() for x in (pred_num, answer_num)):
                return 0.0  # two different integers; decimals go on to math_verify's rounding
        return 1.0 if _math_verify_equal(pred, answer) else 0.0
    except (Exception, TimeoutException):
        return 0.0
