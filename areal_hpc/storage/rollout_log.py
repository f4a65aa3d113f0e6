"""The rollout HDF5 file: every trajectory the controller accepted, durable and SWMR-readable.

Layout (flat token arrays + end offsets; vlen data is not SWMR-safe):

  /traj/<field>            one row per trajectory: prompt_id i8, sample_idx i4, reward f4,
                           finish_reason u1 (FINISH_REASONS), generator_rank i4, t_submit f8,
                           t_first_token f8, t_end f8, consumed_step i4 (the training step
                           that used it; -1 = not yet, DROPPED_STALE = dropped as too stale),
                           prompt_end i8, output_end i8 (end offsets into the token arrays),
                           reward_error S96 (why the reward service scored 0 without computing
                           a reward, UTF-8, cut to REWARD_ERROR_BYTES; empty = no error;
                           schema 2 on, absent in schema-1 files, where it reads as empty)
  /tokens/prompt           int32 [sum of prompt lengths]
  /tokens/output           int32 [sum of output lengths]
  /tokens/behav_logprobs   float32, one per output token
  /tokens/versions         int32, policy version of every output token
  attrs: config_yaml, schema_version (FORMAT names the file kind)

`traj/output_end` is appended last and is the commit marker: a reader (or a resumed writer)
trusts exactly `len(traj/output_end)` rows. The writer flushes after every batch, so a killed
job loses at most the batch being written.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

FORMAT = "areal_hpc rollout log"        # attrs["format"] from schema 2 on
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)               # 1: before reward_error
# consumed_step values that are not a step: pending; dropped as too stale; appended after the
# checkpoint a resumed job continued from (its training never happened; the prompt was issued again)
NOT_CONSUMED, DROPPED_STALE, ROLLED_BACK = -1, -2, -3
FINISH_REASONS = ("stop", "length", "abort")
REWARD_ERROR_BYTES = 96                 # fixed length: variable-length strings are not SWMR-safe
_ROW_FIELDS = {
    "prompt_id": "i8", "sample_idx": "i4", "reward": "f4", "finish_reason": "u1",
    "generator_rank": "i4", "t_submit": "f8", "t_first_token": "f8", "t_end": "f8",
    "consumed_step": "i4", "prompt_end": "i8", "reward_error": f"S{REWARD_ERROR_BYTES}",
}
_OPTIONAL_FIELDS = {"reward_error"}     # absent in older schemas; read as their empty value
_COMMIT = "output_end"
_TOKEN_FIELDS = {"prompt": "i4", "output": "i4", "behav_logprobs": "f4", "versions": "i4"}
_CHUNK_ROWS, _CHUNK_TOKENS = 1024, 65536
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class RolloutLogError(ValueError):
    """The file is not a readable rollout log: not HDF5, damaged or truncated, another program's
    HDF5, or a schema this code does not know. The message names the file."""


def _error_bytes(error: str | None) -> bytes:
    """A reward error as the fixed-length column stores it: UTF-8, cut at a character boundary."""
    raw = (error or "").encode("utf-8")[:REWARD_ERROR_BYTES]
    return raw.decode("utf-8", errors="ignore").encode("utf-8")


def _append(ds: h5py.Dataset, values: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(values),))
    ds[n:] = values


class RolloutWriter:
    """Single writer (the controller). Rows are appended in batches; flush per batch."""

    def __init__(self, path: str | Path, config_yaml: str = ""):
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"rollout log already exists: {path} (choose another run name)")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.f = h5py.File(path, "w", libver="latest")
        self.f.attrs["format"] = FORMAT
        self.f.attrs["schema_version"] = SCHEMA_VERSION
        self.f.attrs["config_yaml"] = config_yaml
        traj = self.f.create_group("traj")
        for name, dt in {**_ROW_FIELDS, _COMMIT: "i8"}.items():
            traj.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(_CHUNK_ROWS,))
        tok = self.f.create_group("tokens")
        for name, dt in _TOKEN_FIELDS.items():
            tok.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(_CHUNK_TOKENS,))
        self.f.swmr_mode = True
        self.f.flush()
        self.n_rows = 0
        self._prompt_end = 0
        self._output_end = 0

    @classmethod
    def reopen(cls, path: str | Path, keep_rows: int) -> RolloutWriter:
        """Continue a log after a restart from a checkpoint that saw `keep_rows` rows.

        A torn append (a crash between the data and the commit marker) is cut off; committed
        rows after `keep_rows` stay in the file, marked ROLLED_BACK."""
        path = Path(path)
        self = cls.__new__(cls)
        self.path = path
        try:
            self.f = h5py.File(path, "a", libver="latest")
        except OSError as exc:      # the writer was killed: its SWMR-write flag is still set
            if "consistency flags" not in str(exc):
                raise
            _rewrite_committed(path)
            self.f = h5py.File(path, "a", libver="latest")
        t, tok = self.f["traj"], self.f["tokens"]
        n = t[_COMMIT].shape[0]
        if n < keep_rows:
            self.f.close()
            raise RolloutLogError(f"{path}: {n} committed rows, but the checkpoint saw {keep_rows}")
        for name in _ROW_FIELDS:
            if name in t and t[name].shape[0] != n:
                t[name].resize((n,))
        self._prompt_end = int(t["prompt_end"][n - 1]) if n else 0
        self._output_end = int(t[_COMMIT][n - 1]) if n else 0
        for name, ds in tok.items():
            ds.resize((self._prompt_end if name == "prompt" else self._output_end,))
        if n > keep_rows:
            t["consumed_step"][keep_rows:n] = ROLLED_BACK
        self.f.swmr_mode = True
        self.f.flush()
        self.n_rows = n
        return self

    def append(self, trajs: Sequence[dict[str, Any]]) -> list[int]:
        """Append trajectories (DESIGN data contract dicts, plus an optional `reward_error`
        string); returns their row indices."""
        if not trajs:
            return []
        t, tok = self.f["traj"], self.f["tokens"]
        plen = np.array([len(x["prompt_tokens"]) for x in trajs], dtype=np.int64)
        olen = np.array([len(x["output_tokens"]) for x in trajs], dtype=np.int64)
        for x, n in zip(trajs, olen):
            if len(x["behav_logprobs"]) != n or len(x["versions"]) != n:
                raise ValueError(f"trajectory {x['prompt_id']}/{x['sample_idx']}: behav_logprobs "
                                 f"and versions must have one entry per output token ({n})")
        cat = lambda key, dt: np.concatenate([np.asarray(x[key], dtype=dt) for x in trajs])
        _append(tok["prompt"], cat("prompt_tokens", np.int32))
        _append(tok["output"], cat("output_tokens", np.int32))
        _append(tok["behav_logprobs"], cat("behav_logprobs", np.float32))
        _append(tok["versions"], cat("versions", np.int32))
        rows = {
            "prompt_id": [x["prompt_id"] for x in trajs],
            "sample_idx": [x["sample_idx"] for x in trajs],
            "reward": [x["reward"] for x in trajs],
            "finish_reason": [FINISH_REASONS.index(x["finish_reason"]) for x in trajs],
            "generator_rank": [x["generator_rank"] for x in trajs],
            "t_submit": [x["t_submit"] for x in trajs],
            "t_first_token": [x["t_first_token"] for x in trajs],
            "t_end": [x["t_end"] for x in trajs],
            "consumed_step": [NOT_CONSUMED] * len(trajs),
            "prompt_end": self._prompt_end + np.cumsum(plen),
            "reward_error": [_error_bytes(x.get("reward_error")) for x in trajs],
        }
        for name, dt in _ROW_FIELDS.items():
            _append(t[name], np.asarray(rows[name], dtype=dt))
        _append(t[_COMMIT], self._output_end + np.cumsum(olen))    # commit marker: last
        self._prompt_end += int(plen.sum())
        self._output_end += int(olen.sum())
        first = self.n_rows
        self.n_rows += len(trajs)
        self.f.flush()
        return list(range(first, self.n_rows))

    def mark_consumed(self, rows: Sequence[int], step: int) -> None:
        """Record which training step consumed these rows, or DROPPED_STALE (in-place write,
        SWMR-safe)."""
        if len(rows) == 0:
            return
        idx = np.sort(np.asarray(rows, dtype=np.int64))
        ds = self.f["traj/consumed_step"]
        data = ds[idx[0]: idx[-1] + 1]
        data[idx - idx[0]] = step
        ds[idx[0]: idx[-1] + 1] = data
        self.f.flush()

    def close(self) -> None:
        if self.f.id.valid:
            self.f.flush()
            self.f.close()


def _rewrite_committed(path: Path) -> None:
    """Copy the committed rows of a log whose writer died into a fresh file that replaces it.

    HDF5 refuses to open such a file for writing until its status flags are cleared (h5clear);
    reading it in SWMR mode works, and every row up to the last flush is intact."""
    tmp = path.with_name(path.name + ".recover")
    with h5py.File(path, "r", libver="latest", swmr=True) as src, \
            h5py.File(tmp, "w", libver="latest") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        n = src["traj"][_COMMIT].shape[0]
        ends = {"prompt": int(src["traj/prompt_end"][n - 1]) if n else 0,
                "output": int(src["traj"][_COMMIT][n - 1]) if n else 0}
        for grp in ("traj", "tokens"):
            g = dst.create_group(grp)
            for name, ds in src[grp].items():
                keep = n if grp == "traj" else ends["prompt" if name == "prompt" else "output"]
                g.create_dataset(name, data=ds[:keep], maxshape=(None,), chunks=ds.chunks)
    os.replace(tmp, path)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _superblock_eof(path: Path) -> int | None:
    """End-of-file address a closed HDF5 file's superblock (at offset 0) records, or None when
    unknown or not binding: a writer still has it open, or crashed, in SWMR mode (the flags say
    so), where the address may run ahead of the bytes on disk."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if not head.startswith(_HDF5_SIGNATURE) or len(head) < 64:
        return None
    version = head[8]
    if version >= 2:                # signature, version, offset/length sizes, flags, addresses
        size, flags, start = head[9], head[11], 12
    else:                           # v0/v1: versions of sub-structures, K values, then addresses
        size, flags, start = head[13], int.from_bytes(head[20:24], "little"), 24 + 4 * version
    if flags or size not in (2, 4, 8):
        return None
    addr = lambda k: int.from_bytes(head[start + k * size: start + (k + 1) * size], "little")
    return addr(0) + addr(2)        # base address + end-of-file address


def _open_for_reading(path: Path) -> h5py.File:
    """Open for SWMR reading; a file that is not HDF5, or is cut short, is a RolloutLogError.

    HDF5 itself does not notice a truncated file opened for SWMR reading, so a closed file's
    size is checked against the end-of-file address its superblock records."""
    if not h5py.is_hdf5(path):
        raise RolloutLogError(f"{path}: not an HDF5 file")
    eof, size = _superblock_eof(path), path.stat().st_size
    if eof is not None and size < eof:
        raise RolloutLogError(f"{path}: truncated HDF5 file ({size} bytes, the file says {eof})")
    try:
        return h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as e:
        first = _text(e.args[0] if e.args else e).splitlines()[0]
        try:        # an HDF5 file not written for SWMR (older superblock): another program's
            return h5py.File(path, "r")
        except OSError:
            raise RolloutLogError(f"{path}: damaged HDF5 file ({first})") from None


class RolloutReader:
    """Reads a rollout log, also while the job is still writing it (SWMR)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rollout log at {path}")
        self.path = path
        self.f = _open_for_reading(path)
        try:
            self._check_layout()
        except BaseException:
            self.f.close()
            raise

    def _check_layout(self) -> None:
        """Raise RolloutLogError unless the groups, datasets and schema are a rollout log's."""
        f, path = self.f, self.path
        fmt = f.attrs.get("format")
        if fmt is not None and _text(fmt) != FORMAT:
            raise RolloutLogError(f"{path}: not a rollout log (format {_text(fmt)!r})")
        schema = f.attrs.get("schema_version")
        if schema is None:
            raise RolloutLogError(f"{path}: not a rollout log (HDF5, but no schema_version "
                                  "attribute: another program's file?)")
        if int(schema) not in READABLE_SCHEMAS:
            raise RolloutLogError(f"{path}: not a rollout log this code can read (schema_version "
                                  f"{schema}, readable: {READABLE_SCHEMAS})")
        rows = [n for n in (*_ROW_FIELDS, _COMMIT) if n not in _OPTIONAL_FIELDS]
        for grp, names in (("traj", rows), ("tokens", _TOKEN_FIELDS)):
            for name in names:
                if not isinstance(f.get(f"{grp}/{name}"), h5py.Dataset):
                    raise RolloutLogError(f"{path}: not a rollout log (no dataset /{grp}/{name})")

    @property
    def config_yaml(self) -> str:
        return str(self.f.attrs["config_yaml"])

    def __len__(self) -> int:
        ds = self.f["traj"][_COMMIT]
        ds.refresh()
        return ds.shape[0]

    def refresh(self) -> None:
        for grp in ("traj", "tokens"):
            for ds in self.f[grp].values():
                ds.refresh()

    def column(self, name: str) -> np.ndarray:
        """One per-row field over all committed rows (`reward_error`: bytes, b"" = none)."""
        n = len(self)
        if name in _OPTIONAL_FIELDS and name not in self.f["traj"]:
            return np.zeros(n, dtype=_ROW_FIELDS[name])
        ds = self.f["traj"][name]
        ds.refresh()
        return ds[:n]

    def tokens(self, name: str) -> np.ndarray:
        """One flat token array ("prompt", "output", "behav_logprobs", "versions") over all
        committed rows, [sum of lengths]; row i is [end[i-1]:end[i]] with end = column
        "prompt_end" (prompt) or "output_end" (the others)."""
        ends = self.column("prompt_end" if name == "prompt" else _COMMIT)
        ds = self.f["tokens"][name]
        ds.refresh()
        end = int(ends[-1]) if len(ends) else 0
        if ds.shape[0] < end:
            raise RolloutLogError(f"{self.path}: damaged rollout log (/tokens/{name} has "
                                  f"{ds.shape[0]} entries, the offsets need {end})")
        return ds[:end]

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range ({n} rows)")
        self.refresh()
        t, tok = self.f["traj"], self.f["tokens"]
        p0 = int(t["prompt_end"][i - 1]) if i else 0
        o0 = int(t[_COMMIT][i - 1]) if i else 0
        p1, o1 = int(t["prompt_end"][i]), int(t[_COMMIT][i])
        row = {name: t[name][i].item() for name in _ROW_FIELDS
               if name != "prompt_end" and name in t}
        row["finish_reason"] = FINISH_REASONS[row["finish_reason"]]
        row["reward_error"] = row.get("reward_error", b"").decode("utf-8")
        row["prompt_tokens"] = tok["prompt"][p0:p1]
        row["output_tokens"] = tok["output"][o0:o1]
        row["behav_logprobs"] = tok["behav_logprobs"][o0:o1]
        row["versions"] = tok["versions"][o0:o1]
        return row

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
