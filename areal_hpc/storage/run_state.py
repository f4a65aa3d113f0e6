"""The run state of a checkpoint (state.h5): step, the optimizer layout, the LR scheduler, every
trainer rank's RNG states, the config, and the controller's state (`ControllerState`: data
cursor, staleness counters, the rollout-log rows of accepted-but-unconsumed groups, the prompts in
flight with the partial rows to continue them from, how many rollout-log rows existed).

Scalars are HDF5 attributes and arrays datasets, never serialized Python objects: a checkpoint
must not be able to run code on load. Every value is checked when it is read (types, ranges, the
controller state's invariants), so a damaged or crafted state.h5 is a `CheckpointError` naming
the file and what is wrong, and `find_latest` (checkpoint.py) passes over its checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .rollout_log import PARTIAL as PARTIAL_ROW

FORMAT = "areal_hpc checkpoint"
# How the optimizer shards are laid out (state.h5 attribute `optimizer_format`). PLAIN: Megatron's
# model-space optimizer state (per-parameter tensors). DISTRIBUTED: the distributed optimizer's
# "dp_reshardable" bucket-space state (reshards over DP only, not over TP x PP).
PLAIN = "plain"
DISTRIBUTED = "distributed/dp_reshardable"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message says which and why."""


def is_int(v) -> bool:
    """An integer as JSON or HDF5 attributes hold one (bool, an int subclass, is not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def no_constant(name: str):
    """`json.loads(parse_constant=...)`: NaN and Infinity are refused, never read as numbers."""
    raise ValueError(f"{name} is not a number here")


# ---------------------------------------------------------------------------- RNG states

# RNG states are stored as plain arrays and numbers (group rng/trainer_rank_<r> of state.h5),
# never as serialized Python objects: a checkpoint file must not be able to run code on load.
# Checkpoints written before this stored each rank's states as one opaque byte blob (a Python
# pickle); those blobs are never decoded: such a checkpoint resumes without its RNG states
# (warning), since everything else in it is still good.
_MT_WORDS = 624                 # Mersenne Twister state (python `random`, numpy legacy)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU and, where present, CUDA) as arrays
    and numbers (what `write_state` stores)."""
    import torch
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"python_version": int(version), "python_state": np.asarray(internal, np.int64),
             "python_gauss": float("nan") if gauss is None else float(gauss),
             "python_has_gauss": gauss is not None,
             "numpy_keys": np.asarray(keys, np.uint32), "numpy_pos": int(pos),
             "numpy_has_gauss": int(has_gauss), "numpy_gauss": float(cached),
             "torch": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available():
        state["cuda"] = np.stack([t.numpy() for t in torch.cuda.get_rng_state_all()])
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (as `read_state` checked it)."""
    import torch
    gauss = state["python_gauss"] if state["python_has_gauss"] else None
    random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"]), gauss))
    np.random.set_state(("MT19937", state["numpy_keys"], state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    cpu = torch.get_rng_state()
    if state["torch"].shape != tuple(cpu.shape):
        raise CheckpointError(f"torch RNG state of {state['torch'].shape[0]} bytes, this torch "
                              f"uses {cpu.shape[0]}")
    torch.set_rng_state(torch.from_numpy(state["torch"].copy()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(r.copy()) for r in state["cuda"]])


def _write_rng(g: h5py.Group, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            g.create_dataset(key, data=value)
        else:
            g.attrs[key] = value


def _read_rng(where: str, g) -> dict[str, Any] | None:
    """One rank's RNG states, checked; None for an old checkpoint's opaque blob (not decoded)."""
    if isinstance(g, h5py.Dataset):
        return None
    if not isinstance(g, h5py.Group):
        raise CheckpointError(f"{where}: not an RNG state")

    def array(key, dtype, shape):
        ds = g.get(key)
        if not isinstance(ds, h5py.Dataset) or ds.dtype != np.dtype(dtype) \
                or len(ds.shape) != len(shape) \
                or any(w is not None and w != n for w, n in zip(shape, ds.shape)):
            raise CheckpointError(f"{where}/{key}: not a {dtype} array of shape {shape}")
        return ds[()]

    def number(key, kind, lo=None, hi=None):
        v = g.attrs.get(key)
        if isinstance(v, np.generic):
            v = v.item()
        ok = (isinstance(v, bool) if kind is bool else
              is_int(v) if kind is int else
              isinstance(v, float) and (math.isfinite(v) or key == "python_gauss"))
        if not ok or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise CheckpointError(f"{where}: {key} = {v!r} is not a valid {kind.__name__}")
        return v

    out = {"python_version": number("python_version", int, 3, 3),
           "python_state": array("python_state", "i8", (_MT_WORDS + 1,)),
           "python_has_gauss": number("python_has_gauss", bool),
           "python_gauss": number("python_gauss", float),
           "numpy_keys": array("numpy_keys", "u4", (_MT_WORDS,)),
           "numpy_pos": number("numpy_pos", int, 0, _MT_WORDS),
           "numpy_has_gauss": number("numpy_has_gauss", int, 0, 1),
           "numpy_gauss": number("numpy_gauss", float),
           "torch": array("torch", "u1", (None,))}
    words = out["python_state"]
    if (words[:-1] < 0).any() or (words[:-1] >= 1 << 32).any() \
            or not 0 <= words[-1] <= _MT_WORDS:
        raise CheckpointError(f"{where}/python_state: not a Mersenne Twister state")
    if out["python_has_gauss"] and not math.isfinite(out["python_gauss"]):
        raise CheckpointError(f"{where}: python_gauss is not a finite number")
    if "cuda" in g:
        out["cuda"] = array("cuda", "u1", (None, None))
    return out


# ---------------------------------------------------------------------------- controller state

def _ints(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True, eq=False)
class ControllerState:
    """What a resumed controller needs: the ledger writes it (`Ledger.to_state`) and reads it
    back (`Ledger.restore`); state.h5 stores it (`save`, `load`, which checks it); the audit
    and tools/inspect_checkpoint.py read it. Arrays are 1-D int64."""
    version: int                    # the policy version (= training steps done)
    cursor_consumed: int            # prompts the data cursor has handed out
    accepted: int                   # staleness counters of the η budget
    rejected: int
    dropped_stale: int
    generated_tokens: int
    rollout_rows: int               # rows of the rollout log (later ones are rolled back)
    buffer_rows: np.ndarray         # the log rows of the buffered groups, group after group
    buffer_group_ends: np.ndarray   # where each buffered group ends in buffer_rows
    inflight_prompt_ids: np.ndarray     # prompts in flight (issued again first on resume) ...
    inflight_dataset_index: np.ndarray  # ... and their rows in the dataset
    # the PARTIAL groups to continue: prompt, first log row, rows (empty before partial rows)
    partial_prompt_ids: np.ndarray = dataclasses.field(default_factory=_ints)
    partial_first_row: np.ndarray = dataclasses.field(default_factory=_ints)
    partial_rows: np.ndarray = dataclasses.field(default_factory=_ints)
    lost_stale: int | None = None   # prompts given up as stale; None in older checkpoints

    COUNTS = ("version", "cursor_consumed", "accepted", "rejected", "dropped_stale",
              "generated_tokens", "rollout_rows")
    ARRAYS = ("buffer_rows", "buffer_group_ends", "inflight_prompt_ids", "inflight_dataset_index")
    PARTIAL = ("partial_prompt_ids", "partial_first_row", "partial_rows")

    def groups(self) -> list[np.ndarray]:
        """The buffered groups' log rows, one array per group."""
        ends = [0, *self.buffer_group_ends.tolist()]
        return [self.buffer_rows[a:b] for a, b in zip(ends[:-1], ends[1:])]

    def replace(self, **changes) -> ControllerState:
        return dataclasses.replace(self, **changes)

    def as_lists(self) -> dict[str, Any]:
        """Every field as plain Python values (arrays as lists): for comparing two states."""
        return {f.name: (v.tolist() if isinstance(v, np.ndarray) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    def save(self, g: h5py.Group) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                g.create_dataset(f.name, data=_ints(v))
            elif v is not None:
                g.attrs[f.name] = int(v)

    @classmethod
    def load(cls, where: str, g: h5py.Group) -> ControllerState:
        """Read and check: counters are non-negative ints, the buffered rows are rows of the log
        (< rollout_rows) cut into groups by non-decreasing ends that add up, the prompts in
        flight are pairs of non-negative ids and dataset indices, the partial groups name rows
        of the log and prompts in flight."""
        out: dict[str, Any] = {}
        for key in cls.COUNTS + (("lost_stale",) if "lost_stale" in g.attrs else ()):
            v = g.attrs.get(key)
            v = v.item() if isinstance(v, np.generic) else v
            if not is_int(v) or v < 0:
                raise CheckpointError(f"{where}: controller {key} = {v!r} is not a count")
            out[key] = v
        partial = [k for k in cls.PARTIAL if k in g]
        for key in cls.ARRAYS + tuple(partial):
            ds = g.get(key)
            if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "iu" or len(ds.shape) != 1:
                raise CheckpointError(f"{where}: controller {key} is not a 1-D integer array")
            v = ds[()].astype(np.int64)
            if (v < 0).any():
                raise CheckpointError(f"{where}: controller {key} has negative entries")
            out[key] = v
        if partial and (len(partial) != 3 or len({len(out[k]) for k in cls.PARTIAL}) != 1):
            raise CheckpointError(f"{where}: controller {', '.join(cls.PARTIAL)} are not "
                                  "three arrays of one length")
        state = cls(**out)
        state.check(where)
        return state

    def check(self, where: str) -> None:
        rows, ends, n = self.buffer_rows, self.buffer_group_ends, self.rollout_rows
        if (rows >= n).any():
            raise CheckpointError(f"{where}: controller buffer_rows beyond its rollout_rows ({n})")
        if (np.diff(ends) < 0).any() or (int(ends[-1]) if len(ends) else 0) != len(rows):
            raise CheckpointError(f"{where}: controller buffer_group_ends do not cut buffer_rows "
                                  f"({len(rows)}) into groups")
        if len(self.inflight_prompt_ids) != len(self.inflight_dataset_index):
            raise CheckpointError(f"{where}: controller inflight_prompt_ids and "
                                  f"inflight_dataset_index differ in length")
        first, k = self.partial_first_row, self.partial_rows
        if (k < 1).any() or (first + k > n).any() \
                or not np.isin(self.partial_prompt_ids, self.inflight_prompt_ids).all():
            raise CheckpointError(f"{where}: controller partial groups name rows beyond its "
                                  f"rollout_rows ({n}) or prompts not in flight")

    def check_partial(self, where, log) -> int:
        """The partial groups against the rollout log they name (`log`: its writer or reader,
        anything with `column(name)`): each names rows of its own prompt, sample_idx 0.., all
        PARTIAL, and a prompt in flight. Returns the output tokens they hold; a CheckpointError
        naming `where` and the prompt otherwise. (`check` needs no log: it runs on load.)"""
        in_flight = set(self.inflight_prompt_ids.tolist())
        partial = dict(zip(self.partial_prompt_ids.tolist(),
                           zip(self.partial_first_row.tolist(), self.partial_rows.tolist())))
        pid, sidx, status, ends = (log.column(k) for k in (
            "prompt_id", "sample_idx", "consumed_step", "output_end"))
        tokens = 0
        for p, (first, n) in sorted(partial.items()):
            rows = np.arange(first, first + n)
            if p not in in_flight or n < 1 or rows[-1] >= len(pid) or (pid[rows] != p).any() \
                    or (sidx[rows] != np.arange(n)).any() or (status[rows] != PARTIAL_ROW).any():
                raise CheckpointError(f"{where}: the checkpoint's partial group of prompt {p} "
                                      f"(rows {first}-{first + n - 1}) is not that prompt's "
                                      f"PARTIAL rows in the log, or the prompt is not in flight")
            tokens += int(ends[rows[-1]]) - (int(ends[first - 1]) if first else 0)
        return tokens


# ---------------------------------------------------------------------------- state.h5

def write_state(path: Path, *, step: int, config_yaml: str, scheduler: dict | None,
                rng: list[dict], controller: ControllerState | None, optimizer_format: str = PLAIN,
                optimizer_state: bool = True) -> None:
    """state.h5: scalars as attributes, arrays as datasets (see the module docstring).
    `rng`: every trainer rank's `rng_state()`.
    `optimizer_format`: PLAIN or DISTRIBUTED (how the optimizer shards are laid out);
    `optimizer_state`: False when the optimizer had no state yet (saved before its first step:
    only the model shards were written)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["step"] = step
        f.attrs["optimizer_format"] = optimizer_format
        f.attrs["optimizer_state"] = bool(optimizer_state)
        f.attrs["created"] = time.time()
        f.attrs["config_yaml"] = config_yaml
        f.attrs["scheduler_json"] = json.dumps(scheduler) if scheduler is not None else ""
        g = f.create_group("rng")
        for rank, state in enumerate(rng):
            _write_rng(g.create_group(f"trainer_rank_{rank}"), state)
        if controller is not None:
            controller.save(f.create_group("controller"))
        f.flush()
        os.fsync(f.id.get_vfd_handle())


def read_state(path: Path) -> dict[str, Any]:
    """What `write_state` wrote: step, config_yaml, scheduler, rng (list: one dict per trainer
    rank; None for a rank whose states an older version stored as a pickle, which is never
    decoded), controller (ControllerState|None), optimizer_format and optimizer_state (None in checkpoints
    older than these attributes). Every value is checked (types, ranges); a state.h5 that is
    damaged or not of this schema is a CheckpointError naming the file and what is wrong."""
    try:
        with h5py.File(path, "r") as f:
            return _read_state(path, f)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{path}: unreadable run state ({first})") from None


def _attr(f, key, kinds, where, optional=False):
    v = f.attrs.get(key)
    if v is None and optional:
        return None
    v = v.item() if isinstance(v, np.generic) else v
    v = v.decode("utf-8") if isinstance(v, bytes) else v
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise CheckpointError(f"{where}: attribute {key} = {str(v)[:80]!r} is not "
                              f"{' or '.join(k.__name__ for k in kinds)}")
    return v


def _read_state(path: Path, f: h5py.File) -> dict[str, Any]:
    fmt = _attr(f, "format", (str,), path, optional=True)
    if fmt is not None and fmt != FORMAT:
        raise CheckpointError(f"{path}: not an areal_hpc run state (format {fmt!r})")
    step = _attr(f, "step", (int,), path)
    created = _attr(f, "created", (float, int), path)
    if step < 0 or not math.isfinite(created):
        raise CheckpointError(f"{path}: step {step} / created {created} out of range")
    opt_format = _attr(f, "optimizer_format", (str,), path, optional=True)
    if opt_format is not None and opt_format not in (PLAIN, DISTRIBUTED):
        raise CheckpointError(f"{path}: unknown optimizer_format {opt_format!r}")
    opt_state = _attr(f, "optimizer_state", (bool,), path, optional=True)
    sched = _attr(f, "scheduler_json", (str,), path)
    try:
        scheduler = json.loads(sched, parse_constant=no_constant) if sched else None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: scheduler_json is not JSON ({exc})") from None
    if scheduler is not None and not isinstance(scheduler, dict):
        raise CheckpointError(f"{path}: scheduler_json is not a JSON object")
    g = f.get("rng")
    if not isinstance(g, h5py.Group):
        raise CheckpointError(f"{path}: no rng group")
    ranks = {}
    for key in g:
        prefix, _, num = key.rpartition("_")
        if prefix != "trainer_rank" or not num.isdigit():
            raise CheckpointError(f"{path}: unexpected /rng/{key}")
        ranks[int(num)] = key
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: RNG states of trainer ranks {sorted(ranks)}")
    out = {"step": step, "created": float(created), "optimizer_format": opt_format,
           "optimizer_state": opt_state,
           "config_yaml": _attr(f, "config_yaml", (str,), path),
           "scheduler": scheduler,
           "rng": [_read_rng(f"{path}:/rng/{ranks[r]}", g[ranks[r]]) for r in sorted(ranks)],
           "controller": None}
    if "controller" in f:
        if not isinstance(f["controller"], h5py.Group):
            raise CheckpointError(f"{path}: /controller is not a group")
        out["controller"] = ControllerState.load(str(path), f["controller"])
    return out
