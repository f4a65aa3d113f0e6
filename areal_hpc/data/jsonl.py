"""Prompt datasets: jsonl files (one JSON object per line, blank lines skipped), and through
data/files.py parquet, arrow and HF `datasets` directories alike.

Each row becomes ``{"question": str, "answer": str}``. GSM8K answers carry the worked solution
before ``#### <final answer>``; only the final answer is kept. Other answers (MATH-style LaTeX such
as ``\\frac{1}{2}``) are kept as they are, for math_verify to parse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from .files import field, iter_rows

GSM8K_ANSWER_MARK = "####"


def final_answer(answer: str) -> str:
    """A GSM8K answer (worked solution, then ``#### N``) cut to N; any other answer as it is."""
    if GSM8K_ANSWER_MARK in answer:
        return answer.rsplit(GSM8K_ANSWER_MARK, 1)[1].strip()
    return answer


def iter_objects(path: str | os.PathLike, required_keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(where, obj)`` for every non-blank line of ``path``; ``where`` is ``"path:lineno"``.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    1-based line number for a line that is not UTF-8 text, not a JSON object or lacks one of
    ``required_keys``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                yield from _parse_line(path, lineno, line, required_keys)
    except UnicodeDecodeError as e:
        # Text mode decodes ahead of the line it hands out: find the line in the bytes.
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    raise ValueError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[bad.start]:02x}: "
                                     f"{bad.reason})") from None
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None


def _parse_line(path: str, lineno: int, line: str, required_keys: tuple[str, ...]):
    if not line.strip():
        return
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: bad JSON: {e.msg}") from e
    except RecursionError:
        raise ValueError(f"{where}: bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in required_keys:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(obj)})")
    yield where, obj


def load_jsonl(path: str | os.PathLike, question_key: str = "question",
               answer_key: str = "answer") -> list[dict]:
    """Rows of ``path`` (any format of data/files.py; keys may be dotted) as
    ``[{"question": str, "answer": str}, ...]``, in file order.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    row (jsonl: its 1-based line) for a row that is not a JSON object, lacks a key, or holds a
    non-string.
    """
    rows = []
    for where, obj in iter_rows(path, (question_key, answer_key)):
        values = {key: field(obj, key) for key in (question_key, answer_key)}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        rows.append({"question": values[question_key], "answer": final_answer(values[answer_key])})
    return rows
