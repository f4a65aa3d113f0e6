"""The Slurm job's clock, as the job itself can read it: its time limit (SLURM_JOB_END_TIME -
SLURM_JOB_START_TIME, else `squeue`), and the lead of its preemption signal (the batch script's
`#SBATCH --signal=B:USR1@N`, through `scontrol`), or the config keys that stand in for them
(checkpoint.time_limit_s, checkpoint.signal_lead_s).

Read by the step-time preflight (plan/budget.py `check_time`) before any rank starts and by the
trainer's mid-step stop (preemption.py `job_end`) after a signal; it imports nothing of the
package but the config.
"""
from __future__ import annotations

import os
import re
import subprocess

from .config import RunConfig

_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(?:(\d+):)?(\d+)$")


def parse_slurm_time(text: str) -> float | None:
    """A Slurm time (sbatch --time, squeue %l: 'D-HH[:MM[:SS]]', 'HH:MM:SS', 'MM:SS', 'MM')
    -> seconds; None for UNLIMITED, NOT_SET, INVALID or anything else."""
    t = text.strip()
    m = _SLURM_TIME.match(t)
    if not m:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:        # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = (parts + [0, 0])[:3]
        return float(((int(days) * 24 + h) * 60 + mi) * 60 + s)
    if len(parts) == 3:
        return float((parts[0] * 60 + parts[1]) * 60 + parts[2])
    if len(parts) == 2:
        return float(parts[0] * 60 + parts[1])
    return float(parts[0] * 60)  # a bare number is minutes (sbatch --time)


_SIGNAL = re.compile(r"--signal[= ]+(?:[BR]{1,2}:)?(?:SIG)?([A-Z0-9]+)(?:@(\d+))?")


def lead_from_script(text: str, signals: list) -> float | None:
    """The `@N` of the first `--signal=[B:]SIG@N` in a batch script's #SBATCH lines whose signal
    is one of `signals` (Slurm's default lead is 60 s)."""
    for line in text.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        for sig, lead in _SIGNAL.findall(line):
            if sig in signals or sig.isdigit():
                return float(lead) if lead else 60.0
    return None


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def job_clock(cfg: RunConfig, env=None) -> tuple[float | None, str, float | None, str]:
    """(time limit s, where from, signal lead s, where from), each None when unknown: the config
    keys checkpoint.time_limit_s / signal_lead_s when set, else the Slurm job's
    (SLURM_JOB_END_TIME - SLURM_JOB_START_TIME, else `squeue -o %l`; the batch script's #SBATCH
    --signal through `scontrol write batch_script`)."""
    env = os.environ if env is None else env
    ck = cfg.checkpoint
    limit, limit_src, lead, lead_src = None, "", None, ""
    if ck.time_limit_s > 0:
        limit, limit_src = ck.time_limit_s, "checkpoint.time_limit_s"
    if ck.signal_lead_s > 0:
        lead, lead_src = ck.signal_lead_s, "checkpoint.signal_lead_s"
    job = env.get("SLURM_JOB_ID")
    if limit is None and job:
        start, end = env.get("SLURM_JOB_START_TIME"), env.get("SLURM_JOB_END_TIME")
        if start and end and start.isdigit() and end.isdigit() and int(end) > int(start):
            limit, limit_src = float(int(end) - int(start)), "SLURM_JOB_END_TIME"
        else:
            out = _run(["squeue", "-h", "-j", job, "-o", "%l"])
            limit = parse_slurm_time(out.splitlines()[0]) if out and out.strip() else None
            limit_src = "the job's --time (squeue)" if limit else ""
    if lead is None and job:
        out = _run(["scontrol", "write", "batch_script", job, "-"])
        lead = lead_from_script(out, list(ck.signals)) if out else None
        lead_src = "the batch script's --signal" if lead else ""
    return limit, limit_src, lead, lead_src
