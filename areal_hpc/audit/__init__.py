"""An audit anyone can run: read a finished (or stopped) run directory and check, from its files
alone, the guarantees the pipeline gives.

    python -m areal_hpc.audit runs/tiny            # or: python tools/audit_run.py runs/tiny

What it reads (never writes): `config.yaml` (B = train.batch_prompts, n = rollout.group_size,
η = rollout.max_staleness, 0 in sync mode, total_steps, stale_policy), `rollouts.h5` (every
trajectory the controller accepted, with the step that consumed it or NOT_CONSUMED, DROPPED_STALE,
ROLLED_BACK, and the PARTIAL rows of samples a preemption interrupted), the newest valid checkpoint's `state.h5` (the controller's state: data cursor,
buffered rows, prompts in flight, counters; chosen as a resume would choose it,
`checkpoint.find_latest`) and `metrics.jsonl` (one line per training step).

The checks, each reported with its counts:
  1. no trajectory (prompt_id, sample_idx) trained twice;
  2. training steps continuous: consumed steps are 0..S-1, each B x n trajectories in B whole
     groups; metrics.jsonl holds steps 0..S-1 once each, in order;
  3. every prompt issued is accounted for: trained, pending, in flight at the checkpoint, dropped
     as stale and given up (as stale_policy allows), or rolled back and issued again; none lost;
  4. pending rows are exactly the checkpoint's buffered rows (whole groups), its counters agree
     with the log;
  5. no token's version exceeds the step that trained it, and s - min(version) <= η for every
     trajectory trained at step s (`staleness.staleness_of`);
  6. rolled-back rows hold no training step, and each rollback cut whole groups;
  7. every partial row is continued: the next row of its prompt and sample starts with its
     tokens, log-probabilities and versions (or it waits in the checkpoint's partial groups);
     or, with per-request seeds, an unfinished one whose tokens came from one weight version
     was generated again from its seed under that version (reported when its tokens differ).
  8. every trained token was sampled (loss mask 1: version >= 0), every observation token of a
     multi-turn episode (version -1) masked out of the loss, and no sampled token masked out;
     staleness (check 5) counts an episode by its oldest sampled token.

What the files cannot tell, and is reported so:
  - whether a rolled-back row had been trained before its job died: ROLLED_BACK replaces the step
    it held (that step was trained again after the resume, which check 2 sees);
  - group boundaries: the log does not store them; a group is read as consecutive rows of one
    prompt with sample_idx 0..n-1 (how the generator sends and the controller appends them);
  - the version at which a group was dropped as stale (so not whether the drop was due), and how
    many reissues a prompt had used when a resume reset that count (not saved): a prompt given up
    must have been dropped more than max_reissues times, which is checked;
  - without a valid checkpoint: the data cursor and the prompts in flight, so whether an issued
    prompt without rows was lost;
  - the staleness bound under stale_policy keep, which does not enforce it;
  - the files of earlier attempts that started afresh (*.attempt-K.*), eval.json, TensorBoard.

A run that went on past its newest checkpoint (killed between checkpoints, or stopped before the
first step of an attempt) is compared as a resume would see it: rows after the checkpoint rolled
back, buffered rows pending again. A check the files cannot decide is reported "not checkable"
with the reason, never passed silently.

Exit status: 0 every guarantee checked holds, 1 one is violated, 2 an input is missing or
unreadable (one line naming the file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..storage import run_dir as run_files
from .checks import run_checks
from .run import (BLOCK_TOKENS, EXIT_OK, EXIT_UNREADABLE, EXIT_VIOLATED, AuditInputError, Check,
                  Groups, Report, project, read_run, some, warnings_into)

__all__ = ["audit", "main", "AuditInputError", "Check", "Report", "EXIT_OK", "EXIT_VIOLATED",
           "EXIT_UNREADABLE"]


# ------------------------------------------------------------------------------------ entry points

def audit(run_dir: str | Path, *, check_crc: bool = True,
          block_tokens: int = BLOCK_TOKENS) -> Report:
    """Audit the run directory `run_dir`; raises AuditInputError (one line naming the file)
    when an input is missing or unreadable. `check_crc` False checks the checkpoints' file
    sizes only (faster for large checkpoints; the CRC-32s are what a resume checks)."""
    run_dir = Path(run_dir)
    notes: list[str] = []
    with warnings_into(notes):
        run = read_run(run_dir, check_crc, notes, block_tokens)
    attempts = run_files.RunDir(run_dir).attempt_files()
    if attempts:
        notes.append(f"earlier attempts started afresh (no usable checkpoint; their training was "
                     f"discarded), not audited: {some(attempts)}")
    groups = Groups.of(run)
    proj = project(run)
    r = run.cfg.rollout
    S = int(run.consumed.max()) + 1 if (run.consumed >= 0).any() else 0
    ckpt = (f"{run.ckpt.relative_to(run_dir)} (step {run.ck_step}"
            + (f", {int(run.ctrl.rollout_rows)} rows)" if run.ctrl is not None else ")")
            if run.ckpt is not None else "none valid")
    summary = [f"config: B = {run.B} prompts x n = {run.n} samples a step, η = {run.eta} "
               f"({r.mode}), stale_policy {run.policy}, total_steps {run.cfg.train.total_steps}",
               f"rollouts.h5: {len(run.pid)} rows in {len(groups.starts)} groups, "
               + (f"consumed at steps up to {S - 1}" if S else "none consumed")
               + f"; checkpoint: {ckpt}", *(proj.lines if proj is not None else [])]
    checks = run_checks(run, groups, proj)
    return Report(run_dir, summary, checks, notes)


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.splitlines()
    return argparse.ArgumentParser(prog="python -m areal_hpc.audit", description=doc[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(doc[1:]))


def main(argv: list[str] | None = None) -> int:
    """The CLI: print the report; returns the exit status (0 holds, 1 violated, 2 unreadable)."""
    ap = _parser()
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    ap.add_argument("--no-crc", action="store_true", help="check the checkpoints' file sizes, "
                    "not their CRC-32s (faster on large checkpoints)")
    args = ap.parse_args(argv)
    try:
        report = audit(args.run_dir, check_crc=not args.no_crc)
    except AuditInputError as exc:
        print(f"error: {exc}", file=sys.stderr)         # one line, naming the file
        return EXIT_UNREADABLE
    print(report.text())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
