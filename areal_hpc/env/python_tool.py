"""The built-in Python interpreter environment (``env.fn=python``): the model writes a fenced
code block (```python ... ```), it runs in the episode's live interpreter inside the bubblewrap
sandbox of the code reward (env/interpreter.py, reward/sandbox_live.py: its own namespaces, an
unprivileged uid, no network, a read-only file system, limits on processes, memory, CPU and
output), and the observation is what it printed; a turn without a closed code block is the
final answer, scored by the built-in math reward against the row's answer.

The observation is the cell's stdout, cut to ``max_output_chars`` (a line says how much was
cut), then, when it failed, the last line of its traceback or why it was stopped (a timeout,
the memory limit, the interpreter's lifetime). The tool record carries that reason as its error.

State across the turns of an episode (``keep_state=True``, the default): one interpreter per
episode, started at its first cell, keeps every name from cell to cell (nothing is run twice:
a random draw stays drawn, a side effect happens once, each cell costs its own time only). A
cell that runs past ``timeout_s`` (or breaks the memory limit, or kills its interpreter) is
stopped with its interpreter: the observation says that the state is lost, and the next cell
starts a fresh one. So does an interpreter past ``lifetime_s`` (the next cell says so). The
interpreter is killed at the episode's end (``close``) and at a ``reset``. A preempted
episode comes back by replaying its turns (env/runner.py ``replay``): each earlier cell runs
once more, in order, in the new interpreter. ``keep_state=False``: each cell in a fresh
interpreter of its own. With native tool calling (``env.tool_parser``) the ``python`` tool's
``code`` is a cell of the same interpreter (``call``), and a turn without a call is the answer.

Keyword arguments (``env.args``): ``timeout_s`` (per cell), ``memory_mb``, ``lifetime_s``,
``max_output_chars``, ``keep_state``; ``question_key``, ``answer_key``, ``prompt_template``,
``extractor`` as the calculator's (env/calculator.py).
"""
from __future__ import annotations

from ..reward.code import fenced_blocks
from ..reward.math import math_reward
from ..reward.sandbox import Sandbox
from .base import Environment, Step, ToolCall
from .interpreter import Interpreter

PYTHON_TAGS = ("python", "python3", "py", "")


def code_block(text: str) -> str | None:
    """The last closed fenced block tagged python (or untagged) in a turn, or None."""
    blocks = [body for tag, body in fenced_blocks(text) if tag.lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


class PythonTool(Environment):
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
                 keep_state: bool = True, lifetime_s: float = 300.0,
                 question_key: str = "question", answer_key: str = "answer",
                 prompt_template: str = "{question}", extractor: str = "boxed"):
        ok, why = Sandbox.available()
        if not ok:
            raise RuntimeError(f"the Python tool needs the code sandbox: {why}")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_output_chars, self.keep_state = max_output_chars, keep_state
        self.question_key, self.answer_key = question_key, answer_key
        self.prompt_template, self.extractor = prompt_template, extractor
        self.interpreter = Interpreter(timeout_s=timeout_s, memory_mb=memory_mb,
                                       lifetime_s=lifetime_s, max_output_chars=max_output_chars,
                                       fresh=not keep_state)
        self.answer = ""

    def reset(self, row: dict) -> str:
        self.interpreter.close()
        self.answer = str(row[self.answer_key])
        return self.prompt_template.format(question=row[self.question_key])

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        code = code_block(turn_text)
        if code is None:            # no code: the final answer
            return Step(done=True, reward=math_reward(turn_text, self.answer, self.extractor))
        return self.run_cell(code)

    def run_cell(self, code: str) -> Step:
        """One cell in the episode's interpreter: its observation and tool record."""
        cell = self.interpreter.run(code)
        out = cell.output
        if cell.chars > self.max_output_chars:
            out += f"\n[{cell.chars - self.max_output_chars} more characters cut]"
        if cell.error is not None:
            out = f"{out}\n{cell.error}" if out else cell.error
        if cell.notice is not None:
            out = f"{cell.notice}\n{out}"
        tool = ToolCall("python", code, cell.output_bytes, cell.seconds, cell.error)
        return Step(observation=out, tool=tool)

    def call(self, name: str, arguments: dict) -> Step:
        """Native tool calling (env.tool_parser): the ``python`` tool's call (its schema in
        env/base.py BUILTIN_TOOLS: ``{"code": ...}``) is a cell, as a fenced block is."""
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            raise ValueError('expected {"code": <text>}')
        return self.run_cell(code)

    def close(self) -> None:
        self.interpreter.close()
