"""The built-in Python interpreter environment (``env.fn=python``): the model writes a fenced
code block (```python ... ```), it runs in the bubblewrap sandbox of the code reward
(reward/sandbox.py: its own namespaces, an unprivileged uid, no network, a read-only file
system, limits on processes, memory, CPU and output), and the observation is what it printed;
a turn without a closed code block is the final answer, scored by the built-in math reward
against the row's answer.

The observation is the program's stdout, cut to ``max_output_chars`` (a line says how much was
cut), then, when it failed, its last stderr line or why it was stopped (a timeout, the memory
limit). The tool record carries that reason as its error.

State across the turns of an episode (``keep_state=True``, the default): each run replays the
episode's earlier blocks first, in one interpreter, with their output discarded and their
exceptions ignored, so names defined earlier are defined again. A replay repeats their work
(and their side effects inside the fresh sandbox): the time bound covers the whole run.
``keep_state=False``: each block runs alone.

Keyword arguments (``env.args``): ``timeout_s``, ``memory_mb``, ``max_output_chars``,
``keep_state``; ``question_key``, ``answer_key``, ``prompt_template``, ``extractor`` as the
calculator's (env/calculator.py).
"""
from __future__ import annotations

from ..reward.code import fenced_blocks
from ..reward.math import math_reward
from ..reward.sandbox import Sandbox
from .base import Environment, Step, ToolCall

PYTHON_TAGS = ("python", "python3", "py", "")
# earlier blocks run silently first (their errors ignored), then the turn's own block
_REPLAY = '''import contextlib as _c, io as _io, sys as _s
_g = {"__name__": "__main__"}
with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):
    for _b in %r:
        try:
            exec(compile(_b, "<earlier cell>", "exec"), _g)
        except BaseException:
            pass
exec(compile(%r, "<cell>", "exec"), _g)
'''


def code_block(text: str) -> str | None:
    """The last closed fenced block tagged python (or untagged) in a turn, or None."""
    blocks = [body for tag, body in fenced_blocks(text) if tag.lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


def program(blocks: list[str]) -> str:
    """The program that runs the last block after replaying the earlier ones."""
    return blocks[-1] if len(blocks) == 1 else _REPLAY % (blocks[:-1], blocks[-1])


class PythonTool(Environment):
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
                 keep_state: bool = True, question_key: str = "question",
                 answer_key: str = "answer", prompt_template: str = "{question}",
                 extractor: str = "boxed"):
        ok, why = Sandbox.available()
        if not ok:
            raise RuntimeError(f"the Python tool needs the code sandbox: {why}")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_output_chars, self.keep_state = max_output_chars, keep_state
        self.question_key, self.answer_key = question_key, answer_key
        self.prompt_template, self.extractor = prompt_template, extractor
        self.blocks: list[str] = []
        self.answer = ""

    def reset(self, row: dict) -> str:
        self.answer = str(row[self.answer_key])
        self.blocks = []
        return self.prompt_template.format(question=row[self.question_key])

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        code = code_block(turn_text)
        if code is None:            # no code: the final answer
            return Step(done=True, reward=math_reward(turn_text, self.answer, self.extractor))
        self.blocks = (self.blocks if self.keep_state else []) + [code]
        res = Sandbox().run(program(self.blocks), b"", timeout_s=self.timeout_s,
                            memory_mb=self.memory_mb)
        out = res.stdout.decode("utf-8", "replace")
        if len(out) > self.max_output_chars:
            out = (out[:self.max_output_chars]
                   + f"\n[{len(out) - self.max_output_chars} more characters cut]")
        error = (res.sandbox_error or (f"timeout after {self.timeout_s:g} s" if res.timed_out else None)
                 or (f"memory limit exceeded ({self.memory_mb} MiB)" if res.over_memory else None)
                 or (None if res.returncode == 0 else res.stderr_tail or f"exit code {res.returncode}"))
        if error is not None:
            out = f"{out}\n{error}" if out else error
        tool = ToolCall("python", code, len(res.stdout), res.seconds, error)
        return Step(observation=out, tool=tool)
