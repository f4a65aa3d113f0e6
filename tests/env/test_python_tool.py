"""The built-in Python interpreter environment (areal_hpc/env/python_tool.py): the model's code
block runs in the code sandbox, its output comes back, state is kept across turns or not."""
import pytest

from areal_hpc.env.base import from_mapping
from areal_hpc.env.python_tool import PythonTool, code_block, program
from areal_hpc.env.runner import EnvProcess

pytestmark = pytest.mark.slow       # runs bubblewrap sandboxes


def _turn(code: str) -> str:
    return f"Let me compute.\n```python\n{code}\n```\n"


def test_blocks_are_found_and_replayed():
    assert code_block("no code here") is None
    assert code_block("```python\nprint(1)\n```\n```js\nx\n```\n```\nprint(2)\n```") == "print(2)\n"
    assert code_block("```python\nprint(1)") is None                 # unclosed: no block
    assert program(["x = 1\n"]) == "x = 1\n"
    ns = {}
    exec(program(["x = 2\nprint('hidden')\n", "1/0\n", "y = x * 21\n"]), ns)
    assert ns["_g"]["y"] == 42


def test_an_episode_with_state_across_turns():
    env = PythonTool(timeout_s=10, max_output_chars=100)
    assert env.reset({"question": "What is 6*7?", "answer": "42"}) == "What is 6*7?"
    first = env.step(_turn("x = 6\nprint('x set')"), [1])
    assert first.observation == "x set\n" and first.tool.error is None and not first.done
    second = env.step(_turn("print(x * 7)"), [2])
    assert second.observation == "42\n" and second.tool.output_bytes == 3
    assert "x set" not in second.observation                         # replayed silently
    flood = env.step(_turn("print('y' * 10**6)"), [3])
    assert flood.observation.startswith("y" * 100 + "\n[") and "more characters cut]" in flood.observation
    assert flood.tool.output_bytes == 10**6 + 1
    assert env.step("So the answer is \\boxed{42}.", [4]).reward == 1.0


def test_errors_and_hostile_code_come_back_as_observations():
    env = PythonTool(timeout_s=2, keep_state=False)
    env.reset({"question": "q", "answer": "1"})
    env.step(_turn("x = 1"), [1])
    step = env.step(_turn("print(x)"), [2])                          # no state kept
    assert step.tool.error == "NameError: name 'x' is not defined" and step.observation.endswith(step.tool.error)
    hang = env.step(_turn("import os\nif os.fork() == 0:\n    os.setsid()\nwhile True:\n    pass"), [3])
    assert hang.tool.error == "timeout after 2 s" and not hang.done
    leak = env.step(_turn("open('/etc/hostname').read()"), [4])     # the host's files are not there
    assert leak.tool.error.startswith("FileNotFoundError")


def test_the_interpreter_runs_over_the_runner():
    proc = EnvProcess(from_mapping({"fn": "python", "args": {"timeout_s": 10}, "call_timeout_s": 60}))
    try:
        assert proc.reset({"question": "q", "answer": "3"}).observation == "q"
        step = proc.step(_turn("print(sum(range(3)))"), [1])
        assert step.error is None and step.observation == "3\n" and step.tool.name == "python"
        assert proc.step("\\boxed{3}", [2]).reward == 1.0
    finally:
        proc.close()
