"""Code datasets (LiveCodeBench / APPS style) from jsonl, parquet, arrow or HF `datasets` files
(data/files.py).

Each row becomes ``{"prompt": str, "tests": [{"input": str, "output": str}, ...]}``, the form
reward/code.py's ``run_tests`` takes. The tests field may hold

- a list of ``{"input": str, "output": str}`` objects (LiveCodeBench's public/private tests), or
- ``{"inputs": [str, ...], "outputs": [str, ...]}``, APPS's ``input_output``,

either directly or as a JSON string (both datasets ship them as strings). APPS rows with
``"fn_name"`` are call-based (the test calls a function, not stdin/stdout); they are rejected, as
are rows without tests, rather than silently scoring every completion 0.
"""

from __future__ import annotations

import json
import os
from itertools import islice

from .files import field, iter_rows


def _tests_from_pairs(inputs, outputs, where: str, key: str) -> list[dict]:
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"{where}: {key!r}: 'inputs' and 'outputs' must be lists")
    if len(inputs) != len(outputs):
        raise ValueError(f"{where}: {key!r}: {len(inputs)} inputs but {len(outputs)} outputs")
    return [{"input": i, "output": o} for i, o in zip(inputs, outputs)]


def parse_tests(value, where: str, key: str) -> list[dict]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {key!r} is a string but not JSON: {e.msg}") from e
    if isinstance(value, dict):
        if "fn_name" in value:
            raise ValueError(f"{where}: {key!r}: call-based tests (fn_name) are not supported, "
                             "only stdin/stdout")
        if "inputs" not in value or "outputs" not in value:
            raise ValueError(f"{where}: {key!r}: expected keys 'inputs' and 'outputs' "
                             f"(keys: {sorted(value)})")
        tests = _tests_from_pairs(value["inputs"], value["outputs"], where, key)
    elif isinstance(value, list):
        tests = value
    else:
        raise ValueError(f"{where}: {key!r} must be a list of tests or an APPS input_output "
                         f"object, got {type(value).__name__}")
    if not tests:
        raise ValueError(f"{where}: {key!r}: no tests")
    for n, test in enumerate(tests):
        if not isinstance(test, dict):
            raise ValueError(f"{where}: {key!r}[{n}]: expected an object, "
                             f"got {type(test).__name__}")
        for name in ("input", "output"):
            if not isinstance(test.get(name), str):
                got = type(test[name]).__name__ if name in test else "nothing"
                raise ValueError(f"{where}: {key!r}[{n}][{name!r}] must be a string, got {got}")
    return [{"input": t["input"], "output": t["output"]} for t in tests]


def load_code_jsonl(path: str | os.PathLike, prompt_key: str = "prompt",
                    tests_key: str = "tests", limit: int | None = None) -> list[dict]:
    """Rows of ``path`` (the first `limit` only, when given) as ``[{"prompt": str, "tests":
    [{"input", "output"}, ...]}, ...]``.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    1-based line number for a row that is not a JSON object, lacks a key, has a non-string
    prompt, or has no or malformed tests (see the module docstring for the accepted forms).
    """
    rows = []
    for where, obj in islice(iter_rows(path, (prompt_key, tests_key)), limit):
        prompt = field(obj, prompt_key)
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
        rows.append({"prompt": prompt, "tests": parse_tests(field(obj, tests_key), where, tests_key)})
    return rows
