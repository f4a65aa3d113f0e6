"""The trainer side fails and the real job (mpiexec, vLLM, Megatron) still ends within its bounds,
leaving no process behind (a preemption before the first training step: the first attempt of
tests/e2e/test_preempt_resume.py).

- kill: the trainer rank (rank 0, the controller's host) is SIGKILLed after 2 steps, as when its
  node is lost. mpiexec (hydra) tears the job down itself (under Slurm: srun
  --kill-on-bad-exit=1, slurm/job.sh); every generator, its vLLM engine and reward workers must
  be gone within the bound.
- stall: the trainer rank stops (SIGSTOP) halfway through sending weights v3 (a test hook
  places it there every run): no launcher notices, the generators must. The generator's receive
  times out after weights.timeout_s and leaves its model half loaded; it waits for the version
  to come again without generating on that model (which killed its engine: with
  rollout.engine_restarts = 0 the job ended on that instead, in a CI run where the stall fell
  in a broadcast by chance), hears nothing from the controller for rollout.generator_timeout_s,
  ends itself naming the controller, and its reaper kills its vLLM engine and reward workers.
- hang: the trainer rank stops making progress at the start of step 2 (a test hook: a Python
  loop; its beacon and controller threads run on, so no liveness check notices). Its progress
  watch (areal_hpc/stuck.py, rollout.progress_timeout_s) names it, its stacks and the
  generator's reach the output, the job ends, and the launcher exits 4 naming it.
"""
import os
import re
import time

import psutil
import pytest

from areal_hpc.stuck import EXIT_STUCK
from areal_hpc.train.trainer import HANG_ENV
from areal_hpc.train.weight_publisher import STOP_IN_BROADCAST_ENV
from tests.e2e.test_generator_failure import _no_leftovers, _run_until, _steps_done

BOUND_S = 20
ARGS = ["train.total_steps=400", "train.batch_prompts=3", "rollout.group_size=2",
        "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
        "checkpoint.every_steps=100", f"rollout.generator_timeout_s={BOUND_S}",
        "rollout.heartbeat_s=2", f"weights.timeout_s={BOUND_S}", "rollout.engine_restarts=0"]


def _trainer_rank(jobs) -> psutil.Process:
    for p in jobs.processes(ranks_only=True):
        try:
            if p.environ().get("PMI_RANK") == "0":
                return p
        except psutil.Error:
            pass
    raise AssertionError("no trainer rank (PMI_RANK=0) found")


def _stopped(jobs, proc, victim, timeout=600):
    """Wait until the hook has stopped `victim` (the job still running)."""
    deadline = time.time() + timeout
    while victim.status() != psutil.STATUS_STOPPED:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "the trainer rank never stopped in the broadcast"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["kill", "stall", "hang"])
def test_trainer_loss_ends_the_job(jobs, tiny_model, tmp_path, how):
    run_dir = tmp_path / how
    hook = {"stall": {**os.environ, STOP_IN_BROADCAST_ENV: "3"},
            "hang": {**os.environ, HANG_ENV: "2:0"}}.get(how)
    extra = [f"rollout.progress_timeout_s={BOUND_S}"] if how == "hang" else []
    proc = jobs.start(jobs.args(tiny_model, tmp_path, how, *ARGS, *extra), env=hook)
    victim = None
    try:
        _run_until(jobs, proc, run_dir, 1 if hook else 2)
        victim = _trainer_rank(jobs)
        jobs.processes()                     # notes the whole tree (engines) before the loss
        if how == "stall":
            _stopped(jobs, proc, victim)
        at = 2 if how == "hang" else _steps_done(run_dir)   # the steps done as the fault comes
        if not hook:
            victim.kill()
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=BOUND_S + 180)
        ended_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if victim is not None and how == "stall":
            try:
                victim.kill()
            except psutil.Error:
                pass
    steps = _steps_done(run_dir)
    print(f"\n{how}: job ended {ended_s:.1f} s after the trainer's {how} (exit "
          f"{proc.returncode}, {steps} steps done)")
    assert proc.returncode != 0, out[-4000:]
    # the lost trainer trained nothing more: its last metrics line is the one before the loss
    # (a step it had finished and not yet written may still appear)
    assert at <= steps <= at + 1, (at, steps)
    if how == "hang":
        assert proc.returncode == EXIT_STUCK and steps == at, (proc.returncode, steps, out[-4000:])
        named = re.search(r"\[rank 0\] areal_hpc.stuck: (rank 0 \(trainer, host \S+, pid \d+\)) "
                          r"made no progress for (\d+) s \(rollout.progress_timeout_s = 20; last: "
                          r"step 2: waiting for its batch\): it is stuck", out)
        assert named, out[-4000:]
        print(f"named: {named.group(0)}")
        assert BOUND_S <= int(named.group(2)) < BOUND_S + 10
        stacks = out[named.end():]
        assert "in _test_hang" in stacks, stacks[:4000]              # where it hangs
        assert re.search(r"\[rank 1\] areal_hpc.stuck: rank 0 \(trainer.*it is stuck; the stacks "
                         r"of rank 1 \(generator, host \S+, pid \d+\)'s threads follow", stacks), \
            stacks[:4000]
        assert "in run_generator" in stacks, stacks[:4000]          # the generator's own stack
        assert f"[launch] {named.group(1)} made no progress" in out
        assert (run_dir / "logs" / "stuck").read_text().startswith(named.group(1))
        assert ended_s < 60, ended_s
    elif how == "stall":
        # The receive times out first, and the rank waits for the version to come again...
        assert re.search(r"generator rank 1 \(host \S+\): the broadcast of weights v3 failed "
                         r"\(.*\); not generating until the weight group is re-formed", out), \
            out[-4000:]
        # ...with its engine up (the rank's exit takes it down afterwards)...
        waited = out[:out.index("the trainer is gone; exiting")]
        assert "vLLM engine fault" not in waited and "EngineRestartsError" not in out, \
            [line for line in out.splitlines() if "fault" in line or "Restarts" in line]
        # ...until the controller has been silent for its bound: the generator names it.
        lost = re.findall(r"generator rank 1 \(host \S+\): controller \(rank 0, host \S+\) "
                          r"silent for (\d+) s \(rollout.generator_timeout_s = 20\): the trainer "
                          r"is gone; exiting", out)
        assert lost, out[-4000:]
        print(f"generator: the trainer silent for {lost[0]} s")
        assert BOUND_S <= int(lost[0]) < BOUND_S + 10
        assert ended_s < 2 * BOUND_S + 60, ended_s     # the receive's bound, then the silence
    else:
        # the launcher or the rank's reaper names the rank that was lost
        named = re.search(r"rank 0 \(trainer, host \S+\) ended without a clean exit"
                          r"|RANK 0 PID \d+ RUNNING AT \S+", out)
        assert named, out[-4000:]
        print(f"named: {named.group(0)}")
        assert ended_s < 60, ended_s
    _no_leftovers(jobs)
