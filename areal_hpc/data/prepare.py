"""Convert the common public dataset layouts into this project's rows (`tools/prepare_data.py`).

    python tools/prepare_data.py gsm8k/train.parquet data/gsm8k_train.jsonl            # layout found
    python tools/prepare_data.py MATH/test --layout math data/math_test.jsonl          # HF directory
    python tools/prepare_data.py apps.jsonl data/apps_stdin.jsonl --skip-bad           # drop call-based

The input is any format data/files.py reads (jsonl, parquet, arrow, a local HF `datasets`
directory); the output is jsonl, the rows the default data keys read:

- math layouts → ``{"question": str, "answer": str}`` (data.kind = math)
    - ``gsm8k``: ``question``, ``answer`` (worked solution, then ``#### N``) → N
    - ``math``: ``problem`` and ``answer`` (MATH-500, DeepScaleR, AIME sets; an integer answer
      becomes its decimal string), else the last ``\\boxed{}`` of ``solution`` (Hendrycks MATH)
- code layouts → ``{"prompt": str, "tests": [{"input", "output"}, ...]}`` (data.kind = code)
    - ``apps``: ``question``, ``input_output`` (``{"inputs", "outputs"}``, a JSON string or not)
    - ``livecodebench``: ``question_content``, ``public_test_cases`` (JSON list of
      ``{"input", "output", "testtype"}``); only ``stdin`` tests. Private tests, which
      LiveCodeBench ships pickled, are never unpickled: a dataset file is untrusted input.

Every other field of a row is kept beside them (custom reward functions see it as ``row``).
A row that cannot be converted (a missing or mistyped field, call-based code tests, no boxed
answer) stops the conversion with one line naming the row and field; with ``--skip-bad`` it is
left out and counted instead, and the first few are named.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .code_jsonl import parse_tests
from .files import iter_rows
from .answers import GSM8K_ANSWER_MARK, final_answer, last_boxed

LAYOUTS = ("gsm8k", "math", "apps", "livecodebench")
# The fields that identify each layout, in the order `detect` tries them.
_SIGNATURES = (("livecodebench", ("question_content", "public_test_cases")),
               ("apps", ("question", "input_output")),
               ("gsm8k", ("question", "answer")),
               ("math", ("problem",)))


class BadRow(ValueError):
    """One row that the layout cannot convert; the message names the row and field."""


def detect(row: dict) -> str:
    """The layout of a dataset from its first row's fields."""
    lowered = {k.lower() for k in row}
    for layout, keys in _SIGNATURES:
        if all(k in lowered for k in keys):
            return layout
    raise ValueError(f"no known layout has the fields {sorted(row)} (layouts: "
                     + "; ".join(f"{n}: {', '.join(k)}" for n, k in _SIGNATURES) + "); give --layout")


def _key(row: dict, *names: str) -> str | None:
    """The key of the first of `names` that `row` holds (any case) with a value, or None."""
    by_lower = {k.lower(): k for k in row}
    for name in names:
        key = name if name in row else by_lower.get(name.lower())
        if key is not None and row[key] is not None:
            return key
    return None


def _get(row: dict, where: str, *names: str, kind=str):
    """The first of `names` present in `row` (any case), which must be a `kind`."""
    key = _key(row, *names)
    if key is None:
        raise BadRow(f"{where}: missing field {' or '.join(repr(n) for n in names)} "
                     f"(fields: {sorted(row)})")
    value = row[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(t.__name__ for t in kind)
        raise BadRow(f"{where}: {key!r} must be {want}, got {type(value).__name__}")
    return key, value


def _rest(row: dict, *used: str) -> dict:
    return {k: v for k, v in row.items() if k not in used}


def _gsm8k(row: dict, where: str) -> dict:
    qk, question = _get(row, where, "question")
    ak, answer = _get(row, where, "answer")
    if GSM8K_ANSWER_MARK not in answer:
        raise BadRow(f"{where}: {ak!r} has no {GSM8K_ANSWER_MARK!r} final answer")
    final = final_answer(answer)
    if not final:
        raise BadRow(f"{where}: {ak!r}: nothing after {GSM8K_ANSWER_MARK!r}")
    return {**_rest(row, qk, ak), "question": question, "answer": final, "solution": answer}


def _math(row: dict, where: str) -> dict:

    qk, question = _get(row, where, "problem", "question")
    if _key(row, "answer") is not None:
        ak, answer = _get(row, where, "answer", kind=(str, int))
        answer = str(answer).strip()
    else:
        sk, solution = _get(row, where, "solution")
        boxed = last_boxed(solution)
        if boxed is None or not boxed.strip():
            raise BadRow(f"{where}: {sk!r} has no \\boxed{{}} answer")
        ak, answer = None, boxed.strip()
    if not answer:
        raise BadRow(f"{where}: {ak!r} is empty")
    return {**_rest(row, qk, *([ak] if ak else [])), "question": question, "answer": answer}


def _apps(row: dict, where: str) -> dict:
    qk, question = _get(row, where, "question")
    tk, tests = _get(row, where, "input_output", kind=(str, dict))
    try:
        parsed = parse_tests(tests, where, tk)
    except ValueError as exc:
        raise BadRow(str(exc)) from None
    return {**_rest(row, qk, tk), "prompt": question, "tests": parsed}


def _livecodebench(row: dict, where: str) -> dict:
    qk, question = _get(row, where, "question_content")
    tk, tests = _get(row, where, "public_test_cases", kind=(str, list))
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as exc:
            raise BadRow(f"{where}: {tk!r} is a string but not JSON: {exc.msg}") from None
    if not isinstance(tests, list):
        raise BadRow(f"{where}: {tk!r} must be a list of tests, got {type(tests).__name__}")
    kinds = {t.get("testtype", "stdin") for t in tests if isinstance(t, dict)}
    if kinds - {"stdin"}:
        raise BadRow(f"{where}: {tk!r}: {sorted(kinds - {'stdin'})} tests are not supported, "
                     "only stdin/stdout")
    try:
        parsed = parse_tests(tests, where, tk)
    except ValueError as exc:
        raise BadRow(str(exc)) from None
    kept = _rest(row, qk, tk, "private_test_cases")
    return {**kept, "prompt": question, "tests": parsed}


CONVERT = {"gsm8k": _gsm8k, "math": _math, "apps": _apps, "livecodebench": _livecodebench}
KIND = {"gsm8k": "math", "math": "math", "apps": "code", "livecodebench": "code"}


def convert(src: str, dst: str, layout: str = "auto", skip_bad: bool = False,
            limit: int = 0, show: int = 5) -> dict:
    """Convert `src` into jsonl rows at `dst` (written whole, then renamed into place: a failed
    conversion leaves no partial file). Returns ``{"layout", "kind", "rows", "skipped",
    "bad": [first messages]}``; raises BadRow (one line) on a bad row without `skip_bad`."""
    if layout != "auto" and layout not in CONVERT:
        raise ValueError(f"unknown layout {layout!r} (one of auto, {', '.join(LAYOUTS)})")
    rows, bad = [], []
    for where, row in iter_rows(src):
        if layout == "auto":
            layout = detect(row)
        try:
            rows.append(CONVERT[layout](row, where))
        except BadRow as exc:
            if not skip_bad:
                raise
            bad.append(str(exc))
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{src}: no row converted" + (f" ({len(bad)} bad; first: {bad[0]})" if bad else ""))
    tmp = f"{dst}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, dst)
    return {"layout": layout, "kind": KIND[layout], "rows": len(rows), "skipped": len(bad),
            "bad": bad[:show]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("src", help="jsonl, parquet, arrow, or an HF datasets directory (one split)")
    ap.add_argument("dst", help="the jsonl file to write")
    ap.add_argument("--layout", default="auto", choices=("auto",) + LAYOUTS)
    ap.add_argument("--skip-bad", action="store_true", help="leave out rows that cannot be converted")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many rows (0 = all)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.layout, args.skip_bad, args.limit)
    except (ValueError, OSError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    for line in out["bad"]:
        print(f"skipped: {line}", file=sys.stderr)
    more = out["skipped"] - len(out["bad"])
    if more > 0:
        print(f"skipped: ... and {more} more", file=sys.stderr)
    print(f"wrote {out['rows']} rows to {args.dst} (layout {out['layout']}, data.kind={out['kind']}"
          f"{', skipped %d' % out['skipped'] if out['skipped'] else ''})")
    return 0
