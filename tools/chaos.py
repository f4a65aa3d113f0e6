#!/usr/bin/env python3
"""A chaos run on the local Slurm cluster: one tiny job, random failures at random times, each
followed by the path a batch job takes to resume, and the audit after each.

    eval "$(tools/local_slurm.sh up)"
    python tools/chaos.py --events 20 --seed 0 --out chaos.json [key=value ...]

The job is slurm/areal_tiny.sh (the tiny recipe as a heterogeneous job: one trainer rank, one
generator rank), with samples long enough that a preemption finds some mid-generation. Each
event waits a random time (--min-gap .. --max-gap seconds) after this attempt's first training
step (--training-share of the events) or after its ranks started (the rest: start-up), then
does one of:

  usr1       `scancel --batch --signal=USR1`: Slurm's time-limit warning. The ranks checkpoint at
             the next step boundary, slurm/job.sh requeues the job.
  term       `scancel --full --signal=TERM`: what Slurm's preemption sends every process of the
             job (vLLM's too) before it kills them; the same path as usr1.
  requeue    `scontrol requeue`: Slurm ends the running job (TERM, then KILL) and queues it again.
  kill_job   SIGKILL of every process of the job, batch shell included (a node lost): the job
             fails; the operator's `scontrol requeue` starts it again.
  kill_rank  SIGKILL of one rank, trainer or generator: srun ends the step, the job fails; requeue.
  stop_gen   SIGSTOP of the generator rank, once this attempt has trained a step: the trainer
             names it after rollout.generator_timeout_s (set short here) and the job fails;
             requeue. (Before its first report the bound is weights.join_timeout_s.)

With --engine-faults the events are a generator's engine faults, which the job recovers from
in place (--weights-mode: broadcast, the default, re-forms the weight group with the new engine
and sends the current version again; disk loads the published files; rollout.engine_restarts
high; no requeue between them):

  kill_engine      SIGKILL of the generator's vLLM EngineCore while it computes.
  stop_engine      SIGSTOP of the EngineCore: a stall, named after rollout.engine_stall_s.
  kill_at_update   SIGKILL of the EngineCore as a step's metrics line appears: the trainer has
                   published new weights, which the generator is about to load or loading.
  kill_tp_worker   SIGKILL of the engine's second TP worker (only with rollout.engine_tp=2).

After each, the generator's "vLLM engine restarted" line and the next trained step are awaited,
and the audit runs on the live run directory; each record has the restart's seconds, the samples
continued and the tokens kept, and the fault's delay to training: how much longer than 10
median steps the 10 steps from the fault on took (from the final metrics). --compare N adds N SIGKILLs of the generator rank
(today's path for a dead rank: the job fails and is requeued) at random places, for the same
figures side by side.

After each event: the attempt ends, the job is requeued (by job.sh, by Slurm, or here when it
failed), and before the next attempt is released `python -m areal_hpc.audit` checks the run
directory; any violation stops the run. At the end the job is stopped with USR1 and cancelled
once requeued, and the audit runs a last time. Figures: events survived, attempts, steps
trained, tokens kept across preemptions (partial rows continued), trajectories lost and trained
twice (from the audit). Exit 0 when every audit passed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_hpc.launch.rehearse import step_sockets, until  # noqa: E402  (Slurm's states, bounded)
from areal_hpc.audit import audit  # noqa: E402
from areal_hpc.storage.run_dir import RunDir  # noqa: E402
from areal_hpc.storage.rollout_log import PARTIAL, RolloutReader  # noqa: E402

EVENTS = ("usr1", "term", "requeue", "kill_job", "kill_rank", "stop_gen")
# The job: long enough never to finish on its own; samples that rarely stop early (64 new tokens
# at temperature 2), so that a stop finds some mid-generation; liveness bounds short, so that a
# stopped generator is named within a minute.
OVERRIDES = ["train.total_steps=100000", "train.batch_prompts=4", "rollout.group_size=4",
             "rollout.temperature=2.0", "rollout.max_new_tokens=64", "data.eval_every_steps=0",
             "data.eval_limit=4", "data.eval_samples=1", "checkpoint.every_steps=5",
             "rollout.heartbeat_s=2", "rollout.generator_timeout_s=30", "weights.timeout_s=30",
             "weights.join_timeout_s=180", "rollout.engine_restarts=0"]
ENGINE_EVENTS = ("kill_engine", "stop_engine", "kill_at_update")
STALL_S = 15
ENGINE_OVERRIDES = ["rollout.engine_restarts=1000",
                    "rollout.engine_restart_window_s=60", f"rollout.engine_stall_s={STALL_S}",
                    "weights.timeout_s=60", "rollout.generator_timeout_s=120"]
# The generator's line for each restart (rollout/recovery.py `_recover`).
RESTARTED = re.compile(r"vLLM engine restarted in ([\d.]+) s at weights v(\d+)"
                       r"(?:, to come over the re-formed weight group)? \(restart (\d+); "
                       r"cause: (.*)\); (\d+) sample\(s\) continued with (\d+) token\(s\) kept, "
                       r"(\d+) started again")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def job_info(job: str) -> dict[str, str]:
    out = sh("scontrol", "-o", "show", "job", job).stdout.splitlines()[0]
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def job_processes(job: str) -> list[psutil.Process]:
    """The job's processes on this machine: those whose environment holds its job id (the
    hetjob's components are job and job + 1), slurmstepd excluded."""
    ids = {job, str(int(job) + 1)}
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith("slurmstepd"):
                continue
            if p.environ().get("SLURM_JOB_ID") in ids:
                out.append(p)
        except psutil.Error:
            continue
    return out


def ranks(job: str) -> dict[int, psutil.Process]:
    """MPI rank → its process (`python -m mpi4py -m areal_hpc.main`)."""
    out = {}
    for p in job_processes(job):
        try:
            cmd = " ".join(p.cmdline())
            if "areal_hpc.main" in cmd and "mpi4py" in cmd:
                out[int(p.environ().get("PMI_RANK", p.environ().get("SLURM_PROCID", "-1")))] = p
        except (psutil.Error, ValueError):
            continue
    return out


def settled(job: str) -> bool:
    """No process of the job's previous attempt is left (its step daemons included): a job
    released before that is killed at once ("Job credential revoked")."""
    return not step_sockets(job) and not ranks(job)


def steps_done(run_dir: Path) -> int:
    path = RunDir(run_dir).metrics          # lines, not records: a line may be half written
    return len(path.read_text().splitlines()) if path.exists() else 0


def partial_tokens(run_dir: Path) -> tuple[int, int]:
    """(partial rows, their output tokens) in the run's rollout log."""
    path = run_dir / "rollouts.h5"
    if not path.exists():
        return 0, 0
    with RolloutReader(path) as r:
        c, ends = r.column("consumed_step"), r.column("output_end").astype(np.int64)
    lens = np.diff(ends, prepend=0)
    return int((c == PARTIAL).sum()), int(lens[c == PARTIAL].sum())


def fire(event: str, job: str, rng: random.Random) -> str:
    """Do `event` to the running job; returns what was done, in words."""
    if event == "usr1":
        sh("scancel", "--batch", "--signal=USR1", job)
        return "USR1 to the batch shell"
    if event == "term":
        sh("scancel", "--full", "--signal=TERM", job)
        return "TERM to every process of the job"
    if event == "requeue":
        sh("scontrol", "requeue", job)
        return "scontrol requeue"
    if event == "kill_job":
        procs = job_processes(job)
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        return f"SIGKILL to the job's {len(procs)} processes"
    rk = ranks(job)
    if event == "kill_rank":
        r = rng.choice(sorted(rk))
        rk[r].kill()
        return f"SIGKILL to rank {r} ({'trainer' if r == 0 else 'generator'})"
    if event == "stop_gen":
        g = max(rk)
        rk[g].send_signal(signal.SIGSTOP)
        return f"SIGSTOP to generator rank {g}"
    raise ValueError(event)


def engine_process(job: str, needle: str) -> psutil.Process | None:
    """The generator rank's vLLM process whose title holds `needle` ("EngineCore",
    "Worker_TP1"): a descendant of the highest rank."""
    rk = ranks(job)
    if not rk:
        return None
    try:
        for p in rk[max(rk)].children(recursive=True):
            try:
                if needle in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    return p
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return None


def when_busy(proc: psutil.Process, tries: int = 3000) -> None:
    """Return at a moment `proc` computes (its CPU time rose within 20 ms), or after `tries`
    such looks (a minute). NoSuchProcess if it ends meanwhile."""
    busy = lambda: sum(proc.cpu_times()[:2])     # noqa: E731
    before = busy()
    for _ in range(tries):
        time.sleep(0.02)
        if (now := busy()) - before >= 0.01:
            return
        before = now


def fire_engine(event: str, job: str, run_dir: Path) -> str:
    """Do an engine fault to the running job's generator; returns what was done, in words."""
    needle = "Worker_TP1" if event == "kill_tp_worker" else "EngineCore"
    if event == "kill_at_update":       # as the next step's line appears
        at = steps_done(run_dir)
        until(lambda: steps_done(run_dir) > at, 600, "the next step", poll=0.02)
    until(lambda: engine_process(job, needle) is not None, 600, f"the generator's {needle}")
    victim = engine_process(job, needle)
    if victim is None:
        raise RuntimeError(f"job {job}: no vLLM {needle} process found")
    if event != "kill_at_update":
        when_busy(victim)
    victim.send_signal(signal.SIGSTOP if event == "stop_engine" else signal.SIGKILL)
    how = "SIGSTOP" if event == "stop_engine" else "SIGKILL"
    return f"{how} to the generator's {needle} (pid {victim.pid})"


def restarts_logged(run_dir: Path) -> list[tuple]:
    """The generator's restart lines, from every attempt's ranks' log (slurm/job.sh writes the
    ranks' output under <run_dir>/logs/job-*/attempt-*/)."""
    found = []
    for log in sorted(run_dir.glob("logs/job-*/attempt-*/ranks.log"),
                      key=lambda p: (int(p.parent.parent.name[4:]), int(p.parent.name[8:]))):
        found += RESTARTED.findall(log.read_text(errors="replace"))
    return found


def step_times(run_dir: Path) -> list[float]:
    path = RunDir(run_dir).metrics
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(float(json.loads(line)["time"]))
        except (ValueError, KeyError):
            pass
    return out


def cost(run_dir: Path, at: int, t_fault: float) -> dict:
    """Seconds from the fault to the first step after it, and the median step interval of the
    ten steps before it."""
    times = step_times(run_dir)
    before = [b - a for a, b in zip(times[max(0, at - 11):at - 1], times[max(1, at - 10):at])]
    after = [t for t in times if t > t_fault]      # a resumed run rewrote the steps past its checkpoint
    return {"fault_to_next_step_s": after[0] - t_fault if after else None,
            "median_step_s": statistics.median(before) if before else None}


DELAY_STEPS = 10


def delay(times: list[float], rec: dict) -> float | None:
    """The fault's cost to training, from the run's final step times: how much longer than
    DELAY_STEPS median steps the DELAY_STEPS steps from the fault on took (training goes on
    with the groups buffered before it while the engine restarts, then waits; a requeued run
    retrains the steps since its checkpoint). None where the run ended first."""
    last = rec["steps_at_event"] + DELAY_STEPS - 1
    if last >= len(times) or rec["median_step_s"] is None:
        return None
    return times[last] - rec["t_fault"] - DELAY_STEPS * rec["median_step_s"]


def wait_attempt_end(job: str, restarts: int, timeout: float = 300) -> str:
    """Wait until the attempt is over: requeued (Restarts went up, back to PENDING) or ended
    (a terminal state); returns "requeued" or the terminal state."""
    def over() -> bool:
        info = job_info(job)
        return (int(info.get("Restarts", 0)) > restarts and info["JobState"] == "PENDING") \
            or info["JobState"] in TERMINAL
    until(over, timeout, f"job {job}'s attempt to end")
    info = job_info(job)
    return "requeued" if info["JobState"] == "PENDING" else info["JobState"]


def requeue_failed(job: str, state: str) -> None:
    """The operator's path after a failed attempt: requeue it (the run resumes)."""
    if state != "requeued":
        until(lambda: settled(job), 120, f"job {job}'s processes to end")
        sh("scontrol", "requeue", job)
        until(lambda: job_info(job)["JobState"] == "PENDING", 60, f"job {job} requeued")


def release(job: str) -> None:
    """Start a requeued job now (it is held ~120 s by Slurm's BeginTime otherwise), once the
    previous attempt is gone and its credential's revocation is over a second old: slurmd
    compares them in whole seconds, and a new attempt started within the same second is
    killed at once ("Job credential revoked")."""
    until(lambda: settled(job), 180, f"job {job}'s previous attempt to end")
    time.sleep(2)
    sh("scontrol", "update", f"jobid={job}", "starttime=now")


def running_again(job: str, tries: int = 3) -> None:
    """Wait for the released attempt to run; one that failed to start is requeued and released
    again (the operator's path), at most `tries` times."""
    for _ in range(tries):
        until(lambda: job_info(job)["JobState"] in ("RUNNING", *TERMINAL), 600,
              f"job {job} to run")
        state = job_info(job)["JobState"]
        if state == "RUNNING":
            return
        print(f"[chaos] job {job}'s attempt did not start ({state}): requeued again", flush=True)
        requeue_failed(job, state)
        release(job)
    raise RuntimeError(f"job {job} did not start in {tries} tries")


def check(run_dir: Path) -> tuple[bool, str, dict]:
    """The audit of the run directory, and its figures (lost prompts, trajectories trained
    twice, tokens kept across preemptions). A run stopped before its first rollout has nothing
    to audit."""
    if not (run_dir / "rollouts.h5").exists():
        return True, "no rollout log yet (stopped before the first group arrived)", \
            {"lost": 0, "twice": 0, "kept_tokens": 0}
    report = audit(run_dir, check_crc=False)
    fig = {"lost": report.figure("lost"), "twice": 0 if report.checks[0].ok else None,
           "kept_tokens": report.figure("kept_tokens", 0)}
    return report.ok, report.text(), fig


def engine_run(args, job: str, run_dir: Path, out_file: Path, rng: random.Random) -> list[dict]:
    """--engine-faults: the events on one running attempt (the --compare generator-rank kills
    requeue it); the records, without the final stop's."""
    events = list(ENGINE_EVENTS) + (["kill_tp_worker"] if "rollout.engine_tp=2" in args.overrides
                                    else [])
    rank_kills = set(rng.sample(range(args.events), min(args.compare, args.events)))
    records, t0 = [], time.monotonic()
    for k in range(args.events):
        running_again(job)
        until(lambda: len(ranks(job)) == 2, 300, "the job's two ranks")
        n_steps = steps_done(run_dir)
        until(lambda: steps_done(run_dir) > n_steps, 900, "a step")
        time.sleep(rng.uniform(args.min_gap, args.max_gap))
        if job_info(job)["JobState"] != "RUNNING":
            raise RuntimeError(f"job {job} stopped on its own before event {k}; see {out_file}")
        n_restarts = len(restarts_logged(run_dir))
        rec: dict = {}
        if k in rank_kills:
            event, restarts = "kill_generator_rank", int(job_info(job).get("Restarts", 0))
            rk = ranks(job)
            rk[max(rk)].kill()
            what = f"SIGKILL to generator rank {max(rk)}"
            at, t_fault = steps_done(run_dir), time.time()
            rec["attempt_end"] = state = wait_attempt_end(job, restarts)
            requeue_failed(job, state)
            release(job)
            running_again(job)
        else:
            event = rng.choice(events)
            what = fire_engine(event, job, run_dir)
            at, t_fault = steps_done(run_dir), time.time()
            until(lambda: len(restarts_logged(run_dir)) > n_restarts
                  or job_info(job)["JobState"] != "RUNNING", 900, "the engine's restart")
            if job_info(job)["JobState"] != "RUNNING":
                raise RuntimeError(f"job {job} ended after {event} instead of restarting its "
                                   f"engine; see {out_file}")
            secs, version, total, cause, continued, kept, again = restarts_logged(run_dir)[-1]
            rec.update(restart_s=float(secs), weights_version=int(version), restarts=int(total),
                       cause=cause, continued=int(continued), tokens_kept=int(kept),
                       started_again=int(again))
        until(lambda: any(t > t_fault for t in step_times(run_dir)), 900, "a step after it")
        rec = {"event": event, "what": what, "steps_at_event": at, "t_fault": t_fault, **rec,
               **cost(run_dir, at, t_fault), "steps_after": steps_done(run_dir),
               "t": time.monotonic() - t0}
        records.append(rec)
        print(f"[chaos] {k + 1}/{args.events} {event}: {what} at step {at}; "
              + (f"restarted in {rec['restart_s']:.1f} s ({rec['cause']}); " if "restart_s" in rec
                 else f"attempt {rec['attempt_end']}; ")
              + f"next step {_s(rec['fault_to_next_step_s'])} after (median step "
              f"{_s(rec['median_step_s'])})", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-gap", type=float, default=2.0, help="seconds after the attempt's "
                    "ranks are up, or after its first step (--training-share of the events)")
    ap.add_argument("--max-gap", type=float, default=30.0)
    ap.add_argument("--training-share", type=float, default=0.75)
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--run-dir", type=Path, help="default: a fresh folder under /tmp")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--engine-faults", action="store_true",
                    help="the generator's engine faults, recovered in place (see above)")
    ap.add_argument("--compare", type=int, default=0, help="with --engine-faults: this many "
                    "of the events are SIGKILLs of the generator rank (fail and requeue)")
    ap.add_argument("--weights-mode", choices=("broadcast", "disk"), default="broadcast",
                    help="with --engine-faults: how a new engine gets the current weights (sent "
                         "again over the re-formed weight group, or the published files)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if "SLURM_CONF" not in os.environ:
        print('error: no cluster: run eval "$(tools/local_slurm.sh up)" first', file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model} (tools/run_local.sh builds it)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="chaos_")) / "chaos"
    out_file = run_dir.parent / "batch.out"
    model = args.model.resolve()
    extra = [*ENGINE_OVERRIDES, f"weights.mode={args.weights_mode}"] if args.engine_faults else []
    cmd = ["sbatch", "--parsable", f"--output={out_file}", "slurm/areal_tiny.sh", *OVERRIDES, *extra,
           f"model.path={model}", f"data.train_path={model}/train.jsonl",
           f"data.eval_path={model}/heldout.jsonl", f"output_dir={run_dir.parent}",
           f"name={run_dir.name}", *args.overrides]
    os.chdir(ROOT)
    shm_before = set(Path("/dev/shm").glob("*"))    # what the run leaves there is counted
    job = sh(*cmd).stdout.strip().split(";")[0]
    print(f"[chaos] job {job}, run dir {run_dir}, batch output {out_file}", flush=True)
    records, ok, t0 = [], True, time.monotonic()
    engine: list[dict] = []
    try:
        if args.engine_faults:      # the events on the running job; then the final stop below
            engine = engine_run(args, job, run_dir, out_file, rng)
        for k in range(args.events if args.engine_faults else 0, args.events + 1):
            final = k == args.events
            info = job_info(job)
            restarts = int(info.get("Restarts", 0))
            running_again(job)
            before = steps_done(run_dir)
            if final:       # the last attempt trains a step, then a clean stop
                until(lambda: steps_done(run_dir) > before, 600, "a step of the last attempt")
                event = "usr1"
            else:
                event = rng.choice(EVENTS)
                gap = rng.uniform(args.min_gap, args.max_gap)
                # the ranks must be up for the events aimed at them
                until(lambda: len(ranks(job)) == 2 or job_info(job)["JobState"] != "RUNNING",
                      300, "the job's two ranks")
                # Mostly while it trains (after this attempt's first step); else while it starts.
                # A stopped generator only once it has reported (the trainer's liveness bound).
                training = event == "stop_gen" or rng.random() < args.training_share
                if training:
                    until(lambda: steps_done(run_dir) > before, 900, "a step of this attempt")
                time.sleep(gap)
            if job_info(job)["JobState"] != "RUNNING":
                raise RuntimeError(f"job {job} stopped on its own before event {k}: "
                                   f"{job_info(job)['JobState']}; see {out_file}")
            at = steps_done(run_dir)
            what = fire(event, job, rng)
            state = wait_attempt_end(job, restarts)
            requeue_failed(job, state)
            until(lambda: settled(job), 180, f"job {job}'s processes to end")
            if final:
                sh("scancel", job, check=False)
            passed, text, fig = check(run_dir)
            rows, tokens = partial_tokens(run_dir)
            rec = {"event": event, "what": what, "while": "training" if final or training
                   else "starting", "steps_before": before, "steps_at_event": at,
                   "steps_after": steps_done(run_dir), "attempt_end": state, "audit_ok": passed,
                   "partial_rows": rows, "partial_tokens": tokens, **fig,
                   "t": time.monotonic() - t0}
            records.append(rec)
            print(f"[chaos] {k + 1}/{args.events + 1} {event}: {what} at step {at}; attempt "
                  f"{state}; steps {steps_done(run_dir)}; audit {'ok' if passed else 'VIOLATED'}"
                  f"; lost {fig['lost']}; tokens kept {fig['kept_tokens']}", flush=True)
            if not passed:
                print(text, flush=True)
                ok = False
                break
            if not final:
                release(job)
    finally:
        sh("scancel", job, check=False)
    summary = {"job": job, "run_dir": str(run_dir), "events": len(records) - 1 if ok else
               len(records), "survived": ok, "steps": steps_done(run_dir),
               "attempts": int(job_info(job).get("Restarts", 0)) + 1,
               "kept_tokens": records[-1]["kept_tokens"] if records else 0,
               "lost": records[-1]["lost"] if records else None,
               "trained_twice": records[-1]["twice"] if records else None,
               "by_event": {e: sum(r["event"] == e for r in records) for e in EVENTS},
               "seconds": time.monotonic() - t0, "command": " ".join(sys.argv),
               # shared-memory files the run's processes left behind (killed engines' queues)
               "shm_left": len(set(Path("/dev/shm").glob("*")) - shm_before)}
    if args.engine_faults:
        times = step_times(run_dir)
        for r in engine:
            r["delay_s"] = delay(times, r)
        summary["events"] = len(engine) if ok else summary["events"]
        summary["by_event"] = {e: sum(r["event"] == e for r in engine)
                               for e in sorted({r["event"] for r in engine})}
        summary["cost"] = {e: {"n": len(rs),
                               "restart_s": _median(r.get("restart_s") for r in rs),
                               "fault_to_next_step_s": _median(r["fault_to_next_step_s"] for r in rs),
                               "delay_s": _median(r["delay_s"] for r in rs),
                               "tokens_kept": sum(r.get("tokens_kept", 0) for r in rs)}
                           for e in summary["by_event"]
                           for rs in [[r for r in engine if r["event"] == e]]}
    print("[chaos] " + json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "engine_records": engine,
                                        "records": records}, indent=1))
    return 0 if ok else 1


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.1f} s"


def _median(values) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


if __name__ == "__main__":
    sys.exit(main())
