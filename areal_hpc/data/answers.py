"""Answers in text, one place for the datasets and the rewards: the final answer of a GSM8K
solution, the last ``\\boxed{}`` of a MATH solution or a completion, and the extractors
`reward.extractor` chooses among (reward/math.py compares what they find; data/jsonl.py and
data/prepare.py cut references with them)."""
from __future__ import annotations

import re

GSM8K_ANSWER_MARK = "####"


def final_answer(answer: str) -> str:
    """A GSM8K answer (worked solution, then ``#### N``) cut to N; any other answer as it is."""
    if GSM8K_ANSWER_MARK in answer:
        return answer.rsplit(GSM8K_ANSWER_MARK, 1)[1].strip()
    return answer


BOXED = "\\boxed{"
_BRACES = re.compile(r"\\boxed\{|[{}]")
# 42, -7, 1,000, 3.25, .5 (GSM8K writes thousands separators); not 1e3, not 1,00.
PLAIN_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?|[+-]?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None if there is none; an
    unclosed one (e.g. a truncated completion) is skipped for an earlier, complete one. Of
    nested boxes the outer one counts (the last box to close): ``\\boxed{43 \\boxed{42}}``
    answers ``43 \\boxed{42}``, not 42.

    One pass over the braces with a stack (a box closes where the brace depth counted from its
    own ``{`` returns to 0), so text full of unclosed boxes costs no more than its length."""
    stack: list[int] = []       # the open braces: a box's content start, or -1 for a plain {
    best = None
    for m in _BRACES.finditer(text):
        if m.group() == "}":
            if stack and (start := stack.pop()) >= 0:
                best = (start, m.start())
        else:
            stack.append(m.end() if m.group() == BOXED else -1)
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
    found = [m.group(0) for m in PLAIN_NUMBER.finditer(text)]
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
