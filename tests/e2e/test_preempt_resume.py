"""Preemption and resume of the real job (mpiexec, vLLM, Megatron, HDF5), as one run through four
attempts (the `stops` fixture), each stopped as a cluster stops a job (a resumed run equal to an
uninterrupted one, with a preemption mid-generation: tests/e2e/test_repeat.py):

1. USR1 before the first training step (while vLLM starts): exit 3, no checkpoint written;
2. the same command starts afresh (the aborted attempt's log set aside); TERM to every process
   of the job, as Slurm's preemption sends it, at a step drawn afresh at every run: vLLM's
   processes die with it, mid-generation or mid-update; the ranks still stop at the step
   boundary, write the checkpoint there and exit 3;
3. the same command resumes from that checkpoint; SIGKILL to every process but the reapers once
   a later checkpoint is written: nothing is written at the stop;
4. the same command resumes from the last checkpoint and finishes.

Each test asserts one stop's claim on what the attempts left. Afterwards rollouts.h5 must show
every trajectory consumed at most once, every step consumed exactly B groups, no accepted
trajectory lost (pending rows are exactly the final checkpoint's buffer), and metrics.jsonl and
the TensorBoard event files must hold each step once."""
import collections
import json
import os
import random
import signal
import time

import psutil
import pytest

from areal_hpc.audit import audit
from areal_hpc.preemption import HOLD_HOOK_ENV
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import NOT_CONSUMED, ROLLED_BACK, RolloutReader
from areal_hpc.storage.tensorboard import read_scalars

STEPS, B, N = 10, 3, 2
SMALL = [f"train.total_steps={STEPS}", f"train.batch_prompts={B}", f"rollout.group_size={N}",
         "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
         "checkpoint.every_steps=2"]


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(cond, proc, timeout=600, poll=0.2):
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "timed out"
        time.sleep(poll)


def _finish(proc, timeout=900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _check_log(run_dir, steps=STEPS, rows_per_step=B * N):
    """The guarantees a resumed run gives, read from its files."""
    with RolloutReader(run_dir / "rollouts.h5") as r:
        consumed = r.column("consumed_step")
        keys = list(zip(r.column("prompt_id").tolist(), r.column("sample_idx").tolist()))
    trained = collections.Counter(k for k, c in zip(keys, consumed) if c >= 0)
    assert max(trained.values()) == 1, "a trajectory was trained twice"
    per_step = collections.Counter(int(c) for c in consumed if c >= 0)
    assert per_step == {s: rows_per_step for s in range(steps)}, per_step
    # nothing lost: pending rows are exactly the final checkpoint's buffer
    state = ck.read_state(ck.find_latest(run_dir)[0] / ck.STATE)
    pending = {i for i, c in enumerate(consumed) if c == NOT_CONSUMED}
    assert pending == set(state["controller"].buffer_rows.tolist())
    # a rolled-back trajectory's prompt was issued again (same prompt id)
    rolled = {k[0] for k, c in zip(keys, consumed) if c == ROLLED_BACK}
    live = {k[0] for k, c in zip(keys, consumed) if c != ROLLED_BACK}
    assert rolled <= live, rolled - live
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    # the TensorBoard files, rebuilt at the resume, hold each step once too (at steps trained)
    tb = read_scalars(run_dir)
    assert [p[0] for p in tb["train/lr"]] == list(range(1, steps + 1))      # lr: never null
    assert [p[2] for p in tb["train/lr"]] == [x["time"] for x in lines]
    assert [p[0] for p in tb["eval/accuracy"]] == [0, steps]
    report = audit(run_dir)             # the independent audit agrees
    assert report.exit_code == 0, report.text()
    return consumed, keys


def _signal_all(jobs, sig) -> None:
    """`sig` to every process of the job but the launchers, as Slurm signals a step's processes."""
    for p in jobs.processes(ranks_only=False):
        try:
            if not any(x in " ".join(p.cmdline()) for x in ("mpiexec", "hydra", "areal_hpc.launch")):
                p.send_signal(sig)
        except psutil.Error:                        # exited meanwhile
            pass


def _engine_started(jobs) -> bool:
    for p in jobs.processes():
        try:
            if "EngineCore" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


@pytest.fixture(scope="module")
def stops(jobs, tiny_model, tmp_path_factory):
    """One run through its four attempts (the module's doc); what each left, by attempt. The
    step of the TERM is drawn afresh at every run, from 1 to 2, printed, and AREAL_TEST_SEED=<seed>
    repeats it. A stop is made certain by the generator's hold hook (preemption.HOLD_HOOK_ENV):
    the generator holds once it has weights version v and a sample has a token, so the job cannot
    finish before the signal comes (on a quiet box six steps in 5 s ran out before a signal once);
    held at version v, the trainer ends at most at step v + 2 (the groups finished for η = 1)."""
    seed = int(os.environ.get("AREAL_TEST_SEED") or random.SystemRandom().randrange(2**32))
    term_at = random.Random(seed).randint(1, 2)
    print(f"\npreempted after step {term_at} (AREAL_TEST_SEED={seed})")
    tmp = tmp_path_factory.mktemp("stops")
    args = jobs.args(tiny_model, tmp, "p", *SMALL)
    run_dir = tmp / "p"
    got = {"run_dir": run_dir, "term_at": term_at}

    # 1. USR1 as soon as the generator's vLLM engine exists: every rank has its signal handlers
    # (installed before the trainer builds its model and before the generator starts vLLM), and
    # the trainer has not asked for its first batch yet (initial eval first).
    proc = jobs.start(args)
    _wait_for(lambda: _engine_started(jobs), proc)
    got["steps_at_usr1"] = _steps_done(run_dir)
    _signal_all(jobs, signal.SIGUSR1)
    got["code1"], got["out1"] = _finish(proc)
    got["steps1"], got["checkpoints1"] = _steps_done(run_dir), ck.list_checkpoints(run_dir)
    with RolloutReader(run_dir / "rollouts.h5") as r:         # closed properly, readable
        got["rows1"] = len(r.column("consumed_step"))
    got["leftovers1"] = jobs.leftovers()

    # 2. afresh; TERM once the generator holds at version term_at: steps term_at..term_at + 2
    held = tmp / "held2"
    proc = jobs.start(args, env={**os.environ, HOLD_HOOK_ENV: f"{term_at}:1:{held}"})
    _wait_for(held.exists, proc, poll=0.05)
    _signal_all(jobs, signal.SIGTERM)
    got["code2"], got["out2"] = _finish(proc)
    got["steps2"] = _steps_done(run_dir)
    got["checkpoint2"] = ck.find_latest(run_dir)[1]["step"]
    with RolloutReader(run_dir / "rollouts.attempt-1.h5") as r:
        got["rows_set_aside"] = len(r.column("consumed_step"))

    # 3. resumed; SIGKILL once the generator holds at version steps2 + 3: of steps steps2 + 1 and
    # steps2 + 2 one is checkpointed (every 2), and complete before version steps2 + 3 is
    # published; the trainer ends by step steps2 + 5 <= 9 < STEPS.
    held = tmp / "held3"
    proc = jobs.start(args, env={**os.environ, HOLD_HOOK_ENV: f"{got['steps2'] + 3}:1:{held}"})
    _wait_for(held.exists, proc, poll=0.05)
    for p in jobs.processes(ranks_only=False):
        try:    # the ranks' reapers stay: they clean up vLLM's processes after the ranks die
            if "areal_hpc.reaper" not in " ".join(p.cmdline()):
                p.kill()
        except psutil.Error:
            pass
    got["steps3"] = _steps_done(run_dir)
    out, _ = proc.communicate(timeout=60)
    got["out3"] = out
    psutil.wait_procs(jobs.processes(ranks_only=False), timeout=30)
    got["checkpoint3"] = ck.find_latest(run_dir)[1]["step"]

    # 4. resumed from the last checkpoint, to the end
    got["code4"], got["out4"] = _finish(jobs.start(args))
    got["leftovers4"] = jobs.leftovers()
    return got


def test_preempt_before_first_step_writes_nothing_and_reruns(stops):
    """Attempt 1, USR1 before the first step: exit 3 and "preempted before this attempt's first
    training step", no step, no checkpoint, the rollout log closed and readable, no process
    left; attempt 2 starts afresh, the aborted attempt's log set aside whole."""
    s = stops
    assert s["steps_at_usr1"] == 0
    assert s["code1"] == 3, s["out1"][-4000:]
    assert "preempted before this attempt's first training step" in s["out1"], s["out1"][-4000:]
    assert s["steps1"] == 0 and s["checkpoints1"] == [], (s["steps1"], s["checkpoints1"])
    assert not s["leftovers1"], f"processes of the job are still running: {s['leftovers1']}"
    assert "has no usable checkpoint: starting afresh" in s["out2"], s["out2"][-4000:]
    assert s["rows_set_aside"] == s["rows1"]


def test_preempt_at_a_random_step_then_resume(stops):
    """Attempt 2, TERM to every process at the drawn step: exit 3, "preempted", the steps done
    from the drawn one on and short of the end, the checkpoint at the stop; attempt 3 resumes
    from it."""
    s = stops
    assert s["code2"] == 3, s["out2"][-4000:]
    assert "preempted" in s["out2"]
    assert s["term_at"] <= s["steps2"] < STEPS, (s["term_at"], s["steps2"])
    assert s["checkpoint2"] == s["steps2"]     # the checkpoint is at the stop
    assert f"resuming from {ck.step_dir(s['run_dir'], s['steps2'])}" in s["out3"], s["out3"][-4000:]


def test_hard_kill_resumes_from_last_checkpoint(stops):
    """Attempt 3, SIGKILL to every process but the reapers: nothing written at the stop; attempt
    4 resumes from the last checkpoint before it (one of this attempt's), and groups that
    arrived after it stay in the log, never trained."""
    s = stops
    assert s["steps2"] < s["checkpoint3"] <= s["steps3"] < STEPS, (s["steps2"], s["checkpoint3"], s["steps3"])
    assert s["checkpoint3"] % 2 == 0                       # checkpoint.every_steps=2
    assert f"resuming from {ck.step_dir(s['run_dir'], s['checkpoint3'])}" in s["out4"], s["out4"][-4000:]
    if s["steps3"] > s["checkpoint3"]:    # groups arrived after the checkpoint: kept, never trained
        with RolloutReader(s["run_dir"] / "rollouts.h5") as r:
            assert (r.column("consumed_step") == ROLLED_BACK).any()


def test_the_run_finishes_with_nothing_lost_or_trained_twice(stops):
    """Attempt 4 ends the run (exit 0); the log, metrics, TensorBoard files and audit of the whole
    run hold each step's B groups once (`_check_log`); no process is left."""
    s = stops
    assert s["code4"] == 0, s["out4"][-4000:]
    _check_log(s["run_dir"])
    assert not s["leftovers4"], f"processes of the job are still running: {s['leftovers4']}"
