"""One episode's live Python interpreter, in the code sandbox (reward/sandbox_live.py): the state of
the Python tool (env/python_tool.py) kept across cells in one process, never replayed.

Inside the sandbox runs ``REPL``, a small loop: it reads a cell from its stdin, ``exec``s it in
one persistent ``__main__`` namespace, and writes one result frame to its stdout. Frames, both
ways: a 16-byte header (4-byte magic, 8-byte cell id, 4-byte payload length, big-endian), then
the payload: the cell's UTF-8 source down, a JSON object ``{"ok": bool, "error": text or null}``
up (the error: the last line of the exception's traceback, as the process's stderr would end;
``exit code N`` for ``sys.exit(N)``). What the cell prints does not travel in the frame: the
sandbox's stderr is an unlinked file the parent holds, the REPL points fd 1 (and ``sys.stdout``)
of each cell at it, emptied first, so ``print``, ``os.write(1, ...)`` and a subprocess's output
all land there, in one bounded file (``RLIMIT_FSIZE``; ``SIGXFSZ`` ignored, so a flood fails
its write, not the interpreter), and the parent reads it back with a hard cap, also after it
killed the cell (what a timed-out cell printed is not lost).

The cell's code is hostile and runs in the same process as the loop, so nothing inside is
trusted: it may forge a frame, write garbage on the protocol pipe, close every fd, fork, sleep
forever, print gigabytes. The loop keeps its pipes away from the cell (fds 60 and 61, not
inherited by its subprocesses; fd 0 is /dev/null and fd 2 too), so only a cell that hunts
them can touch them, and the parent holds everything that matters: every read and write has
the cell's deadline (``timeout_s``, from the cell's sending to its frame), a frame's size is
capped, a frame of an earlier cell (a forged extra, a forked copy's) is skipped, and anything
else that does not parse is the cell's failure: the interpreter is killed and its state lost,
as after a timeout, and the next cell starts a fresh one. A forged frame for the current cell
only changes what the model is told about its own cell.

Bounds on the interpreter itself: memory (``memory_mb``: RLIMIT_AS per process, so a large
allocation is a MemoryError in the cell and the interpreter lives on; the cgroup or the summed
memory of all its processes kills the sandbox) and lifetime (``lifetime_s``): the sandbox's
watchdog kills it past its lifetime, and a cell that could not finish within what is left of it
(``timeout_s``) starts a fresh interpreter instead; the cell's result then says so (``notice``).
"""
from __future__ import annotations

import codecs
import json
import os
import struct
import time
from dataclasses import dataclass

from ..reward.sandbox import MAX_ERROR_CHARS, MAX_OUTPUT_BYTES
from ..reward.sandbox_live import LiveSandbox

HEADER = struct.Struct(">4sQI")        # magic, cell id, payload length
CODE_MAGIC, RESULT_MAGIC = b"CODE", b"CELL"
MAX_FRAME_BYTES = 4096                 # a result frame's payload (ok and a one-line error)
MAX_READ_BYTES = 1 << 20               # result bytes read for one cell, stale frames included
READ_CHUNK = 1 << 20                   # the output file is decoded in chunks of this size
STATE_LOST = "; the interpreter was restarted and its state is lost"

# Runs inside the sandbox (python -I, after the bootstrap's limits): see the module doc.
REPL = r'''
MAX_ERROR_CHARS = %d
import builtins, io, json, os, signal, struct, sys, traceback, types

def main():
    CMD, RES, OUT, NULL = 60, 61, 62, 63          # RLIMIT_NOFILE is 64: the top four
    dup2, read, write, getpid, _exit = os.dup2, os.read, os.write, os.getpid, os._exit
    ftruncate, lseek, dumps, header = os.ftruncate, os.lseek, json.dumps, struct.Struct(">4sQI")
    format_exc_only = traceback.format_exception_only
    dup2(0, CMD, inheritable=False)
    dup2(1, RES, inheritable=False)
    dup2(2, OUT, inheritable=False)
    null = os.open(os.devnull, os.O_RDWR)
    dup2(null, NULL, inheritable=False)
    os.close(null)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a flood fails its write, not the interpreter
    module = types.ModuleType("__main__")          # the cells' namespace (pickle finds it)
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    cells, pid, stdin, stdout, stderr = module.__dict__, getpid(), None, None, None

    def usable(f):
        try:
            return f is not None and not f.closed
        except BaseException:                     # detached
            return False

    def take(n):
        data = b""
        while len(data) < n:
            chunk = read(CMD, n - len(data))
            if not chunk:
                _exit(0)                          # the parent is done with us
            data += chunk
        return data

    while True:
        magic, cid, n = header.unpack(take(header.size))
        if magic != b"CODE":
            _exit(3)
        source = take(n).decode("utf-8", "surrogatepass")
        for fd, to in ((NULL, 0), (OUT, 1), (NULL, 2)):   # whatever the last cell did to them
            dup2(fd, to)
        ftruncate(1, 0)
        lseek(1, 0, 0)
        if not usable(stdin):                     # (exit() closes sys.stdin; a cell may close any)
            stdin = io.open(0, "r", closefd=False)
        if not usable(stdout):
            stdout = io.open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        if not usable(stderr):
            stderr = io.open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = (
            stdin, stdout, stderr)
        ok, error = True, None
        try:
            exec(compile(source, "<cell>", "exec"), cells)
        except SystemExit as e:
            if e.code is not None and e.code != 0:
                ok, error = False, (f"exit code {e.code}" if isinstance(e.code, int)
                                    else str(e.code))
        except BaseException as e:
            ok = False
            try:
                lines = [ln.strip() for ln in "".join(format_exc_only(type(e), e)).splitlines()]
                error = [ln for ln in lines if ln][-1]
            except BaseException:
                error = "the cell raised an exception that cannot be shown"
        if getpid() != pid:                       # a forked copy that came back here: done
            try:
                stdout.flush()
            finally:
                _exit(0)
        try:
            stdout.flush()
        except BaseException:
            pass
        payload = dumps({"ok": ok, "error": error and error[:MAX_ERROR_CHARS]}).encode()
        frame = header.pack(b"CELL", cid, len(payload)) + payload
        while frame:
            frame = frame[write(RES, frame):]

main()
''' % MAX_ERROR_CHARS            # an error's line: 12 bytes a character at most in JSON


class ProtocolError(Exception):
    """The interpreter answered something that is not its frame: the cell's failure."""


@dataclass
class Cell:
    """One cell's outcome: what it printed (cut to ``max_output_chars``), how much it printed
    (characters and bytes), its error (None = it ran), its seconds (a fresh interpreter's start
    included), and ``notice``: the interpreter it ran in is a fresh one though an earlier cell
    had one, and why (its state is lost), else None."""
    output: str = ""
    chars: int = 0
    output_bytes: int = 0
    error: str | None = None
    seconds: float = 0.0
    notice: str | None = None


class Interpreter:
    """``Interpreter(timeout_s=, memory_mb=, lifetime_s=, max_output_chars=)``: ``run(code)``
    runs one cell in the episode's interpreter (started at the first cell), ``close()`` kills
    it. ``fresh=True``: every cell in an interpreter of its own, killed after it."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, lifetime_s: float = 300.0,
                 max_output_chars: int = 2000, fresh: bool = False):
        if not lifetime_s >= timeout_s > 0:
            raise ValueError(f"expected 0 < timeout_s <= lifetime_s, got timeout_s={timeout_s} "
                             f"and lifetime_s={lifetime_s}")
        self.timeout_s, self.memory_mb, self.lifetime_s = timeout_s, memory_mb, lifetime_s
        self.max_output_chars, self.fresh = max_output_chars, fresh
        self.live: LiveSandbox | None = None
        self._cell_id = 0
        self._pending = b""        # bytes read past the last frame (the next frame's, or stale)

    def run(self, code: str) -> Cell:
        start = time.monotonic()
        notice = self._retire()
        if self.live is None:
            live = LiveSandbox(REPL, lifetime_s=self.lifetime_s, memory_mb=self.memory_mb)
            if live.sandbox_error is not None:
                live.close()
                return Cell(error=live.sandbox_error, seconds=time.monotonic() - start,
                            notice=notice)
            self.live, self._pending = live, b""
        self._cell_id += 1
        deadline = time.monotonic() + self.timeout_s
        error = None
        try:
            data = code.encode("utf-8", "surrogatepass")
            self.live.write(HEADER.pack(CODE_MAGIC, self._cell_id, len(data)) + data, deadline)
            ok, error = self._result(deadline)
        except TimeoutError:
            self.live.kill("timeout")
            error = self._gone()
        except (BrokenPipeError, EOFError):
            error = self._gone()
        except ProtocolError as e:
            self.live.kill("protocol")
            error = f"the interpreter broke its protocol ({e})"
        lost = error is not None and not self.live.alive()
        if error is not None:
            error = error[:MAX_ERROR_CHARS] + (STATE_LOST if lost and not self.fresh else "")
        text, chars, size = read_output(self.live.stderr_fd, self.max_output_chars)
        if self.fresh or lost:      # (one that died after its cell's frame: the next cell says so)
            self._stop()
        return Cell(text, chars, size, error, time.monotonic() - start, notice)

    def _retire(self) -> str | None:
        """Before a cell: stop an interpreter that has gone or could not see the cell through
        within its lifetime; the cell's notice if one had been running (its state is lost)."""
        if self.live is None:
            return None
        if not self.live.alive():
            why = self._gone()
        elif time.monotonic() + self.timeout_s > self.live.born + self.lifetime_s:
            why = f"the interpreter reached its lifetime ({self.lifetime_s:g} s)"
        else:
            return None
        self._stop()
        return f"[{why}: this cell runs in a fresh interpreter, the earlier cells' names are gone]"

    def _gone(self) -> str:
        """Why the interpreter is no more (killed, or it exited)."""
        live = self.live
        if live.ended == "timeout":
            return f"timeout after {self.timeout_s:g} s"
        if live.over_memory():
            return f"memory limit exceeded ({self.memory_mb} MiB)"
        if live.ended == "lifetime":
            return f"the interpreter reached its lifetime ({self.lifetime_s:g} s)"
        live.kill("exited")         # (and waits for bwrap: its exit code is the program's)
        code = live.returncode()
        return (f"the interpreter died (signal {-code})" if code is not None and code < 0
                else f"the cell ended the interpreter (exit code {code})")

    def _result(self, deadline: float) -> tuple[bool, str | None]:
        """The current cell's frame (frames of earlier cells skipped)."""
        read = 0
        while True:
            head = self._take(HEADER.size, deadline)
            magic, cid, n = HEADER.unpack(head)
            if magic != RESULT_MAGIC:
                raise ProtocolError(f"garbage {head[:8]!r}")
            if n > MAX_FRAME_BYTES:
                raise ProtocolError(f"a frame of {n} bytes")
            if cid > self._cell_id:
                raise ProtocolError(f"a frame for cell {cid}, not {self._cell_id}")
            payload = self._take(n, deadline)
            read += HEADER.size + n
            if read > MAX_READ_BYTES:
                raise ProtocolError("too many frames")
            if cid < self._cell_id:
                continue                    # an earlier cell's: stale
            try:
                msg = json.loads(payload)
            except ValueError:
                raise ProtocolError("a frame that is not JSON") from None
            if not (isinstance(msg, dict) and type(msg.get("ok")) is bool
                    and (msg.get("error") is None or isinstance(msg["error"], str))):
                raise ProtocolError("a frame without ok and error")
            return msg["ok"], (None if msg["ok"] else (msg["error"] or "the cell failed"))

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self._pending) < n:
            chunk = self.live.read(max(n - len(self._pending), 1 << 16), deadline)
            if not chunk:
                raise EOFError
            self._pending += chunk
        data, self._pending = self._pending[:n], self._pending[n:]
        return data

    def _stop(self) -> None:
        if self.live is not None:
            self.live.close()
        self.live, self._pending = None, b""

    def close(self) -> None:
        """Kill the interpreter (and everything it started); the next cell starts a fresh one
        and says nothing of it (a new episode)."""
        self._stop()


def read_output(fd: int | None, max_chars: int) -> tuple[str, int, int]:
    """(the first ``max_chars`` characters, the character count, the byte count) of the
    output file, decoded as UTF-8 with replacement; read in chunks, at most MAX_OUTPUT_BYTES."""
    if fd is None:
        return "", 0, 0
    size = os.fstat(fd).st_size
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    head, chars, pos, end = [], 0, 0, min(size, MAX_OUTPUT_BYTES)
    while pos < end:
        data = os.pread(fd, min(READ_CHUNK, end - pos), pos)
        if not data:
            break
        pos += len(data)
        text = decode(data)
        if chars < max_chars:
            head.append(text[:max_chars - chars])
        chars += len(text)
    tail = decode(b"", final=True)
    if chars < max_chars:
        head.append(tail[:max_chars - chars])
    return "".join(head), chars + len(tail), size
