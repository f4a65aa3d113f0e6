"""The rollout HDF5 file: every trajectory the controller accepted, durable and SWMR-readable.

Layout (flat token arrays + end offsets; vlen data is not SWMR-safe):

  /traj/<field>            one row per trajectory: prompt_id i8, sample_idx i4, reward f4,
                           finish_reason u1 (FINISH_REASONS), generator_rank i4, t_submit f8,
                           t_first_token f8, t_end f8, consumed_step i4 (the training step
                           that used it; -1 = not yet, DROPPED_STALE = dropped as too stale),
                           prompt_end i8, output_end i8 (end offsets into the token arrays)
  /tokens/prompt           int32 [sum of prompt lengths]
  /tokens/output           int32 [sum of output lengths]
  /tokens/behav_logprobs   float32, one per output token
  /tokens/versions         int32, policy version of every output token
  attrs: config_yaml, schema_version

`traj/output_end` is appended last and is the commit marker: a reader (or a resumed writer)
trusts exactly `len(traj/output_end)` rows. The writer flushes after every batch, so a killed
job loses at most the batch being written.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

SCHEMA_VERSION = 1
NOT_CONSUMED, DROPPED_STALE = -1, -2
FINISH_REASONS = ("stop", "length", "abort")
_ROW_FIELDS = {
    "prompt_id": "i8", "sample_idx": "i4", "reward": "f4", "finish_reason": "u1",
    "generator_rank": "i4", "t_submit": "f8", "t_first_token": "f8", "t_end": "f8",
    "consumed_step": "i4", "prompt_end": "i8",
}
_COMMIT = "output_end"
_TOKEN_FIELDS = {"prompt": "i4", "output": "i4", "behav_logprobs": "f4", "versions": "i4"}
_CHUNK_ROWS, _CHUNK_TOKENS = 1024, 65536


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

    def append(self, trajs: Sequence[dict[str, Any]]) -> list[int]:
        """Append trajectories (DESIGN data contract dicts); returns their row indices."""
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


class RolloutReader:
    """Reads a rollout log, also while the job is still writing it (SWMR)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rollout log at {path}")
        self.f = h5py.File(path, "r", libver="latest", swmr=True)

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
        """One per-row field over all committed rows."""
        n = len(self)
        ds = self.f["traj"][name]
        ds.refresh()
        return ds[:n]

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range ({n} rows)")
        self.refresh()
        t, tok = self.f["traj"], self.f["tokens"]
        p0 = int(t["prompt_end"][i - 1]) if i else 0
        o0 = int(t[_COMMIT][i - 1]) if i else 0
        p1, o1 = int(t["prompt_end"][i]), int(t[_COMMIT][i])
        row = {name: t[name][i].item() for name in _ROW_FIELDS if name != "prompt_end"}
        row["finish_reason"] = FINISH_REASONS[row["finish_reason"]]
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
