"""Prompt datasets: jsonl files (one JSON object per line, blank lines skipped), and through
data/files.py parquet, arrow and HF `datasets` directories alike.

Each row becomes ``{"question": str, "answer": str}``. GSM8K answers carry the worked solution
before ``#### <final answer>``; only the final answer is kept. Other answers (MATH-style LaTeX such
as ``\\frac{1}{2}``) are kept as they are, for math_verify to parse.
"""

from __future__ import annotations

import os
from itertools import islice

from .answers import final_answer
from .files import field, iter_rows

def load_jsonl(path: str | os.PathLike, question_key: str = "question",
               answer_key: str = "answer", keep_row: bool = False,
               limit: int | None = None) -> list[dict]:
    """Rows of ``path`` (any format of data/files.py; keys may be dotted) as
    ``[{"question": str, "answer": str}, ...]``, in file order; ``keep_row``: each also with
    ``"row"``, the whole row as read (what an environment's reset gets); ``limit``: the first
    rows only.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    row (jsonl: its 1-based line) for a row that is not a JSON object, lacks a key, or holds a
    non-string.
    """
    rows = []
    for where, obj in islice(iter_rows(path, (question_key, answer_key)), limit):
        values = {key: field(obj, key) for key in (question_key, answer_key)}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        rows.append({"question": values[question_key], "answer": final_answer(values[answer_key]),
                     **({"row": obj} if keep_row else {})})
    return rows
