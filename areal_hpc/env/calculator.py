"""The built-in calculator environment (``env.fn=calculator``): the model writes an arithmetic
expression in a tool-call tag, ``<calc>12*(3+4)</calc>``, and the observation is its value; a
turn without a tag is the final answer, scored by the built-in math reward against the row's
answer.

The expression is read with ``ast`` (never ``eval``): numbers, ``+ - * / // % **``, unary signs
and parentheses, nothing else (no names, calls, attributes). Bounded: the expression's length,
its nodes, each intermediate value's size, and ``**`` exponents, so ``9**9**9`` is an error, not a
stalled process. An expression that does not parse or breaks a bound answers ``error: <why>`` as
the observation, and the tool record carries the error. With native tool calling
(``env.tool_parser``), the same evaluation is the ``calculator`` tool (``call``, its schema in
env/base.py BUILTIN_TOOLS: ``{"expression": ...}``), and a turn without a call is the answer.

Keyword arguments (``env.args``): ``open_tag``, ``close_tag``; ``question_key`` and
``answer_key`` of the row; ``prompt_template`` (the row's question as ``{question}``);
``extractor`` (reward/math.py's: boxed, gsm8k, answer, last_number).
"""
from __future__ import annotations

import ast
import math
import operator
import time

from ..reward.math import math_reward
from .base import Environment, Step, ToolCall

MAX_EXPRESSION_CHARS = 256
MAX_NODES = 64
MAX_ABS_RESULT = 1e30
MAX_EXPONENT = 64
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression. Raises ValueError saying why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression over {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ValueError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"expression over {MAX_NODES} nodes")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        out = _UNARY[type(node.op)](_value(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"an exponent beyond ±{MAX_EXPONENT}")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("a value too large") from None
        if isinstance(out, complex):
            raise ValueError("a complex value")
    else:
        raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")
    if not math.isfinite(out) or abs(out) > MAX_ABS_RESULT:
        raise ValueError(f"a value beyond ±{MAX_ABS_RESULT:g}")
    return out


def show(value: int | float) -> str:
    """A value as the observation writes it: integers exactly, floats without a trailing .0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def last_call(text: str, open_tag: str, close_tag: str) -> str | None:
    """The arguments of the last closed tool-call tag in `text`, or None."""
    end = text.rfind(close_tag)
    if end == -1:
        return None
    start = text.rfind(open_tag, 0, end)
    return None if start == -1 else text[start + len(open_tag):end]


class Calculator(Environment):
    def __init__(self, open_tag: str = "<calc>", close_tag: str = "</calc>",
                 question_key: str = "question", answer_key: str = "answer",
                 prompt_template: str = "{question}", extractor: str = "boxed"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.question_key, self.answer_key = question_key, answer_key
        self.prompt_template, self.extractor = prompt_template, extractor
        self.answer = ""

    def reset(self, row: dict) -> str:
        self.answer = str(row[self.answer_key])
        return self.prompt_template.format(question=row[self.question_key])

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        expression = last_call(turn_text, self.open_tag, self.close_tag)
        if expression is None:      # no tool call: the final answer
            return Step(done=True, reward=math_reward(turn_text, self.answer, self.extractor))
        start = time.perf_counter()
        try:
            out, error = show(evaluate(expression)), None
        except ValueError as e:
            out, error = f"error: {e}", str(e)
        tool = ToolCall("calculator", expression, len(out.encode()), time.perf_counter() - start, error)
        return Step(observation=out, tool=tool)

    def call(self, name: str, arguments: dict) -> str:
        """Native tool calling (env.tool_parser): the `calculator` tool's result for
        {"expression": ...}; a bad expression raises, answered to the model as the error."""
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError('expected {"expression": <text>}')
        return show(evaluate(expression))
