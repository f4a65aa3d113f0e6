"""The trainer side fails and the real job (mpiexec, vLLM, Megatron) still ends within its bounds,
leaving no process behind (a preemption before the first training step: the first attempt of
tests/e2e/test_preempt_resume.py).

- kill: the trainer rank (rank 0, the controller's host) is SIGKILLed after 2 steps, as when its
  node is lost. mpiexec (hydra) tears the job down itself (under Slurm: srun
  --kill-on-bad-exit=1, slurm/job.sh); every generator, its vLLM engine and reward workers must
  be gone within the bound.
- stall: the trainer rank is stopped (SIGSTOP): no launcher notices, the generators must. Each
  hears nothing from the controller for rollout.generator_timeout_s (or, stopped mid-broadcast,
  receives no weights for weights.timeout_s), ends itself naming the controller, and its reaper
  kills its vLLM engine and reward workers.
"""
import re
import signal
import time

import psutil
import pytest

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


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_trainer_loss_ends_the_job(jobs, tiny_model, tmp_path, how):
    run_dir = tmp_path / how
    proc = jobs.start(jobs.args(tiny_model, tmp_path, how, *ARGS))
    victim = None
    try:
        _run_until(jobs, proc, run_dir, 2)
        victim = _trainer_rank(jobs)
        jobs.processes()                     # notes the whole tree (engines) before the loss
        at = _steps_done(run_dir)            # the steps done as the fault comes
        victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
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
    if how == "stall":
        # Stopped between messages, the controller falls silent; stopped during a weight
        # broadcast, the generator's receive times out. Either way the generator names it.
        lost = re.findall(r"generator rank 1 \(host \S+\): (?:controller \(rank 0, host \S+\) "
                          r"silent for (\d+) s \(rollout.generator_timeout_s = 20\)|weights v\d+ "
                          r"from the trainer \(rank 0, host \S+\) not received in (\d+) s "
                          r"\(weights.timeout_s = 20\)): the trainer is gone; exiting", out)
        assert lost, out[-4000:]
        lost = [a or b for a, b in lost]
        print(f"generator: the trainer silent for {lost[0]} s")
        assert BOUND_S <= int(lost[0]) < BOUND_S + 10
        assert ended_s < BOUND_S + 60, ended_s
    else:
        # the launcher or the rank's reaper names the rank that was lost
        named = re.search(r"rank 0 \(trainer, host \S+\) ended without a clean exit"
                          r"|RANK 0 PID \d+ RUNNING AT \S+", out)
        assert named, out[-4000:]
        print(f"named: {named.group(0)}")
        assert ended_s < 60, ended_s
    _no_leftovers(jobs)
