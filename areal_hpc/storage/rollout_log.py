"""The rollout HDF5 file: every trajectory the controller accepted, durable and SWMR-readable.

Layout (flat token arrays + end offsets; vlen data is not SWMR-safe):

  /traj/<field>            one row per trajectory: prompt_id i8, sample_idx i4, reward f4,
                           finish_reason u1 (FINISH_REASONS), generator_rank i4, t_submit f8,
                           t_first_token f8, t_end f8, consumed_step i4 (the training step
                           that used it; -1 = not yet, DROPPED_STALE = dropped as too stale,
                           ROLLED_BACK, PARTIAL = a sample as far as it got when its job was
                           preempted: continued by a later row of the same prompt and sample
                           after the resume, schema 3 on; FAILED, schema 4 on),
                           prompt_end i8, output_end i8 (end offsets into the token arrays),
                           reward_error S96 (why the reward service scored 0 without computing
                           a reward, UTF-8, cut to REWARD_ERROR_BYTES; empty = no error;
                           schema 2 on, absent in schema-1 files, where it reads as empty),
                           seed i8 (the sample's per-request sampling seed,
                           rollout/seeds.py: sample_seed; a continued sample's
                           continuations draw from continuation_seed(seed, tokens so far);
                           NO_SEED = the engine's shared stream; absent in files written
                           before it, where it reads as NO_SEED)
  /tokens/prompt           int32 [sum of prompt lengths]
  /tokens/output           int32 [sum of output lengths]
  /tokens/behav_logprobs   float32, one per output token
  /tokens/versions         int32, policy version of every output token (-1: an observation's)
  /tokens/loss_mask, /turns/*, /tools/*, /traj/turns_end, /traj/tools_end: a multi-turn
                           episode's mask, turns and tool calls (optional: episode_log.py)
  attrs: config_yaml, schema_version (FORMAT names the file kind)

`traj/output_end` is appended last and is the commit marker: a reader (or a resumed writer)
trusts exactly `len(traj/output_end)` rows. The writer flushes after every batch, so a killed
job loses at most the batch being written.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

# the file's opening and its damage as errors, in h5_read.py; RolloutLogError and
# damage_is_an_error are imported from here too
from .episode_log import (DISCARD, DISCARD_CAUSES, GROUPS, MASK, ROW_ENDS, add_datasets, discard_codes,
                          episode_columns, row_episode, utf8_cut)
from .h5_read import (RolloutLogError, damage_is_an_error, first_line, open_for_reading,
                      rewrite_committed, text)

log = logging.getLogger(__name__)

FORMAT = "areal_hpc rollout log"        # attrs["format"] from schema 2 on
SCHEMA_VERSION = 5
READABLE_SCHEMAS = (1, 2, 3, 4, 5)  # 1: no reward_error; 2: no PARTIAL; 3: no FAILED; 4: no discard
# consumed_step values that are not a step: pending; dropped as too stale; appended after the
# checkpoint a resumed job continued from (never trained; the prompt issued again); a partial
# generation saved at a preemption (the samples as far as they got, finish_reason "abort" for the
# unfinished ones, reward 0 where not scored yet), continued by the resumed job; a group without a
# sampled token (its environment failed before the model's first turn), never trained, given up
NOT_CONSUMED, DROPPED_STALE, ROLLED_BACK, PARTIAL, FAILED = -1, -2, -3, -4, -5
STATUS_NAMES = {NOT_CONSUMED: "pending", DROPPED_STALE: "dropped as stale", ROLLED_BACK: "rolled back",
                PARTIAL: "partial (preempted mid-generation)", FAILED: "failed (no sampled token)"}
# (then a multi-turn episode's: cut at env.max_turns or env.max_episode_tokens, and one in flight
# at a preemption whose environment had answered its last model turn or was answering it:
# rollout/episodes.py; "abort" is one cut in the middle of a model turn)
FINISH_REASONS = ("stop", "length", "abort", "max_turns", "max_episode_tokens", "abort_env")
ABORTED = ("abort", "abort_env")         # a PARTIAL row's samples still to be continued
NO_SEED = -1                            # seed of a sample drawn from the engine's shared stream


def group_starts(rows: np.ndarray, prompt_id: np.ndarray, sample_idx: np.ndarray) -> np.ndarray:
    """Which of `rows` (ascending) begin a group. The log stores no group boundaries: the
    generator sends a group's samples in sample order and the controller appends them at once,
    so a group is consecutive rows of one prompt with sample_idx 0, 1, ...; a new one starts at
    sample_idx 0, another prompt, or a gap in the rows or in the sample indices."""
    rows = np.asarray(rows, dtype=np.int64)
    start = np.ones(len(rows), dtype=bool)
    if len(rows):
        p, s = prompt_id[rows], sample_idx[rows]
        start[1:] = (s[1:] == 0) | (p[1:] != p[:-1]) | (s[1:] != s[:-1] + 1) | (rows[1:] != rows[:-1] + 1)
    return start
REWARD_ERROR_BYTES = 96                 # fixed length: variable-length strings are not SWMR-safe
_ROW_FIELDS = {
    "prompt_id": "i8", "sample_idx": "i4", "reward": "f4", "finish_reason": "u1",
    "generator_rank": "i4", "t_submit": "f8", "t_first_token": "f8", "t_end": "f8",
    "consumed_step": "i4", "prompt_end": "i8", "reward_error": f"S{REWARD_ERROR_BYTES}",
    "seed": "i8", "turns_end": "i8", "tools_end": "i8", DISCARD: "u1",
}
# absent in older files; read as (and, when such a file is continued, filled with) these values
_OPTIONAL_FIELDS = {"reward_error": b"", "seed": NO_SEED, "turns_end": 0, "tools_end": 0, MASK: 1,
                    DISCARD: 0}
_COMMIT = "output_end"
_TOKEN_FIELDS = {"prompt": "i4", "output": "i4", "behav_logprobs": "f4", "versions": "i4",
                 MASK: "u1"}
_OFFSETS = ("prompt_end", _COMMIT, *ROW_ENDS.values())
_CHUNK_ROWS, _CHUNK_TOKENS = 1024, 65536


def _append(ds: h5py.Dataset, values: np.ndarray) -> None:
    """`values` (1-D) appended to `ds`, through h5py's low-level calls: the high-level resize and
    slice assignment cost more than the write itself, 18 of them per appended group, on trainer
    rank 0's receiving thread, beside the generators' cores (BENCHMARKS.md, bench_ab)."""
    values = np.ascontiguousarray(values, dtype=ds.dtype)
    if not len(values):
        return
    dsid = ds.id
    n = dsid.shape[0]
    dsid.set_extent((n + len(values),))
    space = dsid.get_space()
    space.select_hyperslab((n,), (len(values),))
    dsid.write(h5py.h5s.create_simple((len(values),)), space, values)


def _columns(trajs: Sequence[dict[str, Any]], consumed: int, prompt_end: int, output_end: int,
             group_ends: dict[str, int]) -> tuple[dict, dict, dict]:
    """The token arrays, the row fields (the commit marker's too) and the episode groups'
    arrays of `trajs` as the datasets store them, after `prompt_end` / `output_end` /
    `group_ends`; a ValueError naming the trajectory and the field for anything a reader would
    refuse (`_invalid`, `episode_columns`)."""
    name_of = lambda x: f"trajectory {x.get('prompt_id')}/{x.get('sample_idx')}"
    plen = np.array([len(x["prompt_tokens"]) for x in trajs], dtype=np.int64)
    olen = np.array([len(x["output_tokens"]) for x in trajs], dtype=np.int64)
    for x, n in zip(trajs, olen):
        if len(x["behav_logprobs"]) != n or len(x["versions"]) != n:
            raise ValueError(f"{name_of(x)}: behav_logprobs and versions must have one entry per "
                             f"output token ({n})")
        if x["finish_reason"] not in FINISH_REASONS:
            raise ValueError(f"{name_of(x)}: finish_reason {x['finish_reason']!r} is not one of "
                             f"{FINISH_REASONS}")
    mask, groups, counts = episode_columns(trajs, name_of)
    cat = lambda key, dt: np.concatenate([np.asarray(x[key], dtype=dt) for x in trajs])
    tokens = {"prompt": cat("prompt_tokens", np.int32), "output": cat("output_tokens", np.int32),
              "behav_logprobs": cat("behav_logprobs", np.float32), "versions": cat("versions", np.int32),
              MASK: mask}
    rows = {name: np.asarray([x[name] for x in trajs], dtype=_ROW_FIELDS[name])
            for name in ("prompt_id", "sample_idx", "reward", "generator_rank", "t_submit",
                         "t_first_token", "t_end")}
    rows.update({
        "finish_reason": np.asarray([FINISH_REASONS.index(x["finish_reason"]) for x in trajs], "u1"),
        "consumed_step": np.full(len(trajs), consumed, dtype=_ROW_FIELDS["consumed_step"]),
        "prompt_end": prompt_end + np.cumsum(plen),
        "reward_error": np.asarray([utf8_cut(x.get("reward_error"), REWARD_ERROR_BYTES) for x in trajs],
                                   dtype=_ROW_FIELDS["reward_error"]),
        "seed": np.asarray([NO_SEED if x.get("seed") is None else x["seed"] for x in trajs],
                           dtype=_ROW_FIELDS["seed"]),
        DISCARD: discard_codes(trajs, name_of),
        **{col: group_ends[g] + np.cumsum(counts[g]) for g, col in ROW_ENDS.items()},
        _COMMIT: output_end + np.cumsum(olen)})
    ends = {"prompt": np.cumsum(plen)}
    ends["output"] = ends["behav_logprobs"] = ends["versions"] = ends[MASK] = np.cumsum(olen)
    for name, values in (*rows.items(), *tokens.items()):
        bad, why = _invalid(name, values)
        if bad.any():
            k = int(np.argmax(bad))
            x = trajs[int(np.searchsorted(ends[name], k, side="right")) if name in tokens else k]
            raise ValueError(f"{name_of(x)}: {name} is {why}: {values[k].item()!r} (a rollout log "
                             "holds only what it can read back)")
    return tokens, rows, groups


class RolloutWriter:
    """Single writer (the controller). Rows are appended in batches; flush per batch."""

    def __init__(self, path: str | Path, config_yaml: str = ""):
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"rollout log already exists: {path} (choose another run name)")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._ds = None
        self.f = h5py.File(path, "w", libver="latest")
        self.f.attrs["format"] = FORMAT
        self.f.attrs["schema_version"] = SCHEMA_VERSION
        self.f.attrs["config_yaml"] = config_yaml
        traj = self.f.create_group("traj")
        for name, dt in {**_ROW_FIELDS, _COMMIT: "i8"}.items():
            traj.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(_CHUNK_ROWS,),
                                fletcher32=True)
        tok = self.f.create_group("tokens")
        for name, dt in _TOKEN_FIELDS.items():
            tok.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(_CHUNK_TOKENS,),
                               fletcher32=True)
        self.n_rows = self._prompt_end = self._output_end = 0
        self._group_ends = dict.fromkeys(GROUPS, 0)
        add_datasets(self.f, 0, self._group_ends, _CHUNK_ROWS, RolloutLogError)
        self.f.swmr_mode = True
        self.f.flush()

    @classmethod
    def reopen(cls, path: str | Path, keep_rows: int) -> RolloutWriter:
        """Continue a log after a restart from a checkpoint that saw `keep_rows` rows.

        A torn append (a crash between the data and the commit marker) is cut off; committed
        rows after `keep_rows` stay in the file, marked ROLLED_BACK."""
        path = Path(path)
        self = cls.__new__(cls)
        self.path, self._ds = path, None
        with damage_is_an_error(path):
            try:
                self.f = h5py.File(path, "a", libver="latest")
            except OSError as exc:  # the writer was killed: its SWMR-write flag is still set
                if "consistency flags" not in str(exc):
                    raise
                _rewrite_committed(path)
                self.f = h5py.File(path, "a", libver="latest")
        try:
            with damage_is_an_error(path):
                self._continue(keep_rows)
        except BaseException:
            self.f.close()
            raise
        return self

    def _continue(self, keep_rows: int) -> None:
        path, t, tok = self.path, self.f["traj"], self.f["tokens"]
        n = t[_COMMIT].shape[0]
        if n < keep_rows:
            raise RolloutLogError(f"{path}: {n} committed rows, but the checkpoint saw {keep_rows}")
        for name, empty in _OPTIONAL_FIELDS.items():     # a file from before the field: its rows
            if name not in t and name in _ROW_FIELDS:   # read as they did, new ones have it
                t.create_dataset(name, data=np.full(n, empty, dtype=_ROW_FIELDS[name]),
                                 maxshape=(None,), chunks=(_CHUNK_ROWS,), fletcher32=True)
        for name in _ROW_FIELDS:
            if name in t and t[name].shape[0] != n:
                if t[name].shape[0] < n:
                    raise RolloutLogError(f"{path}: damaged rollout log (/traj/{name} has "
                                          f"{t[name].shape[0]} rows, /traj/{_COMMIT} {n})")
                t[name].resize((n,))
        self._prompt_end = int(t["prompt_end"][n - 1]) if n else 0
        self._output_end = int(t[_COMMIT][n - 1]) if n else 0
        self._group_ends = {g: int(t[c][n - 1]) if n else 0 for g, c in ROW_ENDS.items()}
        add_datasets(self.f, self._output_end, self._group_ends, _CHUNK_ROWS,
                     lambda e: RolloutLogError(f"{path}: {e}"))
        for name, ds in tok.items():
            end = self._prompt_end if name == "prompt" else self._output_end
            if not 0 <= end <= ds.shape[0]:
                raise RolloutLogError(f"{path}: damaged rollout log (/tokens/{name} has "
                                      f"{ds.shape[0]} entries, the offsets need {end})")
            ds.resize((end,))
        if n > keep_rows:
            t["consumed_step"][keep_rows:n] = ROLLED_BACK
        self.f.attrs["schema_version"] = SCHEMA_VERSION     # rows appended now may be PARTIAL, FAILED
        self.f.swmr_mode = True
        self.f.flush()
        self.n_rows = n

    def append(self, trajs: Sequence[dict[str, Any]], consumed: int = NOT_CONSUMED) -> list[int]:
        """Append trajectories (the dicts of docs/architecture.md#data-contract; `reward_error`
        is optional) as pending rows, or PARTIAL ones; returns their row indices.

        The log holds only what RolloutReader reads back. A reward that float32 cannot hold
        (inf, nan, 1e300, not a number) is that sample's failure, as a failed reward call is:
        stored as 0 with the reason in `reward_error`, and so set in the trajectory's dict too
        (the trainer uses the same dicts). Any other value the reader would refuse is a
        ValueError naming the trajectory and the field, before any of the batch is written."""
        if not trajs:
            return []
        for x in trajs:
            self._storable_reward(x)
        tokens, rows, groups = _columns(trajs, consumed, self._prompt_end, self._output_end,
                                        self._group_ends)
        t, tok = self._datasets()
        for name, values in tokens.items():
            _append(tok[name], values)
        for grp, arrays in groups.items():
            for name, values in arrays.items():
                _append(self.f[grp][name], values)
        for name in _ROW_FIELDS:
            _append(t[name], rows[name])
        _append(t[_COMMIT], rows[_COMMIT])      # commit marker: last
        self._prompt_end, self._output_end = int(rows["prompt_end"][-1]), int(rows[_COMMIT][-1])
        self._group_ends = {g: int(rows[c][-1]) for g, c in ROW_ENDS.items()}
        first = self.n_rows
        self.n_rows += len(trajs)
        self.f.flush()
        return list(range(first, self.n_rows))

    def _storable_reward(self, x: dict[str, Any]) -> None:
        r = x["reward"]
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                ok = isinstance(r, (int, float, np.number, np.bool_)) and bool(np.isfinite(np.float32(r)))
        except (OverflowError, TypeError, ValueError):
            ok = False
        if not ok:
            why = f"reward {str(r)[:24]} is not a finite float32 (stored as 0)"
            log.warning("%s: trajectory %s/%s: %s", self.path, x.get("prompt_id"),
                        x.get("sample_idx"), why)
            x["reward"], x["reward_error"] = 0.0, why

    def _datasets(self) -> tuple[dict[str, h5py.Dataset], dict[str, h5py.Dataset]]:
        """The row datasets (the commit marker's too) and the token datasets by name, looked up
        once: an h5py lookup by name costs about as much as the write that `append` makes."""
        if self._ds is None:
            t, tok = self.f["traj"], self.f["tokens"]
            self._ds = ({n: t[n] for n in (*_ROW_FIELDS, _COMMIT)},
                        {n: tok[n] for n in _TOKEN_FIELDS})
        return self._ds

    def column(self, name: str) -> np.ndarray:
        """One per-row field over the rows written so far."""
        return self.f["traj"][name][: self.n_rows]

    def read(self, i: int) -> dict[str, Any]:
        """Row i as `RolloutReader` reads it (checked), from this writer's own open file."""
        return RolloutReader.of_open_file(self.f, self.path)[i]

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
    """`h5_read.rewrite_committed`: each dataset cut to the committed rows' entries."""
    def keep(src, grp: str, name: str) -> int:
        n = src["traj"][_COMMIT].shape[0]
        col = ("prompt_end" if name == "prompt" else _COMMIT) if grp == "tokens" else ROW_ENDS.get(grp)
        return n if col is None else int(src["traj"][col][n - 1]) if n and col in src["traj"] else 0
    rewrite_committed(path, keep)


_LOGPROB_SLACK = 1e-3       # a log-probability above this is not one (rounding aside)


def _invalid(name: str, v: np.ndarray) -> tuple[np.ndarray, str]:
    """Which values of a row field or token array a rollout log cannot hold, and why not."""
    if v.dtype.kind == "f" and name != "behav_logprobs":
        return ~np.isfinite(v), "not a finite number"
    if name == "behav_logprobs":
        with np.errstate(invalid="ignore"):
            return ~(np.isfinite(v) & (v <= _LOGPROB_SLACK)), "not a log-probability"
    if name == "finish_reason":
        return v >= len(FINISH_REASONS), "an unknown finish_reason code"
    if name == "consumed_step":
        return v < min(STATUS_NAMES), "not a training step"
    if name in _OFFSETS:
        return v < np.concatenate([[0], v[:-1]]), "an offset that goes backwards"
    if name == "seed":
        return v < NO_SEED, "not a seed"
    if name == "versions":          # -1: an observation token's (episode_log.py)
        return v < -1, "negative"
    if name == MASK:
        return v > 1, "not 0 or 1"
    if name == DISCARD:
        return v >= len(DISCARD_CAUSES), "an unknown discard cause"
    if v.dtype.kind in "iu":        # ids, ranks, token ids, policy versions
        return v < 0, "negative"
    return np.zeros(v.shape, dtype=bool), ""


class RolloutReader:
    """Reads a rollout log, also while the job is still writing it (SWMR).

    Every value that is read is checked (finite times, rewards and log-probabilities, known
    finish codes, offsets that never go backwards, token arrays as long as the offsets say):
    a damaged or hostile file is a RolloutLogError naming the file and the row.

    `skip_bad`: a row holding a value that cannot be (an inf reward an older writer stored) is
    not an error of `column` and `tokens` but recorded in `bad` (row -> field and value, the
    first found); the values come back as stored and the caller leaves those rows out
    (analysis/load.py does). Damage to the file's structure (offsets, checksums, layout) and
    a bad row asked for by index stay errors."""

    def __init__(self, path: str | Path, skip_bad: bool = False):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rollout log at {path}")
        self.path, self.skip_bad, self.bad = path, skip_bad, {}
        self.f = open_for_reading(path)
        try:
            with damage_is_an_error(path):
                self._check_layout()
        except BaseException:
            self.f.close()
            raise

    @classmethod
    def of_open_file(cls, f: h5py.File, path: Path) -> RolloutReader:
        """A reader over a file this process already has open (a writer reading its own rows)."""
        self = cls.__new__(cls)
        self.path, self.f, self.skip_bad, self.bad = Path(path), f, False, {}
        return self

    def _check_layout(self) -> None:
        """Raise RolloutLogError unless the groups, datasets (1-D, of the writer's dtypes, as
        long as the committed rows need) and schema are a rollout log's."""
        f, path = self.f, self.path
        fmt = f.attrs.get("format")
        if fmt is not None and text(fmt) != FORMAT:
            raise RolloutLogError(f"{path}: not a rollout log (format {text(fmt)!r})")
        schema = f.attrs.get("schema_version")
        if schema is None:
            raise RolloutLogError(f"{path}: not a rollout log (HDF5, but no schema_version "
                                  "attribute: another program's file?)")
        if not isinstance(schema, (int, np.integer)) or int(schema) not in READABLE_SCHEMAS:
            shown = int(schema) if isinstance(schema, (int, np.integer)) else repr(schema)
            raise RolloutLogError(f"{path}: not a rollout log this code can read (schema_version "
                                  f"{shown}, readable: {READABLE_SCHEMAS})")
        if not isinstance(f.attrs.get("config_yaml", ""), (str, bytes)):
            raise RolloutLogError(f"{path}: damaged rollout log (config_yaml is not text)")
        dtypes = {"traj": {**_ROW_FIELDS, _COMMIT: "i8"}, "tokens": _TOKEN_FIELDS, **GROUPS}
        for grp, fields in dtypes.items():
            if grp in GROUPS and grp not in f:          # a log from before episodes
                continue
            if not isinstance(f.get(grp), h5py.Group):
                raise RolloutLogError(f"{path}: not a rollout log, or a damaged one "
                                      f"(no group /{grp})")
            present = set(f[grp].keys())
            for name, dt in fields.items():
                if name in _OPTIONAL_FIELDS and name not in present:
                    continue
                if name not in present:
                    raise RolloutLogError(f"{path}: not a rollout log (no dataset /{grp}/{name})")
                ds = f[grp][name]
                if not isinstance(ds, h5py.Dataset) or len(ds.shape) != 1 \
                        or ds.dtype != np.dtype(dt):
                    what = (f"{ds.dtype} {ds.shape}" if isinstance(ds, h5py.Dataset)
                            else type(ds).__name__)
                    raise RolloutLogError(f"{path}: damaged rollout log (/{grp}/{name} is {what},"
                                          f" not a 1-D {np.dtype(dt)} dataset)")
        # A live writer (SWMR) grows every dataset before the commit marker: read the marker
        # first, then each dataset afresh (the shapes read above may predate the writer's last
        # flush), so a reader opened mid-append never sees fewer rows than committed.
        commit = f["traj"][_COMMIT]
        commit.refresh()
        n = commit.shape[0]
        for name, ds in f["traj"].items():
            if name not in dtypes["traj"]:
                continue
            ds.refresh()
            if ds.shape[0] < n:
                raise RolloutLogError(f"{path}: damaged rollout log (/traj/{name} has "
                                      f"{ds.shape[0]} rows, /traj/{_COMMIT} {n})")
        if n:
            for name, ds in f["tokens"].items():
                ds.refresh()
                ends = "prompt_end" if name == "prompt" else _COMMIT
                with damage_is_an_error(path, f"/traj/{ends} row {n - 1}"):
                    end = f["traj"][ends][n - 1]
                if ds.shape[0] < end:
                    raise RolloutLogError(f"{path}: damaged rollout log (/tokens/{name} has "
                                          f"{ds.shape[0]} entries, the offsets need {end})")

    def check(self, name: str, values: np.ndarray, ends: np.ndarray | None = None,
              first: int = 0, row: int | None = None) -> np.ndarray:
        """`values` of a field (row first + k is values[k]), of a token array (`ends`: the end
        offsets of its rows, from row `first` on) or of one `row`, unless one cannot be: then a
        RolloutLogError naming the file, the row and the field, or with `skip_bad` (not for one
        row, nor for offsets) the rows recorded in `bad`."""
        bad, why = _invalid(name, values)
        if not bad.any():
            return values
        at = np.flatnonzero(bad)
        rows = (np.full(len(at), row) if row is not None else
                first + (np.searchsorted(ends, at, side="right") if ends is not None else at))
        if self.skip_bad and row is None and name not in ("prompt_end", _COMMIT):
            rows, k = np.unique(rows, return_index=True)
            for r, j in zip(rows.tolist(), at[k].tolist()):
                self.bad.setdefault(r, f"{name} is {why}: {values[j].item()!r}")
            return values
        value = values[at[0]].item() if isinstance(values[at[0]], np.generic) else values[at[0]]
        hint = "" if name in ("prompt_end", _COMMIT) else (
            "; skip_bad=True (analyze_rollouts.py --skip-bad-rows) reads the other rows")
        raise RolloutLogError(f"{self.path}: damaged rollout log (row {int(rows[0])}: {name} is "
                              f"{why}: {value!r}{hint})")

    @property
    def config_yaml(self) -> str:
        with damage_is_an_error(self.path, "config_yaml"):
            return text(self.f.attrs["config_yaml"])

    def __len__(self) -> int:
        with damage_is_an_error(self.path):
            ds = self.f["traj"][_COMMIT]
            ds.refresh()
            return ds.shape[0]

    def refresh(self) -> None:
        with damage_is_an_error(self.path):
            for grp in ("traj", "tokens"):
                for ds in self.f[grp].values():
                    ds.refresh()

    def column(self, name: str) -> np.ndarray:
        """One per-row field over all committed rows (`reward_error`: bytes, b"" = none),
        checked (see the class)."""
        n = len(self)
        with damage_is_an_error(self.path, f"/traj/{name}"):
            if name in _OPTIONAL_FIELDS and name not in self.f["traj"]:
                return np.full(n, _OPTIONAL_FIELDS[name], dtype=_ROW_FIELDS[name])
            ds = self.f["traj"][name]
            ds.refresh()
            values = self._read(ds, n)
        if len(values) < n:
            raise RolloutLogError(f"{self.path}: damaged rollout log (/traj/{name} has "
                                  f"{len(values)} rows, /traj/{_COMMIT} {n})")
        return self.check(name, values)

    def tokens(self, name: str) -> np.ndarray:
        """One flat token array ("prompt", "output", "behav_logprobs", "versions") over all
        committed rows, [sum of lengths]; row i is [end[i-1]:end[i]] with end = column
        "prompt_end" (prompt) or "output_end" (the others). Checked (see the class)."""
        ends = self.column("prompt_end" if name == "prompt" else _COMMIT)
        with damage_is_an_error(self.path, f"/tokens/{name}"):
            end = int(ends[-1]) if len(ends) else 0
            if name == MASK and MASK not in self.f["tokens"]:
                return np.ones(end, np.uint8)   # a log from before episodes: all sampled
            ds = self.f["tokens"][name]
            ds.refresh()
            if ds.shape[0] < end:
                raise RolloutLogError(f"{self.path}: damaged rollout log (/tokens/{name} has "
                                      f"{ds.shape[0]} entries, the offsets need {end})")
            values = self._read(ds, end, lambda k: int(np.searchsorted(ends, k, side="right")))
        return self.check(name, values, ends)

    def _read(self, ds, n: int, row_of=None) -> np.ndarray:
        """ds[:n]; where a chunk is damaged (its Fletcher-32 checksum fails, or HDF5 cannot
        read it), a RolloutLogError that names the file, the dataset and the rows in that chunk
        (`row_of`: a token entry's row)."""
        try:
            return ds[:n]
        except OSError as whole:
            first = first_line(whole)
        step = ds.chunks[0] if ds.chunks else max(n, 1)
        for a in range(0, n, step):
            try:
                ds[a:min(a + step, n)]
            except OSError as e:
                rows = (a, min(a + step, n) - 1)
                if row_of is not None:
                    rows = (row_of(rows[0]), row_of(rows[1]))
                raise RolloutLogError(
                    f"{self.path}: damaged rollout log ({ds.name} rows {rows[0]}-{rows[1]}: "
                    f"{first_line(e)})") from None
        raise RolloutLogError(f"{self.path}: damaged rollout log ({ds.name}: {first})")

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range ({n} rows)")
        self.refresh()
        with damage_is_an_error(self.path, f"row {i}"):
            t, tok = self.f["traj"], self.f["tokens"]
        lo = max(i - 1, 0)
        with damage_is_an_error(self.path, f"/traj/prompt_end, /traj/{_COMMIT} row {i}"):
            pe, oe = t["prompt_end"][lo:i + 1], t[_COMMIT][lo:i + 1]
        row = {}
        for name in _ROW_FIELDS:
            if name not in ("prompt_end", *ROW_ENDS.values()) and name in t:
                with damage_is_an_error(self.path, f"/traj/{name} row {i}"):
                    row[name] = t[name][i]
        p0, p1 = (int(pe[0]), int(pe[-1])) if i else (0, int(pe[-1]))
        o0, o1 = (int(oe[0]), int(oe[-1])) if i else (0, int(oe[-1]))
        if not (0 <= p0 <= p1 and 0 <= o0 <= o1):
            raise RolloutLogError(f"{self.path}: damaged rollout log (row {i}: its token offsets "
                                  f"[{p0}, {p1}) / [{o0}, {o1}) go backwards)")
        for name, value in row.items():
            self.check(name, np.asarray([value]), row=i)
            row[name] = value.item()
        row["finish_reason"] = FINISH_REASONS[row["finish_reason"]]
        row["reward_error"] = row.get("reward_error", b"").decode("utf-8", "replace")
        row.setdefault("seed", NO_SEED)
        arrays = {}
        for key, name, a, b in (("prompt_tokens", "prompt", p0, p1), ("output_tokens", "output", o0, o1),
                                ("behav_logprobs", "behav_logprobs", o0, o1),
                                ("versions", "versions", o0, o1)):
            with damage_is_an_error(self.path, f"/tokens/{name} row {i}"):
                arrays[key] = (name, tok[name][a:b])
        for key, (name, values) in arrays.items():
            want = p1 - p0 if name == "prompt" else o1 - o0
            if len(values) != want:
                raise RolloutLogError(f"{self.path}: damaged rollout log (row {i}: {len(values)} "
                                      f"{key}, its offsets say {want})")
            row[key] = self.check(name, values, row=i)
        with damage_is_an_error(self.path, f"row {i}'s loss mask, turns or tool calls"):
            row.update(row_episode(self.f, i, o1 - o0, o0, o1))
        self.check(MASK, row[MASK], row=i)
        return row

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
