"""The prompt rows a run trains and evaluates on, whatever the dataset kind.

Every row is ``{"question": str, "reward_kind": "math" | "code", "reference": ...}``: for math the
reference is the answer string (checked with math_verify), for code the list of stdin/stdout tests
(run in the sandbox). The controller sends the kind and reference with each prompt, so the
generator's reward pool scores without knowing the dataset.
"""
from __future__ import annotations

from .code_jsonl import load_code_jsonl
from .jsonl import load_jsonl

KINDS = ("math", "code")
# The fields `data.prompt_template` may use, per kind: the controller fills the template with
# `template.format(question=row["question"])` (for code, the row's prompt is its "question").
TEMPLATE_FIELDS = {"math": ("question",), "code": ("question",)}


def load_prompts(path: str, kind: str = "math", question_key: str = "question",
                 answer_key: str = "answer") -> list[dict]:
    """Read a jsonl dataset; for code, `question_key`/`answer_key` name the prompt and tests
    fields (e.g. "prompt" and "tests", or APPS's "question" and "input_output")."""
    if kind == "math":
        return [{"question": r["question"], "reward_kind": "math", "reference": r["answer"]}
                for r in load_jsonl(path, question_key, answer_key)]
    if kind == "code":
        return [{"question": r["prompt"], "reward_kind": "code", "reference": r["tests"]}
                for r in load_code_jsonl(path, prompt_key=question_key, tests_key=answer_key)]
    raise ValueError(f"unknown dataset kind {kind!r} (one of {', '.join(KINDS)})")
