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

import threading
from decimal import Decimal, InvalidOperation

from math_verify import parse, verify
from math_verify.errors import TimeoutException

# EXTRACTORS and extract_answer stay importable from here for user reward functions (custom.py).
from ..data.answers import BOXED, EXTRACTORS, PLAIN_NUMBER, extract_answer, last_boxed  # noqa: F401

SYMPY_TIMEOUT_S = 3  # whole seconds: signal.alarm's resolution
MAX_ANSWER_CHARS = 1000  # a longer boxed answer is not a real answer; don't hand it to sympy
MAX_SCAN_CHARS = 1 << 20    # the end of a completion searched for its answer (1 MiB of text)

def _plain_number(s: str) -> Decimal | None:
    if not PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _math_verify_equal(pred: str, answer: str) -> bool:
    timeout = SYMPY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"{BOXED}{answer}}}", parsing_timeout=timeout)
    target = parse(f"{BOXED}{pred}}}", parsing_timeout=timeout)
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
