"""Code reward: run a completion's Python program against stdin/stdout tests.

Each test runs the program in a fresh bubblewrap sandbox of its own (reward/sandbox.py: own PID,
network, IPC, UTS namespaces, an unprivileged uid, a read-only file system holding only the Python
installation, a private tmpfs as cwd, ``PATH``/``LANG`` only, limits on processes, memory, CPU,
output, wall clock). The program gets its source and the test's stdin, nothing else: the expected
output stays in this process, which compares it; grader code, datasets, other tests and the
host's processes are out of its reach, and whatever it started dies with its test.

Two kinds of failure:

- the program failed (wrong answer, exception, non-zero exit, memory or output limit): the test
  fails, reward 0.0, no error for the caller;
- the test could not be judged (the sandbox could not be set up or failed, or the test passed its
  wall-clock limit): the test fails *and* ``run_tests`` returns the reason as ``error``, which
  reward/pool.py reports as the call's error (the ``reward_error`` column, the ``reward_errors``
  metric): a broken node is never silently a row of wrong answers.

``unsafe_no_sandbox=True`` (config ``reward.unsafe_no_sandbox``) runs the program the old way, a
plain subprocess with rlimits in a scratch directory: that bounds accidents, not attacks (the
program can read the file system and the environment, use the network, signal the job). Its
limits are set in ``preexec_fn``, which CPython documents as unsafe in a process with threads;
the function only calls already-imported C functions, and reward/pool.py calls ``run_tests`` from
single-threaded worker processes.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

from areal_hpc.reward.sandbox import MAX_OUTPUT_BYTES, Sandbox

MAX_ERROR_CHARS = 200
OUTPUT_RATIO, OUTPUT_SLACK_BYTES = 4, 64 << 10     # output_matches: past this, wrong unread
MAX_SCAN_CHARS = 1 << 20       # the start of a completion searched for its code (1 MiB of text)
CPU_LIMIT_SLACK_S = 1  # RLIMIT_CPU = ceil(timeout_s) + this; the wall clock normally fires first
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

_PR_SET_PDEATHSIG = 1
_FENCE_TAG = re.compile(r"[ \t]*([\w+-]*)")      # a fence's tag, after the ```
_PYTHON_TAGS = {"python", "python3", "py"}
_SIGNAL_REASONS = {
    signal.SIGKILL: "killed (SIGKILL)",
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "output limit exceeded",
    signal.SIGSEGV: "segmentation fault",
}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of every closed fenced block, left to right: a ``` fence, its tag (letters,
    digits, _ + -) and the rest of its line, then the body up to the next ```. One pass over the
    text (each ``` is looked at once), so a completion full of unclosed fences costs no more than
    its length; an unclosed fence (a truncated completion) is not a block."""
    blocks, j = [], 0
    while (o := text.find("```", j)) != -1:
        nl = text.find("\n", o + 3)
        if nl == -1:
            break
        c = text.find("```", nl + 1)
        if c == -1:
            break
        blocks.append((_FENCE_TAG.match(text, o + 3, nl).group(1), text[nl + 1:c]))
        j = c + 3
    return blocks


def extract_code(completion_text: str) -> str:
    """The program in a completion: the last fenced block tagged ``python``/``py``/``python3``;
    failing that the last untagged fenced block; failing that the whole text.

    An unclosed fence (a truncated completion) is not a block.
    """
    python_blocks, bare_blocks = [], []
    for tag, body in fenced_blocks(completion_text[:MAX_SCAN_CHARS]):
        tag = tag.lower()
        if tag in _PYTHON_TAGS:
            python_blocks.append(body)
        elif not tag:
            bare_blocks.append(body)
    blocks = python_blocks or bare_blocks
    return blocks[-1] if blocks else completion_text


def _normalise_output(data: bytes) -> bytes:
    """Trailing whitespace of every line and trailing blank lines don't count."""
    lines = [line.rstrip() for line in data.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return b"\n".join(lines)


def output_matches(got: bytes, expected: str) -> bool:
    """Whether a program's stdout is the expected output, compared as bytes (never decoded, so
    its size is what it costs): an output more than OUTPUT_RATIO times the expected one plus
    OUTPUT_SLACK_BYTES is wrong without being split into lines at all."""
    want = _normalise_output(expected.encode("utf-8", "surrogateescape"))
    if len(got) > OUTPUT_RATIO * len(want) + OUTPUT_SLACK_BYTES:
        return False
    return _normalise_output(got) == want


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()  # loaded here: preexec_fn must not load libraries after fork


def _limit_child(timeout_s: float, memory_mb: int, parent_pid: int):
    cpu_s = math.ceil(timeout_s) + CPU_LIMIT_SLACK_S
    memory_bytes = memory_mb << 20

    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return preexec


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _tail(path: str) -> str:
    """Last non-empty line of a (possibly huge) file, shortened to MAX_ERROR_CHARS."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][:MAX_ERROR_CHARS] if lines else ""


def _run_sandboxed(program: str, stdin_text: str, expected: str, timeout_s: float,
                   memory_mb: int, scratch_root: str | None) -> tuple[str | None, bool]:
    """(None if the program passes this test else a short reason, whether the reason is an
    error of the grader rather than of the program)."""
    res = Sandbox(tmp_dir=scratch_root).run(program, stdin_text, timeout_s=timeout_s,
                                            memory_mb=memory_mb)
    if res.sandbox_error is not None:
        return res.sandbox_error[:MAX_ERROR_CHARS], True
    if res.timed_out:
        return f"timeout after {timeout_s:g} s", True
    if res.over_memory:
        return f"memory limit exceeded ({memory_mb} MiB, its processes together)", False
    if res.returncode < 0:
        return _SIGNAL_REASONS.get(-res.returncode, f"killed by signal {-res.returncode}"), False
    if res.returncode != 0:
        return (res.stderr_tail or f"exit code {res.returncode}"), False
    if not output_matches(res.stdout, expected):
        return "wrong answer", False
    return None, False


def _run_unsandboxed(program: str, stdin_text: str, expected: str, timeout_s: float,
                     memory_mb: int, scratch_root: str | None) -> tuple[str | None, bool]:
    """As _run_sandboxed, without isolation (reward.unsafe_no_sandbox)."""
    error = _run_one_unsafe(program, stdin_text, expected, timeout_s, memory_mb, scratch_root)
    return error, error is not None and error.startswith("timeout")


def _run_one_unsafe(program: str, stdin_text: str, expected: str, timeout_s: float,
                    memory_mb: int, scratch_root: str | None) -> str | None:
    """None if the program passes this test, else a short reason."""
    scratch = tempfile.mkdtemp(prefix="areal_code_", dir=scratch_root)
    try:
        source = os.path.join(scratch, "solution.py")
        paths = {name: os.path.join(scratch, name) for name in ("stdin", "stdout", "stderr")}
        with open(source, "w", encoding="utf-8") as f:
            f.write(program)
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin_text)
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                open(paths["stderr"], "wb") as ferr:
            proc = subprocess.Popen(
                [sys.executable, "-I", source], stdin=fin, stdout=fout, stderr=ferr,
                cwd=scratch, env=dict(CHILD_ENV), close_fds=True, start_new_session=True,
                preexec_fn=_limit_child(timeout_s, memory_mb, os.getpid()))
        try:
            returncode = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        # Always: the program may have left children behind in its group.
        _kill_group(proc.pid)
        returncode = proc.wait()
        if timed_out:
            return f"timeout after {timeout_s:g} s"
        if returncode < 0:
            reason = _SIGNAL_REASONS.get(-returncode, f"killed by signal {-returncode}")
            return reason
        if returncode != 0:
            last = _tail(paths["stderr"])
            return last if last else f"exit code {returncode}"
        with open(paths["stdout"], "rb") as f:
            got = f.read(MAX_OUTPUT_BYTES + 1)
        if not output_matches(got, expected):
            return "wrong answer"
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_tests(code: str, tests: list[dict], timeout_s: float = 5.0, memory_mb: int = 512,
              stop_on_first_failure: bool = False, scratch_root: str | None = None,
              unsafe_no_sandbox: bool = False) -> dict:
    """Run a program against stdin/stdout tests ``[{"input": str, "output": str}, ...]``.

    ``code`` is a completion or bare source; ``extract_code`` picks the program out of it.
    Limits per test: ``timeout_s`` seconds of wall clock, ``memory_mb`` MiB of address space.
    Outputs match if they agree after stripping trailing whitespace per line (and trailing blank
    lines). With ``stop_on_first_failure`` the tests after a failure are not run (error
    ``"skipped"``): the reward is 0 either way, and a program that loops forever would otherwise
    cost ``timeout_s`` per test. The parent's files for a test (unlinked: the program's source,
    stdin, stdout, stderr; unsandboxed: a scratch directory) are made in ``scratch_root``
    (default: the system's temporary directory); a caller that may be killed mid-test passes a
    directory it cleans up itself.

    Returns ``{"passed": [bool per test], "errors": [None or a short reason per test],
    "reward": 1.0 if every test passed (and there is at least one) else 0.0, "error": None, or
    "test <i>: <reason>" for the first test that could not be judged (sandbox failure, timeout;
    see the module docstring)}``. Never raises.
    """
    try:
        tests = list(tests)
    except TypeError:
        return {"passed": [], "errors": [], "reward": 0.0, "error": None}
    passed, errors = [], []
    first_error = None
    run_one = _run_unsandboxed if unsafe_no_sandbox else _run_sandboxed
    program = extract_code(code) if isinstance(code, str) else None
    for test in tests:
        grader_error = False
        if errors and stop_on_first_failure and not passed[-1]:
            error = "skipped"
        elif program is None:  # a caller's bug, not the model's: an error
            error, grader_error = f"code must be a string, got {type(code).__name__}", True
        elif (not isinstance(test, dict) or not isinstance(test.get("input"), str)
              or not isinstance(test.get("output"), str)):  # a dataset bug: an error
            error, grader_error = "malformed test: expected {'input': str, 'output': str}", True
        else:
            try:
                error, grader_error = run_one(program, test["input"], test["output"],
                                              timeout_s, memory_mb, scratch_root)
            except Exception as e:  # e.g. no disk space, too many processes
                error = f"sandbox error: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
                grader_error = True
        if grader_error and first_error is None:
            first_error = f"test {len(passed)}: {error}"[:MAX_ERROR_CHARS]
        passed.append(error is None)
        errors.append(error)
    reward = 1.0 if passed and all(passed) else 0.0
    return {"passed": passed, "errors": errors, "reward": reward, "error": first_error}
