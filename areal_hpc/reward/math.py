"""Binary math reward: is the last ``\\boxed{...}`` of a completion equal to the reference answer?

Equality is math_verify's (``parse`` + ``verify``: ``\\frac{1}{2}`` == ``0.5``, ``049`` == ``49``),
behind a fast path for plain numbers, which covers the tiny task and GSM8K without sympy, and
with three rules of the README's policy that math_verify alone does not keep:

- a decimal is the exact number it writes: math_verify compares floats rounded to
  ``float_rounding`` places (6), which would take ``0.5000001`` for 1/2 or ``3.141593`` for
  pi; every decimal is made the rational it writes before ``verify`` (``_exact``);
- an equation answers only if each of its sides but a named variable on the left is the
  answer: ``x = 42`` and ``x = 40 + 2 = 42`` answer 42; ``43 = 42``, ``2x = 84`` and
  ``42 = x`` do not (math_verify takes an equation's right side when the reference is none);
- the answer is the outer box (data/answers.py ``last_boxed``); a box around the whole answer
  is unwrapped (``\\boxed{\\boxed{42}}``), one inside it is a second answer:
  ``\\boxed{43 \\boxed{42}}`` scores 0.

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
from math_verify.grader import is_assignment_relation, is_equation
from sympy import And, Basic, Float, Rational

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


def _exact(expr):
    """`expr` with every decimal (a sympy Float: binary, 15 digits) made the rational its digits
    write, so that verify compares exactly instead of rounded to `float_rounding` places."""
    if not isinstance(expr, Basic) or not (floats := expr.atoms(Float)):
        return expr
    return expr.xreplace({f: Rational(str(f)) for f in floats})


def _sides(equation) -> list:
    """The sides of an equation or chain (``a = b = c``) that must each be the answer: all of
    them but a named variable on the left (``x`` of ``x = 2``)."""
    rels = list(equation._unsorted_args) if isinstance(equation, And) else [equation]
    named = rels[0].lhs if is_assignment_relation(equation) else None
    sides = []
    for side in (s for r in rels for s in (r.lhs, r.rhs)):
        if side != named and side not in sides:
            sides.append(side)
    return sides


def _math_verify_equal(pred: str, answer: str) -> bool:
    timeout = SYMPY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = [_exact(g) for g in parse(f"{BOXED}{answer}}}", parsing_timeout=timeout)]
    target = [_exact(t) for t in parse(f"{BOXED}{pred}}}", parsing_timeout=timeout)]
    if not gold or not target:
        return False
    if is_equation(target[0]) and not is_equation(gold[0]):
        return all(verify(gold, [side], timeout_seconds=timeout) for side in _sides(target[0]))
    return verify(gold, target, timeout_seconds=timeout)


def _unboxed(pred: str) -> str | None:
    """`pred` without boxes around the whole of it; None if a box is left inside it (a second
    answer within the first: ``43 \\boxed{42}``)."""
    while pred.startswith(BOXED) and last_boxed(pred) == pred[len(BOXED):-1]:
        pred = pred[len(BOXED):-1].strip()
    return None if BOXED in pred else pred


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
        pred, answer = _unboxed(pred.strip()), answer.strip()
        if not pred or not answer or len(pred) > MAX_ANSWER_CHARS or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        if pred == answer:
            return 1.0
        pred_num, answer_num = _plain_number(pred), _plain_number(answer)
        if pred_num is not None and answer_num is not None:
            return 1.0 if pred_num == answer_num else 0.0   # exactly: 0.5000001 is not 0.5
        return 1.0 if _math_verify_equal(pred, answer) else 0.0
    except (Exception, TimeoutException):
        return 0.0
