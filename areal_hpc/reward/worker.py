"""A reward worker process (reward/pool.py starts them): ``python -m areal_hpc.reward.worker
CALL_FD RESULT_FD CONFIG_JSON``.

It reads calls from CALL_FD (frames the parent wrote: an 8-byte length, then a pickle of
``(call id, kind, completion, reference, row)``; the parent is the trusted side) and answers each
with one line of JSON on RESULT_FD: ``{"id", "reward", "error", "extras"}``. The first line says
``{"ready": true}`` once the reward code (and the user's functions) are imported. Nothing it
sends is unpickled by the parent: user code running here can write anything to RESULT_FD, and
the parent reads it as JSON and checks every value again (pool._plain_result). Its stdout and
stderr are a pipe the parent reads, at most ``WORKER_OUTPUT_BYTES`` forwarded; stdin is
/dev/null.
"""
from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys

from areal_hpc.reaper import become_subreaper, kill_descendants
from areal_hpc.reward import custom
from areal_hpc.reward.code import run_tests
from areal_hpc.reward.math import math_reward

MAX_ERROR_CHARS = 200
CLEANUP_ROUNDS = 50         # kill-what-is-left passes after a custom call (a re-spawning chain)


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_mb << 20
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        # Soft limit only: run_tests' children set their own (lower or higher) limit.
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def score(kind: str, completion: str, reference, cfg: dict, functions, row: dict | None
          ) -> tuple[float, str | None, dict | None]:
    """(reward, error, extras): error is None when the reward was computed (a wrong answer
    included), else why it could not be (a code test's sandbox failure or timeout, a custom
    function that raised or returned no number; reward 0.0). extras: a custom function's logged
    fields; a code sample's tests run and passed."""
    if kind == "math":
        return math_reward(completion, reference, cfg["extractor"]), None, None
    if kind == "custom":
        try:
            reward, extras = custom.score(functions, completion, reference, row)
        except Exception as e:  # the user's function: a counted error, never a dead worker
            return 0.0, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], None
        finally:
            # A process the call left behind does not outlive it. Here (pid 1 of the worker's
            # namespace, or its subreaper) every orphan is ours; passes until none is found, so
            # a chain that re-spawns itself is caught too. The pool's kill of the whole
            # namespace is the race-free bound behind this.
            for _ in range(CLEANUP_ROUNDS):
                if not kill_descendants():
                    break
        return reward, None, extras or None
    res = run_tests(completion, reference, timeout_s=cfg["code_test_timeout_s"],
                    memory_mb=cfg["code_memory_mb"], stop_on_first_failure=True,
                    scratch_root=cfg["scratch"], unsafe_no_sandbox=cfg["unsafe_no_sandbox"])
    if res["error"] is not None:
        return res["reward"], res["error"], None
    # what the sandbox judged, logged per step as reward/code_tests_run and _passed (means over
    # the step's samples): the tests a program ran (up to its first failure) and passed
    ran = sum(e != "skipped" for e in res["errors"])
    return res["reward"], None, {"code_tests_run": float(ran),
                                 "code_tests_passed": float(sum(res["passed"]))}


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _send(fd: int, message: dict) -> None:
    try:
        line = json.dumps(message)
    except (TypeError, ValueError) as e:   # a value JSON cannot hold: the call's error
        line = json.dumps({"id": message.get("id"), "reward": 0.0, "extras": None,
                           "error": f"result not plain data: {e}"[:MAX_ERROR_CHARS]})
    data = (line + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def main(argv: list[str]) -> int:
    call_fd, result_fd, cfg = int(argv[0]), int(argv[1]), json.loads(argv[2])
    functions = tuple(custom.Spec(*f) for f in cfg["functions"])
    if functions:
        become_subreaper()      # (pid 1 of a namespace already is; the fallback is not)
    _limit_memory(cfg["memory_mb"])
    math_reward("\\boxed{\\frac{1}{2}}", "0.5")  # math_verify builds its parsers on first use
    for spec in functions:  # imported before any deadline runs (checked at start-up already)
        custom.load(spec.spec)
    _send(result_fd, {"ready": True})
    while True:
        head = _read_exact(call_fd, 8)
        if head is None:
            return 0
        frame = _read_exact(call_fd, struct.unpack(">Q", head)[0])
        if frame is None:
            return 0
        call_id, kind, completion, reference, row = pickle.loads(frame)
        try:
            reward, error, extras = score(kind, completion, reference, cfg, functions, row)
            reward = float(reward)
        except Exception as e:  # a grader bug: this call's error, the worker goes on
            reward, error, extras = 0.0, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], None
        _send(result_fd, {"id": call_id, "reward": reward, "error": error, "extras": extras})
        _reap()


def _reap() -> None:
    """Reap orphans re-parented here (pid 1 of a namespace, or a subreaper): between calls
    nothing of ours waits on a child, so every exited child is a zombie to clear."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
