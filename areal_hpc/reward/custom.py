"""User reward functions: `reward.fn` / `reward.functions` name Python functions that score a
sample, in place of the built-in math and code rewards.

A function is named ``package.module:function`` (importable where the job runs) or
``path/to/file.py:function`` (a file; a relative path is resolved against the job's working
directory, which its launcher and ranks share). Every launcher imports the functions before any
rank starts. Its signature::

    def my_reward(completion: str, reference, row: dict) -> float | dict

- ``completion``: the sample's text (special tokens removed);
- ``reference``: the row's reference (the answer string for math datasets; the list of
  stdin/stdout tests for code datasets);
- ``row``: the whole dataset row as it was read (every field of the jsonl line);
- it returns a number (``bool`` counts as 0/1), or a dict with a number under ``"reward"`` and
  other numeric fields, logged as per-step means in metrics.jsonl under ``reward/<name>``.

A function of two parameters ``(completion, reference)`` is called without the row. With several
functions (``reward.functions: [{fn: ..., weight: ...}, ...]``) the reward is the weighted sum and
each one's value is logged as ``reward/<function name>``.

Functions run in the reward pool's worker processes (reward/pool.py), under its timeout
(``reward.fn_timeout_s`` per call), crash handling and error counting: a function that raises,
returns something other than a number (or NaN / infinity), or runs past the timeout scores 0.0
for that sample with the reason in the rollout log's ``reward_error``; the job goes on. A path
that does not import, a name that is not a function, or a signature that does not take the
arguments is an error at start-up naming the key.

Model-written code must not run in the worker itself: call ``areal_hpc.reward.code.run_tests``
(the bubblewrap sandbox) from the function. Building blocks for answers:
``areal_hpc.reward.math.extract_answer(text, how)`` and ``math_reward(text, reference, how)``
with ``how`` one of ``EXTRACTORS`` (the last ``\\boxed{}``, GSM8K's ``#### N``, ``Answer: N``, the
last number).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import subprocess
import sys
import tempfile
from typing import Callable, NamedTuple

from ..config.rules import reward_functions, split_reward_spec
from ..reaper import become_subreaper, kill_descendants
from . import contain


class RewardFnError(ValueError):
    """A reward function that cannot be used (bad path, not a function, wrong signature)."""


class Spec(NamedTuple):
    spec: str           # as configured, a file path made absolute
    weight: float
    name: str           # the function's name, for the logged fields
    key: str            # the config key it came from, for errors


def split_spec(spec: str) -> tuple[str, str, bool]:
    """(module or file, function name, is_file) of ``'pkg.mod:fn'`` / ``'path/file.py:fn'``
    (its form: config/rules.py `split_reward_spec`). Raises RewardFnError."""
    try:
        return split_reward_spec(spec)
    except ValueError as exc:
        raise RewardFnError(str(exc)) from None


def resolve(spec: str, base: str | os.PathLike | None = None) -> str:
    """The spec with a relative file path made absolute against `base` (default: the cwd)."""
    where, name, is_file = split_spec(spec)
    if is_file and not os.path.isabs(where):
        where = os.path.abspath(os.path.join(base or os.getcwd(), where))
    return f"{where}:{name}"


_LOADED: dict[str, tuple[Callable, int]] = {}     # spec -> (function, its arity: 3 or 2)


def load(spec: str) -> Callable:
    """The function a spec names (imported once per process). Raises RewardFnError."""
    return _load(spec)[0]


def _load(spec: str) -> tuple[Callable, int]:
    if spec in _LOADED:
        return _LOADED[spec]
    where, name, is_file = split_spec(spec)
    mod_name = None
    try:
        if is_file:
            if not os.path.isfile(where):
                raise RewardFnError(f"{spec!r}: no such file {where!r}")
            mod_name = "areal_user_reward_" + hashlib.sha1(where.encode()).hexdigest()[:12]
            file_spec = importlib.util.spec_from_file_location(mod_name, where)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module      # pickling and dataclasses need it there
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardFnError:
        raise
    except BaseException as exc:    # a module that raises (or exits) while it is imported
        if mod_name:
            sys.modules.pop(mod_name, None)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RewardFnError(f"{spec!r}: cannot import {where!r}: {type(exc).__name__}: {first}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardFnError(f"{spec!r}: {where!r} has no {name!r}")
    if not callable(fn) or inspect.isclass(fn):
        raise RewardFnError(f"{spec!r}: {name!r} is a {type(fn).__name__}, not a function")
    _LOADED[spec] = (fn, _arity(spec, fn))
    return _LOADED[spec]


def _arity(spec: str, fn: Callable) -> int:
    """3 when fn takes (completion, reference, row), 2 for (completion, reference)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 3                    # a builtin or C function: trust it
    for n in (3, 2):
        try:
            sig.bind(*range(n))
            return n
        except TypeError:
            continue
    raise RewardFnError(f"{spec!r}: {getattr(fn, '__name__', fn)}{sig} cannot be called as "
                        f"(completion, reference, row) or (completion, reference)")


def specs_of(cfg) -> list[Spec]:
    """The configured functions (`reward.fn`, then `reward.functions`), file paths made absolute,
    of a loaded config (config/rules.py checked each one's form and weight, and that no two share
    a name)."""
    return [Spec(resolve(spec), float(weight), split_spec(spec)[1], key)
            for key, spec, weight in reward_functions(cfg)]


def check(cfg) -> list[Spec]:
    """Import every configured function before any rank starts, in a child process (`_check_in_
    child`), never in the caller's: RewardFnError names the key. Returns the specs."""
    specs = specs_of(cfg)
    if specs:
        _check_in_child(specs)
    return specs


def _check_in_child(specs: list[Spec]) -> None:
    """`python -m areal_hpc.reward.custom SPEC...` imports and checks each function, then kills
    whatever the modules started (it is their subreaper) and prints its verdict last. Bounded
    by IMPORT_TIMEOUT_S; its output goes to an unlinked file of which only the tail is read, so
    a module that prints without end or leaves a daemon holding the output stalls nothing. It
    runs as pid 1 of a PID namespace of its own where one can be made (reward/contain.py): when
    it ends, is killed at the bound, or this process dies (a SIGKILL included), everything the
    modules started dies with it, whatever they did."""
    with tempfile.TemporaryFile() as out:
        # the caller's import path, as multiprocessing's spawn hands it to the pool's workers
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(contain.wrap([sys.executable, "-m", "areal_hpc.reward.custom",
                                              *(s.spec for s in specs)]),
                                stdin=subprocess.DEVNULL, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        fd = contain.pidfd(contain.init_pid(proc))
        try:
            proc.wait(timeout=IMPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RewardFnError(f"config key '{specs[0].key}': importing the reward function(s) "
                                f"took over {IMPORT_TIMEOUT_S:g} s (a module that blocks while it "
                                "is imported?)") from None
        finally:
            contain.end(proc, fd)   # whatever is left, the namespace whole (a no-op when done)
            if fd is not None:
                os.close(fd)
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - OUTPUT_TAIL_BYTES))
        tail = out.read().decode("utf-8", "replace").splitlines()
    verdict = next((line[len(_VERDICT):] for line in reversed(tail) if line.startswith(_VERDICT)),
                   None)
    if verdict is None:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        raise RewardFnError(f"config key '{specs[0].key}': the import check ended with exit code "
                            f"{proc.returncode} and no verdict: {last[:200]}")
    found = json.loads(verdict)
    if found:
        raise RewardFnError(f"config key '{specs[found['index']].key}': {found['error']}")


_VERDICT = "areal reward check: "
IMPORT_TIMEOUT_S = 60.0         # importing the user's modules at preflight
OUTPUT_TAIL_BYTES = 4096        # of the check's output, read for its verdict


def _check_main(argv: list[str]) -> int:
    """The child of `_check_in_child`."""
    become_subreaper()
    found = {}
    for i, spec in enumerate(argv):
        try:
            load(spec)
        except RewardFnError as exc:
            found = {"index": i, "error": str(exc)}
            break
    kill_descendants()
    sys.stdout.flush()
    print(_VERDICT + json.dumps(found), flush=True)
    os._exit(0)     # now: a thread the modules left can print nothing after the verdict


MAX_ABS_VALUE = 1e6         # a reward or logged field beyond this is a bug, not a score
MAX_EXTRAS = 16             # logged fields per function call
MAX_EXTRA_NAME = 64         # characters of a logged field's name


def _number(value, what: str) -> float:
    if isinstance(value, numbers.Real):      # bool, int, float, numpy scalars
        v = float(value)
        if math.isfinite(v) and abs(v) <= MAX_ABS_VALUE:
            return v
        raise ValueError(f"{what} is {v}" + ("" if not math.isfinite(v) else
                                             f", beyond ±{MAX_ABS_VALUE:g}"))
    raise ValueError(f"{what} is a {type(value).__name__}, not a number")


def score(specs: list[Spec], completion: str, reference, row: dict | None
          ) -> tuple[float, dict[str, float]]:
    """(reward, logged extras) of one sample: the weighted sum of the functions' values.
    Raises ValueError (a bad return value) or whatever a function raises."""
    total, extras = 0.0, {}
    for spec, weight, name, _ in specs:
        fn, arity = _load(spec)
        out = fn(completion, reference, row) if arity == 3 else fn(completion, reference)
        if isinstance(out, dict):
            if "reward" not in out:
                raise ValueError(f"{name} returned a dict without 'reward' (keys: {sorted(map(str, out))})")
            value = _number(out["reward"], f"{name}()['reward']")
            if len(out) - 1 > MAX_EXTRAS:
                raise ValueError(f"{name} returned {len(out) - 1} logged fields (at most {MAX_EXTRAS})")
            for k, v in out.items():
                if not isinstance(k, str) or not 0 < len(k) <= MAX_EXTRA_NAME:
                    raise ValueError(f"{name} returned a logged field named {str(k)[:MAX_EXTRA_NAME]!r}"
                                     f"... (names: strings of 1-{MAX_EXTRA_NAME} characters)")
                if k != "reward":
                    key = str(k) if len(specs) == 1 else f"{name}.{k}"
                    extras[key] = _number(v, f"{name}()[{k!r}]")
        else:
            value = _number(out, f"{name}()")
        if len(specs) > 1:
            extras[name] = value
        total += weight * value
    return total, extras


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
