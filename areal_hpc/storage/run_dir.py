"""A run's directory: the name of every file in it, and the housekeeping across attempts.

    <output_dir>/<name>/
        config.yaml          the resolved config the job ran with
        rollouts.h5          every trajectory (storage/rollout_log.py)
        metrics.jsonl        one line per training step
        eval.json            held-out evaluations
        generators.json      each generator's totals at the end of an attempt
        checkpoints/         storage/checkpoint.py
        tensorboard/         storage/tensorboard.py (rebuilt from metrics.jsonl at every start)
        policy/              the trained model, HF format
        weights/             weight versions in disk mode (weights.disk_dir unset)
        *.attempt-K.*        files of an attempt killed before its first checkpoint, set aside

Writers are trainer rank 0 (`train/lead.py`), the controller (the rollout log, generators.json),
the checkpoint code and the launcher (config.yaml); readers are the tools (audit, replay,
evaluate, the planner's calibration). metrics.jsonl, eval.json and generators.json are read and
written here only (RunDir's methods), whoever asks; a malformed one raises RunFileError naming
the file and line, which each tool turns into its own one-line refusal.
"""
from __future__ import annotations

import json
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..data.files import file_kind
from ..transport.messages import GeneratorStats

log = logging.getLogger(__name__)

CONFIG = "config.yaml"
ROLLOUTS = "rollouts.h5"
METRICS = "metrics.jsonl"
EVALS = "eval.json"
GENERATORS = "generators.json"
POLICY = "policy"
WEIGHTS = "weights"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
# What an attempt that never reached a checkpoint leaves: set aside when the next one starts.
ATTEMPT_FILES = (ROLLOUTS, METRICS, EVALS)


class RunFileError(ValueError):
    """A run-directory file that is not what its format says (the message names file and line)."""


def place(output_dir: str | os.PathLike, name: str) -> Path:
    """`output_dir/name` (`name` a plain name: config/__init__.py), checked before anything is
    written there: it resolves to that very folder of `output_dir` as `output_dir` resolves (a
    symlink there moves the run elsewhere, or makes two names one run: refused), it is a directory
    if it exists, and each of its files that exists is a regular file (each folder a folder).
    Returns the path; raises ValueError naming the path."""
    run = Path(output_dir) / name
    try:
        where, base = run.resolve(), Path(output_dir).resolve()
    except (OSError, RuntimeError) as exc:      # a symlink loop
        raise ValueError(f"{run}: does not resolve ({_why(exc)})") from None
    if where != base / name:
        raise ValueError(f"{run}: resolves to {where}, not a folder of its own in output_dir "
                         f"{base} (a symlink there: remove it or choose another name)")
    folders = (CHECKPOINTS, POLICY, WEIGHTS, TENSORBOARD)
    for path, want_dir in ((run, True), *((run / f, True) for f in folders),
                           *((run / f, False) for f in (CONFIG, *ATTEMPT_FILES, GENERATORS))):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({_why(exc)})") from None
        kind = "a directory" if stat.S_ISDIR(mode) else file_kind(mode) or "a regular file"
        if kind != ("a directory" if want_dir else "a regular file"):
            raise ValueError(f"{path}: {kind}, not {'a directory' if want_dir else 'a regular file'}")
    return run


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def _file(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run_dir>/{name}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    config = _file(CONFIG)
    rollouts = _file(ROLLOUTS)
    metrics = _file(METRICS)
    evals = _file(EVALS)
    generators = _file(GENERATORS)
    policy = _file(POLICY)
    weights = _file(WEIGHTS)
    checkpoints = _file(CHECKPOINTS)
    tensorboard = _file(TENSORBOARD)

    def attempt_files(self) -> list[str]:
        """Names of the files set aside by earlier attempts (sorted)."""
        return sorted(p.name for p in self.path.glob("*.attempt-*.*"))

    # -- housekeeping -----------------------------------------------------------------------------
    def set_aside_attempt(self) -> int | None:
        """A run directory with a rollout log but no usable checkpoint (killed before its first
        one) starts afresh: keep that attempt's files as `<name>.attempt-K.<ext>`. Returns K,
        or None when there was nothing to set aside."""
        if not self.rollouts.exists():
            return None
        k = 1 + len(list(self.path.glob(ROLLOUTS.replace(".", ".attempt-*.", 1))))
        for name in ATTEMPT_FILES:
            old = self.path / name
            if old.exists():
                old.rename(self.path / name.replace(".", f".attempt-{k}.", 1))
        log.warning("run dir %s has no usable checkpoint: starting afresh (the previous "
                    "attempt's files are kept as *.attempt-%d.*)", self.path, k)
        return k

    def truncate_metrics(self, steps: int) -> None:
        """Keep the metrics of steps < `steps` (a resume trains the later ones again)."""
        if self.metrics.exists():
            kept = [r for r in self.read_metrics() if r["step"] < steps]
            self.metrics.write_text("".join(json_line(r) for r in kept))

    def append_metrics(self, record: dict) -> None:
        """One step's line; a number that is not finite (a diagnostic with nothing to measure:
        NaN) is written as null, so that the file is standard JSON."""
        with open(self.metrics, "a") as f:
            f.write(json_line(record))

    def metrics_records(self) -> list[tuple[int, dict]]:
        """metrics.jsonl as (line number, record) pairs, in order ([] without the file; blank
        lines skipped, as a resume does). Each record is an object with a step number >= 0."""
        path = self.metrics
        if not path.exists():
            return []
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{path}: unreadable ({_why(exc)})") from None
        out = []
        for k, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise RunFileError(f"{path}:{k}: not a JSON line ({_why(exc)})") from None
            step = rec.get("step") if isinstance(rec, dict) else None
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise RunFileError(f"{path}:{k}: not a metrics record (no step number)")
            out.append((k, rec))
        return out

    def read_metrics(self) -> list[dict]:
        """metrics.jsonl's records, in order (metrics_records without the line numbers)."""
        return [rec for _, rec in self.metrics_records()]

    def metrics_by_step(self) -> dict[int, dict]:
        """metrics.jsonl by step (the last line of a step wins; {} without the file)."""
        return {rec["step"]: rec for rec in self.read_metrics()}

    def read_generators(self) -> list:
        """generators.json: each generator's GeneratorStats ([] without the file)."""
        path = self.generators
        if not path.exists():
            return []
        try:
            recs = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(recs, list):
                raise ValueError("not a list of generators")
            return [GeneratorStats(**r) for r in recs]
        except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
            raise RunFileError(f"{path}: not a readable generators file ({_why(exc)})") from None

    def write_generators(self, stats: list) -> None:
        """generators.json from each generator's GeneratorStats."""
        from dataclasses import asdict
        self.generators.write_text(json.dumps([asdict(s) for s in stats], indent=1))

    def read_all_evals(self) -> list[dict]:
        """eval.json's evaluations ([] without the file)."""
        return json.loads(self.evals.read_text()) if self.evals.exists() else []

    def write_evals(self, evals: list[dict]) -> None:
        self.evals.write_text(json.dumps(evals, indent=1))

    def read_evals(self, up_to_step: int) -> list[dict]:
        """The evaluations a resume at `up_to_step` keeps: those of steps it does not train again
        (the final one belongs to the attempt that wrote it)."""
        return [e for e in self.read_all_evals()
                if e.get("label") != "final" and e.get("step", 0) <= up_to_step]


def _finite_or_null(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


def json_line(record: dict) -> str:
    """One JSON line of a run file: a number that is not finite (a diagnostic with nothing to
    measure) is written as null, at any depth, so that the line is standard JSON."""
    return json.dumps(_finite_or_null(record), allow_nan=False) + "\n"


# A finished export's index (the policy/ directory: train/hf_export.py writes it).
INDEX = "model.safetensors.index.json"


def is_complete(out_dir: str | os.PathLike, step: int | None = None) -> bool:
    """Whether `out_dir` is a finished export (of `step`, when given): its index names the step
    and every shard it lists is there. A single `model.safetensors` without an index is an export
    of an earlier release (written before the final checkpoint, so complete when one exists)."""
    out = Path(out_dir)
    index = out / INDEX
    if not index.is_file():
        return (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    try:
        meta = json.loads(index.read_text())
        files = set(meta["weight_map"].values())
        saved_step = meta.get("metadata", {}).get("step")
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    if step is not None and saved_step is not None and int(saved_step) != step:
        return False
    return bool(files) and all((out / f).is_file() for f in files) and (out / "config.json").is_file()
