"""Environments run under the same discipline as user reward code (reward/pool.py): in a child
process, bounded in time and output, and everything they start dies with them.

``EnvProcess`` is one child, ``python -m areal_hpc.env.runner CALL_FD RESULT_FD CONFIG_JSON``,
started as pid 1 of a PID namespace of its own (reward/contain.py ``wrap``; where none can be
made, the subreaper fallback that contain.py names). It imports the environment's class once,
says ``{"ready": true}`` (or why it cannot), then serves one episode after another: ``reset``
builds a fresh instance, kills what the previous episode left, and returns the first prompt;
``step`` hands a turn over; ``call`` makes one tool call of a turn (native tool calling: the
instance's ``call(name, arguments)``, its text the call's result; an exception is answered to
the model as the call's error, the episode goes on); ``close``, at the episode's end (after its error too), calls the
instance's ``close()`` and kills what the episode started. Calls go down as pickles (the parent
is the trusted side); answers come back as one line of JSON each, which the parent checks as
plain data of bounded size (``_step_of``): the environment's code can write anything on that
pipe.

Bounds. Each call waits at most ``env.call_timeout_s``; past it, or when the child dies or
breaks the protocol, the child is killed whole (its namespace with it: a daemon, a double fork,
a hang in C code) and the call answers ``Step(error=...)``, the episode's error; the next
``reset`` starts a fresh child. The child's stdout and stderr are a pipe read here: at most
``env.output_bytes`` reach the job's stderr, then one line says the rest was dropped. The
child's address space is limited to ``env.memory_mb``.

``EnvRunner`` runs many episodes at once, one child each, on a thread pool: ``reset`` and
``step`` return futures, so a slow tool holds its own episode only, and the caller (the engine's
loop) goes on.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Hashable

from ..reaper import become_subreaper, kill_descendants
from ..reward import contain
from ..reward.custom import MAX_ABS_VALUE
from ..reward.sandbox import child_env
from .base import MAX_TOKEN_ID, EnvConfig, EnvConfigError, Step, ToolCall, full_spec, load_class

MAX_RESULT_BYTES = 4 << 20      # one answer line (an observation of a few hundred thousand tokens)
MAX_ERROR_CHARS = 200
MAX_TOOL_TEXT = 4096            # a tool record's name and arguments, characters
MAX_OUTPUT_BYTES = 1 << 62      # a tool record's output_bytes (the log's column is int64)
CLEANUP_ROUNDS = 50             # kill-what-is-left passes at an episode's end (a re-spawning chain)
_seq = iter(range(1 << 62))
_seq_lock = threading.Lock()


class EnvProcess:
    """One environment child; see the module docstring. One call at a time; `kill` and `close`
    may come from another thread meanwhile (the runner's close while a call finds the child
    dead and closes it): they hold `_life`, so a pidfd is never used after it is closed."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self._life = threading.RLock()
        self._serial = threading.RLock()    # one call at a time on the pipes (`end_if_idle`)
        self.proc = None
        self.pidfd = None
        self.calls = self.results = self.output = None
        self._buf = b""
        self._calls = 0

    # ---- the calls ----

    def reset(self, row: dict) -> Step:
        """A new episode: the first prompt in ``observation`` (text or ids), or ``error``."""
        if self.proc is None:
            why = self._start()
            if why is not None:
                return Step(done=True, error=why, cause="died")
        return self._call("reset", row)

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        """The environment's answer to one model turn, or ``error`` (the episode ends)."""
        if self.proc is None:
            return Step(done=True, error="the environment's process is gone (no reset?)", cause="died")
        return self._call("step", turn_text, list(turn_ids))

    def call(self, name: str, arguments: str) -> Step:
        """One tool call of a model turn (native tool calling): its result in ``observation``
        (text) and its record in ``tool``, or ``error`` (the episode ends)."""
        if self.proc is None:
            return Step(done=True, error="the environment's process is gone (no reset?)", cause="died")
        return self._call("call", name, arguments)

    def end(self) -> Step:
        """The episode is over: the environment's ``close()`` (bounded as a call), then what
        the episode started is killed; ``error`` if close raised or the child broke (killed)."""
        if self.proc is None:
            return Step(done=True, error="the environment's process is gone", cause="died")
        return self._call("close")

    def kill(self) -> None:
        """Kill the child and everything it started (bounded); a call waiting on it answers
        that the process died. Its pipes stay open until ``close``."""
        with self._life:
            if self.proc is not None:
                contain.end(self.proc, self.pidfd)

    def close(self) -> None:
        """``kill``, then close the pipes (once: a second close does nothing)."""
        with self._life:
            self.kill()
            fds = (self.pidfd, self.calls, self.results)
            self.proc = self.pidfd = self.calls = self.results = None
            self._buf = b""
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    # ---- the child, seen from here ----

    def _start(self) -> str | None:
        """Start the child and wait for its ready line; None, or why not (it is then gone)."""
        cfg = self.cfg
        call_r, call_w = os.pipe()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        with _seq_lock:
            n = next(_seq)
        env = child_env(1 << 28, n)     # sandbox uids apart from the reward workers' (1 << 27)
        setup = {"spec": full_spec(cfg.fn), "args": cfg.args, "memory_mb": cfg.memory_mb}
        try:
            self.proc = subprocess.Popen(
                contain.wrap([sys.executable, "-m", "areal_hpc.env.runner", str(call_r),
                              str(res_w), json.dumps(setup)]),
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, pass_fds=(call_r, res_w),
                env=env, start_new_session=True)
        except OSError as e:
            for fd in (call_w, res_r, out_r):
                os.close(fd)
            return f"the environment's process failed to start: {e}"[:MAX_ERROR_CHARS]
        finally:
            for fd in (call_r, res_w, out_w):
                os.close(fd)
        self.calls, self.results = call_w, res_r
        os.set_blocking(call_w, False)
        self.pidfd = contain.pidfd(contain.init_pid(self.proc))
        self.output = Output(out_r, cfg.output_bytes, f"environment {self.proc.pid}")
        self.output.start()
        line = self._read_line(time.monotonic() + cfg.start_timeout_s)
        try:
            msg = json.loads(line) if isinstance(line, bytes) else None
        except ValueError:
            msg = None
        if msg == {"ready": True}:
            return None
        self.close()
        if isinstance(line, str):
            return f"the environment did not start: {line}"
        if type(msg) is dict and type(msg.get("error")) is str:
            return msg["error"][:MAX_ERROR_CHARS]
        return "the environment did not start: no ready line"

    def end_if_idle(self) -> Step | None:
        """`end` unless a call is in flight (None then: the caller kills it instead)."""
        if not self._serial.acquire(blocking=False):
            return None
        try:
            return self.end()
        finally:
            self._serial.release()

    def _call(self, op: str, *args) -> Step:
        with self._serial:
            return self._call_serial(op, *args)

    def _call_serial(self, op: str, *args) -> Step:
        self._calls += 1
        call_id = self._calls
        deadline = time.monotonic() + self.cfg.call_timeout_s
        try:
            frame = pickle.dumps((call_id, op, args))
        except Exception as e:     # e.g. a row that does not pickle: this episode's error
            return Step(done=True, error=f"{op}: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS],
                        cause="refused")
        why = self._send(struct.pack(">Q", len(frame)) + frame, deadline)
        line = self._read_line(deadline) if why is None else why
        if isinstance(line, str):
            self.close()        # past its bound, dead, or flooding: killed whole
            cause = ("timeout" if line.startswith("timeout") else
                     "refused" if line.startswith("an answer over") else "died")
            return Step(done=True, error=f"{op}: {line}"[:MAX_ERROR_CHARS], cause=cause)
        try:
            return _step_of(line, call_id, op)
        except (ValueError, TypeError, RecursionError) as e:
            self.close()
            return Step(done=True, error=f"{op}: answer refused: {e}"[:MAX_ERROR_CHARS],
                        cause="refused")

    def _send(self, data: bytes, deadline: float) -> str | None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.calls], [], left)[1]:
                return f"timeout after {self.cfg.call_timeout_s:g} s (the call was not taken)"
            try:
                view = view[os.write(self.calls, view):]
            except BlockingIOError:
                pass
            except OSError:
                return "the environment's process died"
        return None

    def _read_line(self, deadline: float) -> bytes | str:
        """The next line from the child, or why none came (a str)."""
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_RESULT_BYTES:
                return f"an answer over {MAX_RESULT_BYTES} bytes"
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.results], [], [], left)[0]:
                return f"timeout after {self.cfg.call_timeout_s:g} s"
            chunk = os.read(self.results, 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=5) if self.proc is not None else None
                self.output.join(timeout=5)     # its last words, for the error
                last = self.output.last_line()
                return f"the environment's process died (exit code {code})" + (f": {last}" if last else "")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _utf8(text: str) -> str:
    """`text` that encodes as UTF-8: a lone surrogate (what `os.fsdecode` makes of a file name
    that is not UTF-8, and JSON can carry) written as its escape, not left to fail a
    tokenizer or the log."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _step_of(line: bytes, call_id: int, op: str) -> Step:
    """A Step from one answer line, checked as exact plain types and bounded values; its text
    valid UTF-8."""
    msg = json.loads(line, parse_constant=_reject_constant)
    if type(msg) is not dict or type(msg.get("id")) is not int or msg["id"] != call_id:
        raise ValueError("not the answer to the call")
    if "error" in msg:
        if type(msg["error"]) is not str:
            raise ValueError("an error that is not a string")
        return Step(done=True, error=_utf8(msg["error"][:MAX_ERROR_CHARS]), cause="raised")
    obs, done, reward, tool, discard = (msg.get(k) for k in
                                        ("observation", "done", "reward", "tool", "discard"))
    if not (discard is None or type(discard) is str):
        raise ValueError("discard is not a string")
    if type(obs) is list:
        if not all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in obs):
            raise ValueError("observation: a list with something not a token id")
    elif type(obs) is str:
        obs = _utf8(obs)
    elif obs is not None:
        raise ValueError(f"observation is a {type(obs).__name__}")
    if op == "reset" and (obs is None or not obs):
        raise ValueError("reset returned no prompt")
    if op == "call" and discard is None and not done and type(obs) is not str:
        raise ValueError("a tool call's result is not text")
    if type(done) is not bool:
        raise ValueError("done is not a bool")
    if reward is not None:
        if type(reward) not in (int, float) or not abs(reward) <= MAX_ABS_VALUE:
            raise ValueError(f"reward is {reward!r}, not a number within ±{MAX_ABS_VALUE:g}")
        reward = float(reward)
    if tool is not None:
        if (type(tool) is not dict or set(tool) != {"name", "args", "output_bytes", "seconds", "error"}
                or type(tool["name"]) is not str or type(tool["args"]) is not str
                or type(tool["output_bytes"]) is not int or type(tool["seconds"]) not in (int, float)
                or not (tool["error"] is None or type(tool["error"]) is str)):
            raise ValueError("tool is not a tool record")
        # (1e400 parses to inf; an int past int64 would fail the log's column on the controller)
        if not math.isfinite(tool["seconds"]) or abs(tool["seconds"]) > MAX_ABS_VALUE:
            raise ValueError(f"tool seconds is {tool['seconds']!r}, not a number within ±{MAX_ABS_VALUE:g}")
        if abs(tool["output_bytes"]) > MAX_OUTPUT_BYTES:
            raise ValueError(f"tool output_bytes is {tool['output_bytes']}, past {MAX_OUTPUT_BYTES}")
        tool = ToolCall(_utf8(tool["name"][:MAX_TOOL_TEXT]), _utf8(tool["args"][:MAX_TOOL_TEXT]),
                        max(0, tool["output_bytes"]), max(0.0, float(tool["seconds"])),
                        None if tool["error"] is None else _utf8(tool["error"][:MAX_ERROR_CHARS]))
    if discard is not None:
        why = "discarded by the environment" + (f": {_utf8(discard)}" if discard else "")
        return Step(done=True, reward=reward, tool=tool, error=why[:MAX_ERROR_CHARS], cause="env")
    return Step(observation=obs, done=done, reward=reward, tool=tool)


class Output(threading.Thread):
    """A child's stdout and stderr, read to the end (a writer never blocks on a full pipe):
    the first `limit` bytes onto the job's stderr, then one line saying the rest is dropped; its
    last line kept for the error of a child that dies (``last_line``)."""

    def __init__(self, fd: int, limit: int, label: str):
        super().__init__(daemon=True, name="env-output")
        self.fd, self.left, self.limit, self.label = fd, limit, limit, label
        self.tail = b""

    def run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=0) as f:
            for chunk in iter(lambda: f.read(1 << 16), b""):
                self.tail = (self.tail + chunk)[-4096:]
                shown, self.left = chunk[:max(0, self.left)], self.left - len(chunk)
                note = (f"\n[{self.label}: output past {self.limit} bytes dropped]\n".encode()
                        if self.left <= 0 < self.left + len(chunk) else b"")
                try:
                    os.write(2, shown + note)
                except OSError:
                    pass

    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.tail.decode("utf-8", "replace").splitlines()]
        return next((ln[:MAX_ERROR_CHARS] for ln in reversed(lines) if ln), "")


# ---- many episodes at once ----

class EnvRunner:
    """Episodes side by side, one child process each (kept for the next episode when one ends
    cleanly), their calls on a pool of ``max_episodes`` threads: ``reset(key, row)`` and
    ``step(key, text, ids)`` return futures of Steps (never failing: an error is in the Step),
    ``finish(key)`` ends an episode. Thread-safe."""

    def __init__(self, cfg: EnvConfig, max_episodes: int):
        self.cfg, self.max_episodes = cfg, max_episodes
        self._pool = ThreadPoolExecutor(max_workers=max_episodes, thread_name_prefix="env")
        self._lock = threading.Lock()
        self._running: dict[Hashable, EnvProcess] = {}
        self._idle: list[EnvProcess] = []
        self._closed = False

    def reset(self, key: Hashable, row: dict) -> Future:
        return self._pool.submit(self._take(key).reset, row)

    def _take(self, key: Hashable) -> EnvProcess:
        """A process for a new episode: an idle one, or a new one (started by its first call)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EnvRunner is closed")
            if key in self._running:
                raise ValueError(f"episode {key!r} is running already")
            proc = self._running[key] = self._idle.pop() if self._idle else EnvProcess(self.cfg)
        return proc

    def step(self, key: Hashable, turn_text: str, turn_ids: list[int]) -> Future:
        with self._lock:
            proc = self._running[key]
        return self._pool.submit(proc.step, turn_text, turn_ids)

    def call(self, key: Hashable, calls: list[tuple[str, str]]) -> Future:
        """A model turn's tool calls (name, arguments as JSON text), one after another: a
        future of their Steps (`call_all`), never failing."""
        with self._lock:
            proc = self._running[key]
        return self._pool.submit(call_all, proc, calls)

    def restore(self, key: Hashable, row: dict, turns: list[tuple[str, list[int]]]) -> Future:
        """A resumed episode (its process went with a preemption): a future of the Steps of
        `replay_steps` (reset, then one per model turn in `turns`), never failing."""
        return self._pool.submit(replay_steps, self._take(key), row, turns)

    def finish(self, key: Hashable) -> Future | None:
        """The episode is over (call it once its last future is done; also after its error):
        on the pool, the environment's ``close()`` and a kill of what the episode started
        (`EnvProcess.end`), then its child waits for the next episode (or ends, past
        ``max_episodes`` idle ones). Returns the future of the end's Step (None: the child was
        gone already)."""
        with self._lock:
            proc = self._running.pop(key)
            live = not self._closed and proc.proc is not None
        if not live:
            proc.close()
            return None
        return self._pool.submit(self._end, proc)

    def _end(self, proc: EnvProcess) -> Step:
        step = proc.end()
        with self._lock:
            keep = (not self._closed and proc.proc is not None
                    and len(self._idle) + len(self._running) < self.max_episodes)
            if keep:
                self._idle.append(proc)
        if not keep:
            proc.close()
        return step

    def close(self, ending_s: float = 0.0) -> None:
        """Kill every child (and what it started); unfinished calls end with an error. First,
        within `ending_s` in all (a preemption's or the run's end), each running episode whose
        environment is not answering a call gets its ``close()`` (`EnvProcess.end_if_idle`)."""
        with self._lock:
            self._closed = True
            running = list(self._running.values())
            procs = running + self._idle
            self._running.clear()
            self._idle.clear()
        if ending_s > 0 and running:
            with ThreadPoolExecutor(max_workers=len(running), thread_name_prefix="env-end") as pool:
                wait([pool.submit(p.end_if_idle) for p in running], timeout=ending_s)
                for proc in running:    # an end past the bound: killed (its call answers)
                    proc.kill()
        for proc in procs:      # first: a call in flight then answers (the process died)
            proc.kill()
        self._pool.shutdown(wait=True)
        for proc in procs:
            proc.close()

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call_all(proc: EnvProcess, calls: list[tuple[str, str]]) -> list[Step]:
    """`proc`'s answers to a turn's tool calls, in order, up to and with the first that ends the
    episode (an error, a discard)."""
    steps: list[Step] = []
    for name, arguments in calls:
        steps.append(proc.call(name, arguments))
        if steps[-1].error is not None or steps[-1].done:
            break
    return steps


def replay_steps(proc: EnvProcess, row: dict, turns: list[tuple]) -> list[Step]:
    """Step `proc` from a reset with `row` through every model turn of `turns` (their text, their
    ids, and with native tool calling their calls: a list, then those are made instead of a
    step): the Steps it answered, the reset's first, up to and with the first error."""
    steps = [proc.reset(row)]
    for text, ids, *calls in turns:
        if steps[-1].error is not None:
            break
        if calls and calls[0] is not None:
            steps += call_all(proc, calls[0])
        else:
            steps.append(proc.step(text, ids))
    return steps


def replay(proc: EnvProcess, row: dict, turns: list[tuple[str, list[int]]]) -> Step | None:
    """Bring a fresh environment to where a resumed episode was (a preemption took its process):
    reset with the row, then step through the episode's model turns (their text, their ids) but
    the last one, which the caller steps itself. The observations it answers are not appended:
    the episode's saved tokens are the ones trained. Returns the first error, else None."""
    return next((s for s in replay_steps(proc, row, turns[:-1]) if s.error is not None), None)


def check(cfg: EnvConfig, key: str = "env") -> None:
    """Import `env.fn` in a child, bounded, before any rank starts: EnvConfigError names the
    key. (The child is the environment's own process, started and ended once.)"""
    if cfg.fn is None:
        return
    proc = EnvProcess(cfg)
    try:
        why = proc._start()
    finally:
        proc.close()
    if why is not None:
        raise EnvConfigError(f"config key '{key}.fn': {why}")


def check_reset(cfg: EnvConfig, row: dict, key: str = "env") -> None:
    """Build the environment and reset it on `row` in a child, bounded, then end it (a generator
    node's start-up check): EnvConfigError naming `env.fn` with the reason when it fails. A
    broken environment would otherwise fail every group of the run, one at a time."""
    proc = EnvProcess(cfg)
    try:
        step = proc.reset(row)
        if step.error is None:
            step = proc.end()
    finally:
        proc.close()
    if step.error is not None:
        raise EnvConfigError(f"config key '{key}.fn': its reset on the first training row fails: "
                             f"{step.error}")


# ---- the child ----

def _limit_memory(memory_mb: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = memory_mb << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _plain(out, op: str) -> dict:
    """What the environment returned, as the answer's fields (TypeError says why not)."""
    if op == "reset":
        return {"observation": out if isinstance(out, str) else [int(i) for i in out],
                "done": False, "reward": None, "tool": None}
    if isinstance(out, tuple):
        out = Step(*out)
    if not isinstance(out, Step):
        raise TypeError(f"step returned a {type(out).__name__}, not a Step or a tuple")
    obs = out.observation
    if obs is not None and not isinstance(obs, str):
        obs = [int(i) for i in obs]
    reward = out.reward
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        raise TypeError(f"step returned the reward {reward!r}")
    tool = asdict(out.tool) if out.tool is not None else None
    discard = None if not out.discard else "" if out.discard is True else str(out.discard)
    return {"observation": obs, "done": bool(out.done),
            "reward": None if reward is None else float(reward), "tool": tool, "discard": discard}


def _tool_call(env, name: str, arguments: str) -> dict:
    """The answer to one tool call: the instance's ``call(name, arguments)`` (its text, or a
    Step for full control: a discard, a reward); an exception in it is the call's error,
    answered to the model (a bad argument is the model's doing), the episode goes on."""
    fn = getattr(env, "call", None)
    if env is None or not callable(fn):
        raise TypeError("the environment has no call(name, arguments) method for its tools")
    t0 = time.monotonic()
    record = {"name": name, "args": arguments[:MAX_TOOL_TEXT], "output_bytes": 0, "seconds": 0.0,
              "error": None}
    try:
        out = fn(name, json.loads(arguments))
    except Exception as e:      # noqa: BLE001 - the tool's failure, the model's to read
        text = f"error: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        return {"observation": text, "done": False, "reward": None,
                "tool": {**record, "seconds": time.monotonic() - t0, "error": text}}
    if isinstance(out, Step):
        plain = _plain(out, "step")
        plain["tool"] = plain["tool"] or {**record, "seconds": time.monotonic() - t0}
        return plain
    if not isinstance(out, str):
        raise TypeError(f"call returned a {type(out).__name__}, not text or a Step")
    return {"observation": out, "done": False, "reward": None,
            "tool": {**record, "output_bytes": len(out.encode("utf-8", "replace")),
                     "seconds": time.monotonic() - t0}}


def _send_line(fd: int, msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _kill_what_is_left() -> None:
    for _ in range(CLEANUP_ROUNDS):       # what the last episode left
        if not kill_descendants():
            break


def main(argv: list[str]) -> int:
    calls, result_fd, setup = os.fdopen(int(argv[0]), "rb"), int(argv[1]), json.loads(argv[2])
    become_subreaper()          # (pid 1 of a namespace already is; the fallback is not)
    _limit_memory(setup["memory_mb"])
    try:
        cls = load_class(setup["spec"])
    except EnvConfigError as e:
        _send_line(result_fd, {"error": str(e)})
        return 1
    _send_line(result_fd, {"ready": True})
    env = None
    while (head := calls.read(8)) and len(head) == 8:
        call_id, op, args = pickle.loads(calls.read(struct.unpack(">Q", head)[0]))
        try:
            if op == "close":       # the episode is over: its close(), then what it started
                ending, env = env, None
                if ending is not None and hasattr(ending, "close"):
                    ending.close()
                _kill_what_is_left()
                out = {"done": True}
            elif op == "reset":
                if env is not None and hasattr(env, "close"):
                    env.close()         # (an episode whose end was not sent: a replay)
                _kill_what_is_left()
                env = cls(**setup["args"])
                out = _plain(env.reset(*args), op)
            elif op == "call":
                out = _tool_call(env, *args)
            else:
                out = _plain(env.step(*args), op)
            msg = {"id": call_id, **out}
            _send_line(result_fd, msg)
        except Exception as e:      # the environment's: this episode's error, the child goes on
            _send_line(result_fd, {"id": call_id, "error": f"{op}: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
