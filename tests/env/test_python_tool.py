"""The built-in Python interpreter environment (areal_hpc/env/python_tool.py): the model's code
block runs in the episode's live interpreter in the code sandbox (env/interpreter.py), its
output comes back, state is kept across turns (never replayed) or not, and every way a cell can
go wrong (a hang, a flood, a forged frame, closed fds, a dead interpreter, its lifetime) ends in
an observation within the cell's bound, with the next cell served."""
import json
import struct

import psutil
import pytest

from areal_hpc.env.base import from_mapping
from areal_hpc.env.interpreter import STATE_LOST, Interpreter
from areal_hpc.env.python_tool import PythonTool, code_block
from areal_hpc.env.runner import EnvProcess, replay

pytestmark = pytest.mark.slow       # runs bubblewrap sandboxes
ROW = {"question": "q", "answer": "1"}


def _turn(code: str) -> str:
    return f"Let me compute.\n```python\n{code}\n```\n"


def _tool(**kw) -> PythonTool:
    env = PythonTool(**kw)
    env.reset(ROW)
    return env


def _sandbox_procs(env: PythonTool) -> list[psutil.Process]:
    """bwrap and every process of the episode's sandbox."""
    top = psutil.Process(env.interpreter.live.pid)
    return [top, *top.children(recursive=True)]


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running()]


def test_blocks_are_found():
    assert code_block("no code here") is None
    assert code_block("```python\nprint(1)\n```\n```js\nx\n```\n```\nprint(2)\n```") == "print(2)\n"
    assert code_block("```python\nprint(1)") is None                 # unclosed: no block


def test_an_episode_with_state_across_turns():
    env = PythonTool(timeout_s=10, max_output_chars=100)
    assert env.reset({"question": "What is 6*7?", "answer": "42"}) == "What is 6*7?"
    first = env.step(_turn("x = 6\nprint('x set')"), [1])
    assert first.observation == "x set\n" and first.tool.error is None and not first.done
    second = env.step(_turn("print(x * 7)"), [2])
    assert second.observation == "42\n" and second.tool.output_bytes == 3
    assert "x set" not in second.observation                         # not run again
    flood = env.step(_turn("print('y' * 10**6)"), [3])
    assert flood.observation.startswith("y" * 100 + "\n[") and "more characters cut]" in flood.observation
    assert flood.tool.output_bytes == 10**6 + 1
    assert env.step("So the answer is \\boxed{42}.", [4]).reward == 1.0
    env.close()


def test_state_is_kept_not_replayed():
    """Each cell runs once: a side effect happens once per cell and a random draw stays drawn
    (a replay would append again and draw again)."""
    env = _tool(timeout_s=10)
    env.step(_turn("import random\nseen = []\nr = random.random()\nprint(r)"), [1])
    drawn = env.interpreter.run("print(r)").output
    outs = [env.step(_turn("seen.append(1)\nprint(len(seen), r)"), [2]).observation for _ in range(3)]
    assert outs == [f"{n} {drawn}" for n in (1, 2, 3)]
    env.close()


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
    assert env.step(_turn("import sys\nsys.exit(3)"), [5]).tool.error == "exit code 3"
    assert env.step(_turn("input()"), [6]).tool.error == "EOFError: EOF when reading a line"


def test_a_cell_past_its_timeout_is_killed_with_its_interpreter_and_the_next_starts_fresh():
    """Replayed, the hanging cell would time out every later turn; here the next cell runs in a
    fresh interpreter within its own bound, and what the killed cell printed comes back."""
    env = _tool(timeout_s=2)
    env.step(_turn("x = 5"), [1])
    hang = env.step(_turn("import time\nprint('started', flush=True)\ntime.sleep(1000)"), [2])
    assert hang.tool.error == "timeout after 2 s" + STATE_LOST
    assert hang.observation == "started\n\n" + hang.tool.error
    after = env.step(_turn("print('alive')"), [3])
    assert after.observation == "alive\n" and after.tool.error is None
    assert env.step(_turn("print(x)"), [4]).tool.error == "NameError: name 'x' is not defined"
    env.close()


def test_an_output_flood_is_capped_and_the_interpreter_goes_on():
    """Past the sandbox's file-size limit a write fails in the cell (SIGXFSZ ignored): the
    parent reads back at most that much, and the interpreter keeps its state."""
    env = _tool(timeout_s=20, max_output_chars=50)
    env.step(_turn("kept = 7"), [1])
    flood = env.step(_turn("import sys\nsys.stdout.write('z' * (40 << 20))"), [2])
    assert flood.tool.error.startswith("OSError: [Errno 27]")          # File too large
    assert flood.observation.startswith("z" * 50 + "\n[") and flood.tool.output_bytes <= 32 << 20
    again = env.step(_turn("print(kept)"), [3])
    assert again.observation == "7\n" and again.tool.error is None
    env.close()


def _forge(payload: bytes, cell: int, then: str = "") -> str:
    """A cell that writes `payload` (framed as cell `cell`'s result, or raw) on every pipe it
    holds and on fd 1."""
    return (f"import os\nframe = {payload!r}\n"
            "for fd in range(64):\n"
            "    try:\n"
            "        if fd == 1 or os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n"
            "            os.write(fd, frame)\n"
            "    except OSError:\n"
            f"        pass\n{then}")


def test_forged_frames_and_garbage_do_not_confuse_the_parent():
    env = _tool(timeout_s=5)
    env.step(_turn("x = 1"), [1])
    ok = json.dumps({"ok": True, "error": None}).encode()
    # a well-formed result for this cell (the 2nd) before the real one: the real one is then
    # stale and skipped, and the state is kept
    env.step(_turn(_forge(struct.pack(">4sQI", b"CELL", 2, len(ok)) + ok, 2, "raise ValueError")), [2])
    assert env.step(_turn("print(x)"), [3]).observation == "1\n"
    # garbage, a frame of a later cell, a frame too large: the cell's failure, state lost
    for n, payload in enumerate([b"garbage" * 100, struct.pack(">4sQI", b"CELL", 99, 2) + b"{}",
                                 struct.pack(">4sQI", b"CELL", 5, 1 << 30)]):
        env.step(_turn("x = 1"), [4])
        step = env.step(_turn(_forge(payload, 0)), [5])
        assert step.tool.error.startswith("the interpreter broke its protocol") and STATE_LOST in step.tool.error
        assert env.step(_turn("print(x)"), [6]).tool.error == "NameError: name 'x' is not defined"
    # every fd closed: the interpreter cannot answer, and says so by dying
    closed = env.step(_turn("import os\nos.closerange(0, 64)"), [7])
    assert closed.tool.error.startswith("the cell ended the interpreter") and STATE_LOST in closed.tool.error
    assert env.step(_turn("print('back')"), [8]).observation == "back\n"
    env.close()


def test_a_forked_copy_does_not_answer_twice():
    env = _tool(timeout_s=10)
    env.step(_turn("n = 0"), [1])
    fork = env.step(_turn("import os\nn += 1\npid = os.fork()\nif pid:\n    os.waitpid(pid, 0)\n"
                          "print('parent' if pid else 'child', flush=True)"), [2])
    assert sorted(fork.observation.split()) == ["child", "parent"] and fork.tool.error is None
    assert env.step(_turn("print(n)"), [3]).observation == "1\n"
    env.close()


def test_memory_bounds():
    """One allocation past the limit is the cell's MemoryError (RLIMIT_AS, the interpreter lives
    on); processes that together pass it get the sandbox killed, and the state is lost."""
    env = _tool(timeout_s=60, memory_mb=256)
    env.step(_turn("kept = 1"), [1])
    big = env.step(_turn("b = bytearray(1 << 30)"), [2])
    assert big.tool.error == "MemoryError" and env.step(_turn("print(kept)"), [3]).observation == "1\n"
    hog = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
           "        b = b'x' * (120 << 20)\n        time.sleep(1000)\ntime.sleep(1000)")
    step = env.step(_turn(hog), [4])
    assert step.tool.error == "memory limit exceeded (256 MiB)" + STATE_LOST
    assert env.step(_turn("print('fresh')"), [5]).observation == "fresh\n"
    env.close()


def test_close_and_reset_kill_the_interpreter_and_what_it_started():
    env = _tool(timeout_s=10)
    daemon = ("import os, subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
              "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        import time\n        time.sleep(1000)\n    os._exit(0)\n")
    env.step(_turn(daemon), [1])
    procs = _sandbox_procs(env)
    assert len(procs) >= 4 and all(p.is_running() for p in procs)     # bwrap, REPL, sleep, fork
    env.close()
    assert _running(procs) == [] and env.interpreter.live is None
    env.step(_turn("x = 1"), [2])
    procs = _sandbox_procs(env)
    env.reset(ROW)                                                      # a new episode: killed too
    assert _running(procs) == []
    assert env.step(_turn("print(x)"), [3]).tool.error == "NameError: name 'x' is not defined"
    env.close()


def test_the_interpreter_is_replaced_past_its_lifetime():
    env = _tool(timeout_s=1, lifetime_s=2)
    env.step(_turn("x = 1"), [1])
    procs = _sandbox_procs(env)
    gone, alive = psutil.wait_procs(procs, timeout=60)                 # the watchdog kills it
    assert alive == []
    step = env.step(_turn("print(x)"), [2])
    assert step.observation.startswith("[the interpreter reached its lifetime (2 s): this cell runs "
                                       "in a fresh interpreter")
    assert step.tool.error == "NameError: name 'x' is not defined"
    # a cell that could not finish within what is left of the lifetime starts a fresh one
    interp = Interpreter(timeout_s=1, lifetime_s=1)
    assert interp.run("y = 1").error is None
    cell = interp.run("print(y)")
    assert cell.notice.startswith("[the interpreter reached its lifetime (1 s)")
    assert cell.error == "NameError: name 'y' is not defined"
    interp.close()
    env.close()
    with pytest.raises(ValueError, match="timeout_s <= lifetime_s"):
        Interpreter(timeout_s=10, lifetime_s=5)


def test_a_preempted_episode_is_replayed_once_into_a_fresh_interpreter():
    """runner.replay steps a fresh environment through the saved turns: each earlier cell runs
    once in the new interpreter, and the next cell sees their names."""
    turns = [(_turn("log = []\nx = 6"), [1]), (_turn("log.append('a')\ny = x * 7"), [2]),
             (_turn("print(y, log)"), [3])]
    cfg = from_mapping({"fn": "python", "args": {"timeout_s": 10}, "call_timeout_s": 60})
    first, fresh = EnvProcess(cfg), EnvProcess(cfg)
    try:
        assert first.reset(ROW).observation == "q"
        for text, ids in turns[:2]:
            assert first.step(text, ids).error is None
        first.close()                                                   # a preemption
        assert replay(fresh, ROW, turns) is None
        step = fresh.step(*turns[-1])
        assert step.error is None and step.observation == "42 ['a']\n"
    finally:
        first.close()
        fresh.close()
    env = _tool(timeout_s=10)                                           # the same, in-process
    for text, ids in turns[:2]:
        env.step(text, ids)
    assert env.step(*turns[-1]).observation == "42 ['a']\n"
    env.close()


def test_native_tool_calls_are_cells_of_the_same_interpreter():
    env = _tool(timeout_s=10)
    assert env.call("python", {"code": "x = 6"}).observation == ""
    step = env.call("python", {"code": "print(x * 7)"})
    assert step.observation == "42\n" and step.tool.name == "python" and step.tool.error is None
    assert env.step(_turn("print(x)"), [1]).observation == "6\n"          # blocks too
    with pytest.raises(ValueError, match="code"):
        env.call("python", {"source": "x"})
    env.close()


def test_the_interpreter_runs_over_the_runner():
    proc = EnvProcess(from_mapping({"fn": "python", "args": {"timeout_s": 10}, "call_timeout_s": 60}))
    try:
        assert proc.reset({"question": "q", "answer": "3"}).observation == "q"
        step = proc.step(_turn("print(sum(range(3)))"), [1])
        assert step.error is None and step.observation == "3\n" and step.tool.name == "python"
        assert proc.step("\\boxed{3}", [2]).reward == 1.0
    finally:
        proc.close()


def test_a_sandbox_that_cannot_be_set_up_is_the_cells_error(monkeypatch):
    import areal_hpc.reward.sandbox as sb
    env = _tool(timeout_s=5)
    real = sb._bind_args
    monkeypatch.setattr(sb, "_bind_args", lambda: real() + ["--ro-bind", "/nonexistent", "/x"])
    step = env.step(_turn("print(1)"), [1])
    assert step.tool.error.startswith("sandbox failed:") and step.observation == step.tool.error
    assert env.interpreter.live is None
    monkeypatch.setattr(sb, "_bind_args", real)
    assert env.step(_turn("print(1)"), [2]).observation == "1\n"
    env.close()
