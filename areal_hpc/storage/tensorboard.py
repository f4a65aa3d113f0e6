"""TensorBoard event files of a run, in ``<run_dir>/tensorboard``: a mirror of metrics.jsonl,
eval.json and generators.json, so a run can be watched offline on a cluster with

    tensorboard --logdir runs/<name>/tensorboard        # or --logdir runs for every run

metrics.jsonl stays the record; the event files are rebuilt from it whenever the trainer starts
(`TensorBoardLog.open`). A resumed run has already dropped the steps it will train again from
metrics.jsonl and eval.json, so the rebuilt files hold every step once, with no gap, across any
number of requeues, each point at the wall-clock time its step finished.

Tags: ``train/<field>`` for the optimiser's statistics, ``rollout/<field>`` for the batch's
(reward, accuracy, lengths, staleness, drops), ``time/<field>`` for durations and rates,
``reward/<name>`` for the fields a user reward function logs, ``eval/accuracy`` (and pass@k) for
the held-out evaluations, ``generator/<rank>/<field>`` for each generator's totals at the end.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from .run_dir import RunDir
from .run_dir import TENSORBOARD as SUBDIR

log = logging.getLogger(__name__)

_ROLLOUT = {"reward", "accuracy", "reward_mean", "reward_errors", "response_len", "n_tokens", "n_seqs",
            "staleness_max", "staleness_mean", "dropped_stale", "failed_groups", "adv_abs_mean", "reissued",
            "given_up", "lost_stale", "truncated_frac", "zero_var_groups", "filtered_seqs", "entropy",
            "engine_restarts", "generators_live"}
_SKIP = {"step", "time"}


def tag_of(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl field."""
    if "/" in key:
        return key
    if key in _ROLLOUT or key.startswith("staleness"):
        return f"rollout/{key}"
    if key.endswith(("_s", "_seconds")) or key == "seconds":
        return f"time/{key}"
    return f"train/{key}"


def _scalars(record: dict):
    for key, value in record.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            yield tag_of(key), float(value)


class TensorBoardLog:
    """The run's event files (trainer rank 0). Each `step` / `evaluation` is flushed at once,
    so a preemption loses nothing of what metrics.jsonl holds."""

    def __init__(self, writer):
        self.writer = writer

    @classmethod
    def open(cls, run_dir: Path, evals: list[dict] = ()) -> "TensorBoardLog | None":
        """Rebuild ``run_dir/tensorboard`` from metrics.jsonl and `evals`, then keep it open for
        the steps to come; None (with a warning) when TensorBoard is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            log.warning("no TensorBoard event files for this run (%s); metrics.jsonl has them all", exc)
            return None
        out = Path(run_dir) / SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("events.out.tfevents.*"):
            old.unlink()
        tb = cls(SummaryWriter(log_dir=str(out), flush_secs=3600))
        for rec in RunDir(run_dir).read_metrics():
            tb.step(rec, flush=False)
        for e in evals:
            tb.evaluation(e, flush=False)
        tb.writer.flush()
        return tb

    def step(self, record: dict, flush: bool = True) -> None:
        """One metrics.jsonl row, at its step + 1 (the number of steps trained, as the
        evaluations count them: the initial evaluation is at 0)."""
        when, step = record.get("time"), record["step"] + 1
        for tag, value in _scalars(record):
            self.writer.add_scalar(tag, value, step, walltime=when)
        if flush:
            self.writer.flush()

    def evaluation(self, res: dict, flush: bool = True) -> None:
        """One held-out evaluation (eval.json entry), at the steps trained before it."""
        when, step = res.get("time"), res.get("step", 0)
        for key in ("accuracy",) + tuple(k for k in res if k.startswith("pass@")):
            value = res.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"eval/{key}", float(value), step, walltime=when)
        if flush:
            self.writer.flush()

    def generators(self, run_dir: Path, step: int) -> None:
        """Each generator's totals (generators.json) at the run's last step."""
        for st in RunDir(run_dir).read_generators():
            prefix = f"generator/{st.rank}"
            self.writer.add_scalar(f"{prefix}/busy_share", st.busy_share(), step)
            self.writer.add_scalar(f"{prefix}/engine_share", st.engine_share(), step)
            self.writer.add_scalar(f"{prefix}/tokens", float(st.tokens), step)
            for bucket, seconds in st.seconds.items():
                self.writer.add_scalar(f"{prefix}/seconds_{bucket}", float(seconds), step)
            for what, n in st.reward.items():
                self.writer.add_scalar(f"{prefix}/reward_{what}", float(n), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar point in the run's event files as written, ``{tag: [(step, value,
    walltime), ...]}`` in file order (no de-duplication: a step written twice shows twice)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.util import tensor_util

    points: dict[str, list[tuple[int, float, float]]] = {}
    for path in sorted((Path(run_dir) / SUBDIR).glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            if not event.HasField("summary"):
                continue
            for v in event.summary.value:
                value = (v.simple_value if v.HasField("simple_value")
                         else float(tensor_util.make_ndarray(v.tensor)))
                points.setdefault(v.tag, []).append((event.step, value, event.wall_time))
    return points
