"""Reading a run directory for the audit (areal_hpc/audit/__init__.py): the files, the groups
of the log, the projection of a run past its checkpoint; the report's types."""
from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from ..config import ConfigError, RunConfig, load as load_config
from ..analysis.load import version_blocks
from ..storage import checkpoint as ck
from ..storage import run_dir as run_files
from ..storage.episode_log import mask_between
from ..storage.run_state import ControllerState
from ..storage.rollout_log import (DROPPED_STALE, FINISH_REASONS, NOT_CONSUMED, ROLLED_BACK,
                                  STATUS_NAMES, RolloutLogError, RolloutReader, group_starts)

EXIT_OK, EXIT_VIOLATED, EXIT_UNREADABLE = 0, 1, 2
EXAMPLES = 5                # offending rows / prompts named per finding
BLOCK_TOKENS = 1 << 24      # /tokens/versions is read in blocks of whole rows, this many at most


class AuditInputError(Exception):
    """An input the audit cannot read (missing, damaged, not of the expected format); the
    message is one line naming the file."""


@dataclass
class Check:
    """One guarantee: `ok` True (holds), False (violated) or None (not checkable from the files;
    `detail` says why); `detail` holds the counts and the offending rows."""

    name: str
    ok: bool | None
    detail: list[str] = field(default_factory=list)
    # the counts a program reads (tools/chaos.py): e.g. "lost" prompts, "kept_tokens" across
    # preemptions; the same numbers `detail` prints
    figures: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return {True: "ok", False: "VIOLATED", None: "not checkable"}[self.ok]


@dataclass
class Report:
    """What `audit` found: a summary of the run, one Check per guarantee, notes (files set
    aside, checkpoints skipped, warnings while reading)."""

    run_dir: Path
    summary: list[str]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No guarantee violated (not checkable ones do not count against the run)."""
        return all(c.ok is not False for c in self.checks)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_VIOLATED

    def figure(self, key: str, default: int | None = None) -> int | None:
        """A count one of the checks reported (`Check.figures`), else `default`."""
        return next((c.figures[key] for c in self.checks if key in c.figures), default)

    def text(self) -> str:
        lines = [f"audit of {self.run_dir}", *(f"  {s}" for s in self.summary)]
        for note in self.notes:
            lines.append(f"  note: {note}")
        for k, c in enumerate(self.checks, 1):
            lines.append(f"[{c.status}] {k}. {c.name}")
            lines.extend(f"      {d}" for d in c.detail)
        bad = [c for c in self.checks if c.ok is False]
        unknown = sum(c.ok is None for c in self.checks)
        tail = f" ({unknown} not checkable)" if unknown else ""
        lines.append(f"result: {len(bad)} of {len(self.checks)} guarantees violated{tail}" if bad
                     else f"result: every guarantee checked holds{tail}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ reading

@dataclass
class AuditedRun:
    """Everything the checks use, read once."""

    run_dir: Path
    cfg: RunConfig
    B: int
    n: int
    eta: int
    policy: str                 # rollout.stale_policy as the run had it
    max_reissues: int
    pid: np.ndarray             # per row of the rollout log
    sidx: np.ndarray
    consumed: np.ndarray
    out_len: np.ndarray
    reward: np.ndarray          # float32, as stored
    cut: np.ndarray             # finish_reason "length"
    discard: np.ndarray         # the episode is discarded (env.on_error), any cause
    vmin: np.ndarray            # oldest / newest sampled token version of the row (an
    vmax: np.ndarray            # observation token's -1 left out), -1 without one
    metrics: list[tuple[int, dict]] | None      # (line number, record); None: no file
    # per row, output tokens trained (loss mask 1) but not sampled (version -1), and the first
    # one's offset; tokens sampled (version >= 0) but masked out of the loss
    unsampled: np.ndarray | None = None
    first_unsampled: np.ndarray | None = None
    masked_sampled: np.ndarray | None = None
    ckpt: Path | None = None
    ck_step: int | None = None
    ctrl: ControllerState | None = None    # the checkpoint's controller state


def some(items, k: int = EXAMPLES) -> str:
    """The first k of `items`, and how many more there are."""
    it = iter(items)
    shown = ", ".join(str(x) for x in itertools.islice(it, k))
    more = sum(1 for _ in it)
    return shown + (f" (and {more} more)" if more else "")


@contextlib.contextmanager
def warnings_into(notes: list[str]):
    """Collect what areal_hpc's loggers warn about while reading (a skipped checkpoint, an
    obsolete config key) into the report instead of stderr."""
    class Into(logging.Handler):
        def emit(self, record):
            notes.append(record.getMessage())
    logger, handler = logging.getLogger("areal_hpc"), Into(logging.WARNING)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _load_config(run_dir: Path, log_yaml: str, notes: list[str]) -> tuple[RunConfig, str]:
    """The run's config.yaml (without one, the copy the rollout log keeps: its first attempt's),
    and the stale policy the run had: a config written before rollout.stale_policy existed
    (every run's config.yaml lists every key) is of a release that gave a stale group up at once,
    which is "drop"."""
    path = run_dir / run_files.CONFIG
    try:
        if path.is_file():
            cfg = load_config(path)
            text = path.read_text(encoding="utf-8")
        elif log_yaml:
            text = log_yaml
            notes.append("no config.yaml: using the config stored in rollouts.h5")
            with tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / run_files.CONFIG
                copy.write_text(log_yaml)
                try:
                    cfg = load_config(copy)
                except ConfigError as exc:
                    msg = str(exc).splitlines()[0].replace(f"{copy}:", "")
                    raise AuditInputError(f"{run_dir / 'rollouts.h5'}: its stored config: "
                                          f"{msg.strip()}") from None
        else:
            raise AuditInputError(f"{path}: no such file (and rollouts.h5 holds no config)")
    except ConfigError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else "invalid config"
        raise AuditInputError(msg if str(path) in msg else f"{path}: {msg}") from None
    try:                        # the first attempt's settings, when they differ from the last's
        first = yaml.safe_load(log_yaml) if log_yaml else None
    except yaml.YAMLError:
        first = None
    if isinstance(first, dict):
        now = {"train.batch_prompts": cfg.train.batch_prompts,
               "rollout.group_size": cfg.rollout.group_size,
               "rollout.max_staleness": cfg.rollout.max_staleness, "rollout.mode": cfg.rollout.mode,
               "rollout.stale_policy": cfg.rollout.stale_policy,
               "rollout.max_reissues": cfg.rollout.max_reissues}
        for key, value in now.items():
            a, b = key.split(".")
            old = (first.get(a) or {}).get(b) if isinstance(first.get(a), dict) else None
            if old is not None and old != value:
                notes.append(f"{key} was {old!r} when rollouts.h5 was created, config.yaml says "
                             f"{value!r}: the checks use config.yaml's")
    try:
        used = yaml.safe_load(text)
    except yaml.YAMLError:
        used = None
    rollout = used.get("rollout") if isinstance(used, dict) else None
    if isinstance(rollout, dict) and "stale_policy" not in rollout:
        notes.append("the config predates rollout.stale_policy: that release gave stale groups "
                     "up at once (audited as stale_policy drop)")
        return cfg, "drop"
    return cfg, cfg.rollout.stale_policy


def _version_bounds(reader: RolloutReader, ends: np.ndarray, block_tokens: int):
    """Per row, the oldest and newest version of its sampled output tokens (-1 for a row
    without one: an observation token's version is -1), and the rows' loss-mask findings
    (`AuditedRun.unsampled`, `first_unsampled`, `masked_sampled`): one pass over /tokens/versions and
    /tokens/loss_mask in blocks of whole rows (a large run's tokens do not fit in memory)."""
    n = len(ends)
    vmin, vmax = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    unsampled, first, masked = np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)
    big = np.iinfo(np.int64).max
    for r0, r1, v, start, stop in version_blocks(reader, ends, block_tokens):
        has = stop > start
        if not has.any():
            continue
        t0 = int(ends[r0 - 1]) if r0 else 0
        m = mask_between(reader, t0, t0 + int(stop[-1]))
        low = np.minimum.reduceat(np.where(v >= 0, v, big), start[has])
        vmin[r0:r1][has] = np.where(low == big, -1, low)
        vmax[r0:r1][has] = np.maximum.reduceat(v, start[has])
        bad = m & (v < 0)
        unsampled[r0:r1][has] = np.add.reduceat(bad, start[has])
        masked[r0:r1][has] = np.add.reduceat(~m & (v >= 0), start[has])
        for i in np.flatnonzero(unsampled[r0:r1]):
            first[r0 + i] = int(np.argmax(bad[start[i]:stop[i]]))
    return vmin, vmax, (unsampled, first, masked)


def _read_metrics(run_dir: Path) -> list[tuple[int, dict]] | None:
    """metrics.jsonl as (line number, record) pairs; None when there is no such file."""
    rd = run_files.RunDir(run_dir)
    if not rd.metrics.exists():
        return None
    try:
        return rd.metrics_records()
    except run_files.RunFileError as exc:
        raise AuditInputError(str(exc)) from None


def read_run(run_dir: Path, check_crc: bool, notes: list[str], block_tokens: int) -> AuditedRun:
    if not run_dir.is_dir():
        raise AuditInputError(f"{run_dir}: no such run directory")
    log_path = run_dir / run_files.ROLLOUTS
    try:
        with RolloutReader(log_path) as r:
            log_yaml = r.config_yaml
            cols = {name: r.column(name) for name in
                    ("prompt_id", "sample_idx", "consumed_step", "output_end", "reward",
                     "finish_reason", "discard")}
            ends = cols["output_end"]
            if len(ends) and (np.diff(ends) < 0).any():
                raise RolloutLogError(f"{log_path}: damaged rollout log (offsets go backwards)")
            vmin, vmax, masks = _version_bounds(r, ends, block_tokens)
    except FileNotFoundError:
        raise AuditInputError(f"{log_path}: no such file (no rollout log)") from None
    except RolloutLogError as exc:
        raise AuditInputError(str(exc).splitlines()[0]) from None
    except OSError as exc:
        raise AuditInputError(f"{log_path}: unreadable ({exc.strerror or exc})") from None
    cfg, policy = _load_config(run_dir, log_yaml, notes)
    r = cfg.rollout
    run = AuditedRun(run_dir=run_dir, cfg=cfg, B=cfg.train.batch_prompts, n=r.group_size,
               eta=0 if r.mode == "sync" else r.max_staleness, policy=policy,
               max_reissues=r.max_reissues,
               pid=cols["prompt_id"].astype(np.int64), sidx=cols["sample_idx"].astype(np.int64),
               consumed=cols["consumed_step"].astype(np.int64),
               out_len=np.diff(ends.astype(np.int64), prepend=0),
               reward=np.asarray(cols["reward"], dtype=np.float32),
               cut=cols["finish_reason"] == FINISH_REASONS.index("length"),
               discard=cols["discard"] > 0, vmin=vmin, vmax=vmax,
               metrics=_read_metrics(run_dir), unsampled=masks[0], first_unsampled=masks[1],
               masked_sampled=masks[2])
    hit = ck.find_latest(run_dir, check_crc=check_crc)
    if hit is None:
        folders = ck.list_checkpoints(run_dir)
        if folders:
            notes.append(f"{len(folders)} checkpoint folder(s), none valid")
        return run
    run.ckpt, run.ck_step = hit[0], int(hit[1]["step"])
    try:
        run.ctrl = ck.read_state(hit[0] / ck.STATE)["controller"]
    except ck.CheckpointError as exc:
        raise AuditInputError(str(exc).splitlines()[0]) from None
    return run


# ------------------------------------------------------------------------------------ groups

@dataclass
class Groups:
    """The log cut into groups: a group is the rows of one prompt appended together, sample_idx
    0, 1, ... (the log stores no group boundaries; the generator sends a group's samples in
    sample order and the controller appends them as one batch)."""

    starts: np.ndarray          # first row of each group
    lens: np.ndarray
    pid: np.ndarray
    whole: np.ndarray           # n rows, sample_idx 0..n-1
    of_row: np.ndarray          # group index of each row

    @classmethod
    def of(cls, run: AuditedRun) -> Groups:
        pid, sidx, rows = run.pid, run.sidx, len(run.pid)
        start = group_starts(np.arange(rows), pid, sidx)
        starts = np.flatnonzero(start)
        lens = np.diff(np.append(starts, rows))
        return cls(starts, lens, pid[starts], (lens == run.n) & (sidx[starts] == 0),
                   np.cumsum(start) - 1)

    def status(self, column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each group's consumed status in `column`, and whether all its rows share it."""
        if not len(self.starts):
            return np.zeros(0, np.int64), np.zeros(0, bool)
        lo = np.minimum.reduceat(column, self.starts)
        return lo, lo == np.maximum.reduceat(column, self.starts)

    def states(self, g: int, column: np.ndarray) -> str:
        """The statuses of group g's rows in `column`, e.g. "step 3/pending"."""
        a = int(self.starts[g])
        return "/".join(status_name(int(s)) for s in np.unique(column[a:a + int(self.lens[g])]))

    def rows(self, g: int) -> str:
        a = int(self.starts[g])
        return f"rows {a}-{a + int(self.lens[g]) - 1}" if self.lens[g] > 1 else f"row {a}"


def any_trained(groups: Groups, column: np.ndarray) -> np.ndarray:
    """Per group: whether any of its rows holds a training step in `column`."""
    if not len(groups.starts):
        return np.zeros(0, bool)
    return np.maximum.reduceat(column, groups.starts) >= 0


def status_name(step: int) -> str:
    return STATUS_NAMES.get(step, f"step {step}")


# ------------------------------------------------------------------------------------ projection

@dataclass
class Projection:
    """The log as a resume from the newest checkpoint would see it (`Controller._restore`):
    rows from the checkpoint's `rollout_rows` on rolled back, its buffered rows pending again.
    For a run whose log is as the checkpoint left it, this is the log itself (`went_on` False)."""

    consumed: np.ndarray
    went_on: bool
    lines: list[str]            # what happened after the checkpoint
    problems: list[str]         # what contradicts the checkpoint (violations)


def project(run: AuditedRun) -> Projection | None:
    if run.ctrl is None:
        return None
    c, rows = run.ck_step, len(run.consumed)
    R = int(run.ctrl.rollout_rows)
    buf = run.ctrl.buffer_rows.astype(np.int64)
    consumed, proj = run.consumed, run.consumed.copy()
    problems, lines = [], []
    if R > rows:
        problems.append(f"the checkpoint saw {R} log rows, the log has {rows} (a resume "
                        "would refuse it)")
        R = rows
    buf = buf[buf < rows]
    values, times = np.unique(buf, return_counts=True)
    dup = values[times > 1]
    if len(dup):
        problems.append(f"buffer_rows lists rows more than once: {some(dup.tolist())}")
    b = consumed[buf]
    early = buf[(b >= 0) & (b < c)]
    if len(early):
        problems.append(f"{len(early)} buffered row(s) were trained before the checkpoint's step "
                        f"{c} (a resume would train them again): "
                        + some(f"row {i} (step {consumed[i]})" for i in early))
    gone = buf[b == ROLLED_BACK]
    if len(gone):
        problems.append(f"{len(gone)} buffered row(s) are marked rolled back: "
                        f"{some(f'row {i}' for i in gone)}")
    in_buf = np.zeros(rows, bool)
    in_buf[buf] = True
    late = np.flatnonzero(~in_buf[:R] & (consumed[:R] >= c))
    if len(late):
        problems.append(f"{len(late)} row(s) the checkpoint neither buffered nor saw trained were "
                        f"trained at step {c} or later: "
                        + some(f"row {i} (step {consumed[i]})" for i in late))
    after_rows = rows - R
    after_steps = sorted({int(s) for s in consumed[consumed >= c]})
    changed = int(((b >= c) | (b == DROPPED_STALE)).sum())
    went_on = bool(after_rows or after_steps or changed)
    if went_on:
        lines.append(f"the run went on past its newest checkpoint (step {c}, {R} rows): "
                     + ", ".join(x for x in (
                         f"{after_rows} row(s) appended after it" if after_rows else "",
                         f"step(s) {after_steps[0]}-{after_steps[-1]} trained after it"
                         if after_steps else "",
                         f"{changed} buffered row(s) since trained or dropped" if changed else "")
                         if x)
                     + "; compared as a resume would see the log (those rows rolled back, the "
                     "buffered rows pending again)")
    proj[R:] = ROLLED_BACK
    proj[buf] = NOT_CONSUMED
    return Projection(proj, went_on, lines, problems)
