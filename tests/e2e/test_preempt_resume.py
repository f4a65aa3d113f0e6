"""Preemption and resume of the real job (mpiexec, vLLM, Megatron, HDF5): a preemption signal at a
random step and a hard kill between checkpoints (a resumed run equal to an uninterrupted one, with
a preemption mid-generation: tests/e2e/test_repeat.py).

Afterwards rollouts.h5 must show every trajectory consumed at most once, every step consumed exactly
B groups, no accepted trajectory lost (pending rows are exactly the final checkpoint's buffer), and
metrics.jsonl and the TensorBoard event files must hold each step once."""
import collections
import json
import os
import random
import signal
import time

import psutil

from areal_hpc.audit import audit
from areal_hpc.preemption import HOLD_HOOK_ENV
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import NOT_CONSUMED, ROLLED_BACK, RolloutReader
from areal_hpc.storage.tensorboard import read_scalars

STEPS, B, N = 7, 3, 2
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


def test_preempt_at_a_random_step_then_resume(jobs, tiny_model, tmp_path):
    """TERM to every process of the job, as Slurm's preemption sends it: vLLM's processes die
    with it, mid-generation or mid-update; the ranks still stop at the step boundary, write the
    checkpoint there and exit for a requeue. (USR1, the time-limit warning, spares vLLM: the
    other tests here and tests/launch use it.) The step is drawn afresh at every run, from 1 to
    STEPS - 4 (one job a run: the hard-kill test below stops another); the draw is printed, and
    AREAL_TEST_SEED=<seed> repeats it."""
    seed = int(os.environ.get("AREAL_TEST_SEED") or random.SystemRandom().randrange(2**32))
    kill_after = random.Random(seed).randint(1, STEPS - 4)
    print(f"\npreempted after step {kill_after} (AREAL_TEST_SEED={seed})")
    args = jobs.args(tiny_model, tmp_path, "p", *SMALL)
    run_dir = tmp_path / "p"
    # The generator holds (preemption.HOLD_HOOK_ENV) once it has weights version kill_after (or
    # the next, where no sample had a token in between) and a sample has a token: the job cannot
    # finish before the signal comes, on a quiet box (six steps in 5 s ran out before the signal
    # once) or a busy one. Held at version v, the trainer ends at most at step v + 2 (the
    # groups finished for η = 1), so v <= kill_after + 1 <= STEPS - 3 keeps it short of the end.
    held = tmp_path / "p.held"
    proc = jobs.start(args, env={**os.environ, HOLD_HOOK_ENV: f"{kill_after}:1:{held}"})
    _wait_for(held.exists, proc, poll=0.05)
    for p in jobs.processes(ranks_only=False):     # as Slurm does: every process of the step
        try:
            if not any(x in " ".join(p.cmdline()) for x in ("mpiexec", "hydra", "areal_hpc.launch")):
                p.send_signal(signal.SIGTERM)
        except psutil.Error:                        # exited meanwhile
            pass
    code, out = _finish(proc)
    assert code == 3, out[-4000:]
    assert "preempted" in out
    done = _steps_done(run_dir)
    assert kill_after <= done < STEPS, (kill_after, done)
    assert ck.find_latest(run_dir)[1]["step"] == done     # the checkpoint is at the stop

    code, out = _finish(jobs.start(args))     # the hook is not set: nothing holds the resume
    assert code == 0, out[-4000:]
    assert f"resuming from {ck.step_dir(run_dir, done)}" in out
    _check_log(run_dir)
    assert not jobs.leftovers(), "processes of the job are still running"


def test_hard_kill_resumes_from_last_checkpoint(jobs, tiny_model, tmp_path):
    steps = 9
    args = jobs.args(tiny_model, tmp_path, "k", *SMALL, f"train.total_steps={steps}",
                     "checkpoint.every_steps=3")
    run_dir = tmp_path / "k"
    proc = jobs.start(args)
    _wait_for(lambda: _steps_done(run_dir) >= 4, proc)         # past the checkpoint at step 3
    for p in jobs.processes(ranks_only=False):
        try:    # the ranks' reapers stay: they clean up vLLM's processes after the ranks die
            if "areal_hpc.reaper" not in " ".join(p.cmdline()):
                p.kill()
        except psutil.Error:
            pass
    done = _steps_done(run_dir)
    proc.wait(timeout=60)
    psutil.wait_procs(jobs.processes(ranks_only=False), timeout=30)
    ckpt = ck.find_latest(run_dir)[1]["step"]
    assert ckpt in (3, 6) and ckpt <= done < steps, (ckpt, done)

    code, out = _finish(jobs.start(args))
    assert code == 0, out[-4000:]
    assert f"resuming from {ck.step_dir(run_dir, ckpt)}" in out
    consumed, _ = _check_log(run_dir, steps)
    if done > ckpt:     # groups arrived after the checkpoint: kept in the log, never trained
        assert (consumed == ROLLED_BACK).any()
    assert not jobs.leftovers(), "processes of the job are still running"
