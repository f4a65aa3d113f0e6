"""The prompt rows a run trains and evaluates on, whatever the dataset kind.

Every row is ``{"question": str, "reward_kind": "math" | "code", "reference": ...}``: for math the
reference is the answer string (checked with math_verify), for code the list of stdin/stdout tests
(run in the sandbox); with reward functions of the user's own (reward.fn) the kind is "custom"
and the row keeps every field of its line under "row". The controller sends the kind and
reference with each prompt, so the generator's reward pool scores without knowing the dataset.
`prompt_ids` turns a question into prompt tokens (the format string, or the chat template).
"""
from __future__ import annotations

import functools
from itertools import islice

from .code_jsonl import load_code_jsonl
from .files import field, iter_rows, open_regular
from .answers import final_answer
from .jsonl import load_jsonl

KINDS = ("math", "code")


def load_prompts(path: str, kind: str = "math", question_key: str = "question",
                 answer_key: str = "answer", custom: bool = False, keep_row: bool = False,
                 limit: int | None = None) -> list[dict]:
    """Read a dataset (jsonl, parquet, arrow or an HF `datasets` directory: data/files.py; keys
    may be dotted, e.g. ``reward_model.ground_truth``); for code, `question_key`/`answer_key`
    name the prompt and tests fields (e.g. "prompt" and "tests", or APPS's "question" and
    "input_output").

    custom: the run scores with reward functions of its own (reward.fn): every row is
    ``{"question", "reward_kind": "custom", "reference", "row"}``, ``row`` the whole row as
    read; only the question field is required (the reference is the answer field when present,
    a GSM8K answer cut to its final answer, else None). keep_row (a run with an environment):
    a math row keeps its whole row as ``row`` too. limit: the first rows only."""
    if custom:
        rows = []
        for where, obj in islice(iter_rows(path, (question_key,)), limit):
            question = field(obj, question_key)
            if not isinstance(question, str):
                raise ValueError(f"{where}: {question_key!r} must be a string, got "
                                 f"{type(question).__name__}")
            ref = field(obj, answer_key, None)
            rows.append({"question": question, "reward_kind": "custom",
                         "reference": final_answer(ref) if isinstance(ref, str) else ref, "row": obj})
        return rows
    if kind == "math":
        return [{"question": r["question"], "reward_kind": "math", "reference": r["answer"],
                 **({"row": r["row"]} if keep_row else {})}
                for r in load_jsonl(path, question_key, answer_key, keep_row, limit)]
    if kind == "code":
        return [{"question": r["prompt"], "reward_kind": "code", "reference": r["tests"]}
                for r in load_code_jsonl(path, question_key, answer_key, limit)]
    raise ValueError(f"unknown dataset kind {kind!r} (one of {', '.join(KINDS)})")


def load_prompts_of(cfg, path: str, limit: int | None = None) -> list[dict]:
    """`load_prompts` with the run's data keys (and reward.fn's custom mode; with an
    environment, math rows keep their whole row for its reset)."""
    d, r = cfg.data, cfg.reward
    return load_prompts(path, d.kind, d.question_key, d.answer_key, custom=bool(r.fn or r.functions),
                        keep_row=bool(getattr(cfg, "env", None) and cfg.env.fn), limit=limit)


def reset_row(row: dict) -> dict:
    """The row an environment's reset gets for a prompt row of `load_prompts_of`: the dataset's
    own, whole, with "question" and "answer" as the run reads them (a reward.fn run's row as
    read: its functions see it so too)."""
    whole = row.get("row") or {}
    if row["reward_kind"] == "custom":
        return whole
    return {**whole, "question": row["question"], "answer": row["reference"]}


MAX_TEMPLATE_BYTES = 1 << 20     # a chat template file (the shipped ones are a few KiB)


@functools.lru_cache(maxsize=8)
def read_chat_template(value: str | None) -> str | None:
    """`data.chat_template`: a Jinja template itself (it holds a '{'), or the path of a regular
    file of at most MAX_TEMPLATE_BYTES holding one (read once per process: the controller renders
    every prompt with it). Anything else raises ValueError naming it."""
    if not value:
        return None
    if "{" in value:
        return value
    try:
        with open_regular(value, "chat template file", MAX_TEMPLATE_BYTES) as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{value!r} is neither a Jinja template (no '{{') nor a file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{value}: not UTF-8 text ({exc.reason})") from None


def prompt_ids(tokenizer, d, question: str, tools: list[dict] | None = None) -> list[int]:
    """The prompt tokens of `question` under data settings `d` (`DataConfig`, or anything with
    its prompt fields): `d.prompt_template` filled in; with `d.chat`, that text is the user
    message of the tokenizer's chat template (or `d.chat_template`), after `d.system_prompt`
    when set, with the generation prompt, then `d.assistant_prefix` (e.g. a reasoning model's
    "<think>\\n"). Tokens as the tokenizer renders them: no special tokens added beyond the
    template's own. `tools` (native tool calling: JSON schemas) go to the chat template, which
    declares them (Qwen's: in the system turn)."""
    text = d.prompt_template.format(question=question)     # config/rules.py TEMPLATE_FIELDS
    if not d.chat:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + [
        {"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, chat_template=read_chat_template(d.chat_template),
                                             add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    return tokenizer(rendered + (d.assistant_prefix or ""), add_special_tokens=False)["input_ids"]


MAX_CHARS_PER_TOKEN = 32    # a question this many characters per token of room: refused untokenized


class RenderTimeout(Exception):
    """A prompt's rendering (the chat template's loops) ran past its time bound (preflight.py)."""


def too_many_chars(rows: list[dict], max_model_len: int) -> str | None:
    """The first row whose question is longer than MAX_CHARS_PER_TOKEN characters per token of
    `max_model_len`, as "row i: ..." (None when none is): refused without rendering or
    tokenizing it, so that a question of megabytes costs nothing."""
    cap = MAX_CHARS_PER_TOKEN * max_model_len
    i = next((i for i, r in enumerate(rows) if len(r["question"]) > cap), None)
    if i is None:
        return None
    return (f"row {i}: the question is {len(rows[i]['question'])} characters, over "
            f"{MAX_CHARS_PER_TOKEN} per token of rollout.max_model_len = {max_model_len} (not tokenized)")


def too_long(tokenizer, d, rows: list[dict], max_model_len: int, ids=prompt_ids) -> str | None:
    """The first row whose prompt leaves no room to generate in `max_model_len` tokens, as
    "row i: ..." (None when every row fits): vLLM refuses such a request, which would end the
    generator mid-run. `too_many_chars` first (its rows are not tokenized); the others are
    tokenized as the controller will (`ids`: `prompt_ids`, or the preflight's time-bounded one,
    whose RenderTimeout comes back naming the row; any other failure is a ValueError naming it)."""
    problem = too_many_chars(rows, max_model_len)
    if problem:
        return problem
    for i, r in enumerate(rows):
        try:
            n = len(ids(tokenizer, d, r["question"]))
        except RenderTimeout as exc:
            raise RenderTimeout(f"row {i}: {exc}") from None
        except Exception as exc:    # noqa: BLE001 - whatever the template or tokenizer raises
            lines = str(exc).strip().splitlines()
            raise ValueError(f"row {i}: its prompt does not render: {type(exc).__name__}"
                             + (f": {lines[0]}" if lines else "")) from None
        if n >= max_model_len:
            return (f"row {i}: its prompt is {n} tokens, no room to generate in "
                    f"rollout.max_model_len = {max_model_len}")
    return None
