"""The tiny task: sums of k small integers, answered with written partial sums.

A problem with terms (3, 5, 9) reads

    question  "3+5+9="
    solution  "3+5=8,8+9=17,\\boxed{17}"
    answer    "17"

One step ``a+b=c,`` per term after the first, then the final answer in ``\\boxed{}``, so the
reward is checked by the same math_verify path as real math datasets. The ``answer`` format
ends ``Answer: 17`` instead (the example of a user reward function, examples/answer_n/). The
text is kept short because the tiny model reads it one character at a time.

The ``tool`` format teaches a calculator call to a share of the problems (``tool_share``): their
solution is ``[3+5+9]17,\\boxed{17}``, the call, then its result as the calculator environment
(``env.fn=calculator`` with tags ``[`` and ``]``, observation template ``{observation},``)
appends it, then the answer; the others are written out as in ``boxed``. The tags are one
character each: the tiny model samples every character at temperature 1 with some noise, and a
longer tag (``<calc>``) came out garbled in most calls. A model pre-trained on it half-knows the
tool (examples/calculator/).

The number of terms k is long-tailed: P(k) ∝ (k - 1) ** -tail_exponent on [min_terms, max_terms].
With the defaults (2..10, exponent 1) 35% of the problems have k = 2 (20 characters, question
and solution) and 4% have k = 10 (about 99 characters); those are the stragglers that
asynchronous rollout hides. (With exponent 2, k = 2 is 65% and already solved after pre-training,
which leaves RL little to do.)

Pure Python and deterministic for a given seed (``random.Random``), no torch.
"""

from __future__ import annotations

import random

# Every character a question or solution can contain. The tiny model's tokenizer is built from it.
ALPHABET = "0123456789+=,\\boxed{}"
# The final answer's form (answer_format): "boxed" writes \boxed{17}, "answer" writes "Answer: 17",
# "tool" is "boxed" with a calculator call in a share of the solutions.
FORMATS = ("boxed", "answer", "tool")
_EXTRA_CHARS = {"boxed": "", "answer": "Answr: ", "tool": "[]"}
OPEN_TAG, CLOSE_TAG = "[", "]"                      # the tool format's calculator call


def alphabet(answer_format: str = "boxed") -> str:
    """The characters of a format's questions and solutions (ALPHABET, plus "Answer: ")."""
    if answer_format not in FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r} (one of {', '.join(FORMATS)})")
    return ALPHABET + "".join(c for c in _EXTRA_CHARS[answer_format] if c not in ALPHABET)


def term_count_weights(min_terms: int = 2, max_terms: int = 10,
                       tail_exponent: float = 1.0) -> dict[int, float]:
    """P(k) for k in [min_terms, max_terms], proportional to (k - 1) ** -tail_exponent."""
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    raw = {k: (k - 1) ** -tail_exponent for k in range(min_terms, max_terms + 1)}
    total = sum(raw.values())
    return {k: w / total for k, w in raw.items()}


def format_question(terms: list[int]) -> str:
    """``[12, 7, 30]`` → ``"12+7+30="``."""
    return "+".join(str(t) for t in terms) + "="


def format_solution(terms: list[int], answer_format: str = "boxed", tool: bool = False) -> str:
    """``[12, 7, 30]`` → ``"12+7=19,19+30=49,\\boxed{49}"`` (``answer``: ``"...,Answer: 49"``;
    ``tool``: ``"[12+7+30]49,\\boxed{49}"``)."""
    if tool:
        return f"{OPEN_TAG}{'+'.join(map(str, terms))}{CLOSE_TAG}{sum(terms)},\\boxed{{{sum(terms)}}}"
    steps = []
    partial = terms[0]
    for term in terms[1:]:
        steps.append(f"{partial}+{term}={partial + term},")
        partial += term
    final = f"Answer: {partial}" if answer_format == "answer" else f"\\boxed{{{partial}}}"
    return "".join(steps) + final


def make_problems(n: int, seed: int, *, min_terms: int = 2, max_terms: int = 10,
                  max_value: int = 9, tail_exponent: float = 1.0,
                  answer_format: str = "boxed", tool_share: float = 0.4) -> list[dict]:
    """``n`` problems ``{"question", "answer", "solution"}``, the same ones for the same arguments.

    Terms are uniform on [0, max_value]. Single digits by default: a small model learns the
    bookkeeping (which term is next, when to stop) and the adding within a few hundred steps on a
    CPU; with two-digit terms it stays near 0% for thousands of steps. ``tool_share``: the share
    of a ``tool`` format's solutions that call the calculator.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_value < 0:
        raise ValueError(f"max_value must be >= 0, got {max_value}")
    alphabet(answer_format)             # the format is known
    weights = term_count_weights(min_terms, max_terms, tail_exponent)
    ks, ps = list(weights), list(weights.values())
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        k = rng.choices(ks, weights=ps)[0]
        terms = [rng.randint(0, max_value) for _ in range(k)]
        tool = answer_format == "tool" and rng.random() < tool_share
        problems.append({
            "question": format_question(terms),
            "answer": str(sum(terms)),
            "solution": format_solution(terms, answer_format, tool),
        })
    return problems
