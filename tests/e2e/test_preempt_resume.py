"""Preemption and resume of the real job (mpiexec, vLLM, Megatron, HDF5), as one scenario job of
four attempts in one run directory (a resumed run equal to an uninterrupted one, with a preemption
mid-generation: tests/e2e/test_repeat.py):

1. USR1 before the first training step (while vLLM starts): exit 3, no checkpoint written, the
   rollout log closed and readable;
2. the same command starts afresh (the aborted attempt's files set aside as *.attempt-1.*); TERM
   to every process of the job, as Slurm's preemption sends it, after a step drawn afresh each
   run: vLLM's processes die with it, mid-generation or mid-update; the ranks still stop at the
   step boundary, write the checkpoint there and exit 3 for a requeue;
3. the same command resumes from that checkpoint; every process of the job but the ranks'
   reapers is SIGKILLed one step past the next periodic checkpoint (a hard kill: no checkpoint at
   the stop);
4. the same command resumes from the last checkpoint and finishes.

Each test below checks one of these claims on what the attempts left. At the end rollouts.h5 must
show every trajectory consumed at most once, every step consumed exactly B groups, no accepted
trajectory lost (pending rows are exactly the final checkpoint's buffer), groups that arrived after
the last checkpoint before the hard kill kept but never trained, and metrics.jsonl and the
TensorBoard event files must hold each step once."""
import collections
import json
import os
import random
import signal
import time

import psutil
import pytest

from areal_hpc.audit import audit
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import NOT_CONSUMED, ROLLED_BACK, RolloutReader
from areal_hpc.storage.tensorboard import read_scalars

STEPS, B, N, EVERY = 9, 3, 2, 3
SMALL = [f"train.total_steps={STEPS}", f"train.batch_prompts={B}", f"rollout.group_size={N}",
         "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
         f"checkpoint.every_steps={EVERY}"]


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


def _signal_all(jobs, sig, spare=("mpiexec", "hydra", "areal_hpc.launch")) -> None:
    """`sig` to every process of the job (as Slurm does to a step) but those named in `spare`."""
    for p in jobs.processes(ranks_only=False):
        try:
            if not any(x in " ".join(p.cmdline()) for x in spare):
                p.send_signal(sig)
        except psutil.Error:                        # exited meanwhile
            pass


def _engine_up(jobs) -> bool:
    for p in jobs.processes():
        try:
            if "EngineCore" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


@pytest.fixture(scope="module")
def scenario(jobs, tiny_model, tmp_path_factory):
    """The four attempts, each recorded (exit code, output, steps done, checkpoints) for the
    tests to check; an attempt runs whatever the one before it did."""
    tmp = tmp_path_factory.mktemp("preempt_resume")
    args = jobs.args(tiny_model, tmp, "p", *SMALL)
    run_dir = tmp / "p"
    seed = int(os.environ.get("AREAL_TEST_SEED") or random.SystemRandom().randrange(2**32))
    term_after = random.Random(seed).randint(1, EVERY)
    print(f"\nTERM after step {term_after} (AREAL_TEST_SEED={seed})")
    rec = {"run": run_dir, "term_after": term_after, "seed": seed}

    def attempt(name, stop=None):
        proc = jobs.start(args)
        at = stop(proc) if stop is not None else None
        code, out = _finish(proc)
        rec[name] = {"code": code, "out": out, "steps": _steps_done(run_dir), "at": at,
                     "checkpoints": [ck.step_of(p) for p in ck.list_checkpoints(run_dir)]}
        if (run_dir / "rollouts.h5").exists():
            with RolloutReader(run_dir / "rollouts.h5") as r:
                rec[name]["rows"] = len(r.column("consumed_step"))
        rec[name]["leftovers"] = jobs.leftovers()

    def before_first_step(proc):
        # As soon as the generator's vLLM engine exists, every rank has its signal handlers
        # (installed before the trainer builds its model and before the generator starts
        # vLLM); the trainer has not asked for its first batch yet (initial eval first).
        _wait_for(lambda: _engine_up(jobs), proc)
        steps = _steps_done(run_dir)
        _signal_all(jobs, signal.SIGUSR1)
        return steps

    def term(proc):
        _wait_for(lambda: _steps_done(run_dir) >= term_after, proc)
        _signal_all(jobs, signal.SIGTERM)

    def hard_kill(proc):
        # one step past the next periodic checkpoint (or past the resumed step, when none is left)
        start = ck.find_latest(run_dir)[1]["step"]
        after = (start // EVERY + 1) * EVERY
        after = after + 1 if after < STEPS - 1 else start + 1
        _wait_for(lambda: _steps_done(run_dir) >= after, proc)
        for p in jobs.processes(ranks_only=False):
            try:    # the ranks' reapers stay: they clean up vLLM's processes after the ranks die
                if "areal_hpc.reaper" not in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass
        done = _steps_done(run_dir)
        proc.wait(timeout=60)
        psutil.wait_procs(jobs.processes(ranks_only=False), timeout=30)
        return done

    attempt("first", before_first_step)
    attempt("afresh", term)
    attempt("killed", hard_kill)
    attempt("finished")
    return rec


def test_usr1_before_the_first_step_writes_nothing(scenario):
    a = scenario["first"]
    assert a["code"] == 3, a["out"][-4000:]
    assert "preempted before this attempt's first training step" in a["out"], a["out"][-4000:]
    assert a["at"] == 0 and a["steps"] == 0
    assert a["checkpoints"] == [], a["checkpoints"]
    assert a["rows"] >= 0                                       # closed properly, readable
    assert not a["leftovers"], a["leftovers"]


def test_the_next_attempt_starts_afresh_and_term_checkpoints_at_the_step(scenario):
    a, run = scenario["afresh"], scenario["run"]
    assert "has no usable checkpoint: starting afresh" in a["out"], a["out"][-4000:]
    with RolloutReader(run / "rollouts.attempt-1.h5") as r:     # the first attempt's, set aside
        assert len(r.column("consumed_step")) == scenario["first"]["rows"]
    assert a["code"] == 3, a["out"][-4000:]
    assert "preempted" in a["out"]
    assert scenario["term_after"] <= a["steps"] < STEPS, (scenario["term_after"], a["steps"])
    assert max(a["checkpoints"], default=None) == a["steps"], a["checkpoints"]  # the checkpoint is at the stop
    assert not a["leftovers"], a["leftovers"]


def test_a_hard_kill_resumes_from_the_last_checkpoint(scenario):
    term, a, b = scenario["afresh"], scenario["killed"], scenario["finished"]
    assert f"resuming from {ck.step_dir(scenario['run'], term['steps'])}" in a["out"], a["out"][-4000:]
    assert a["code"] != 0
    last = max(a["checkpoints"], default=-1)    # no checkpoint at a hard kill: the periodic one, or the resumed
    assert last == term["steps"] or last % EVERY == 0, a["checkpoints"]
    assert term["steps"] <= last <= a["at"] < STEPS, (term["steps"], last, a["at"])
    assert b["code"] == 0, b["out"][-4000:]
    assert f"resuming from {ck.step_dir(scenario['run'], last)}" in b["out"], b["out"][-4000:]
    if a["at"] > last:      # groups arrived after the checkpoint: kept in the log, never trained
        with RolloutReader(scenario["run"] / "rollouts.h5") as r:
            assert (r.column("consumed_step") == ROLLED_BACK).any()
    assert not b["leftovers"], b["leftovers"]


def test_the_finished_run_lost_nothing_and_trained_nothing_twice(scenario):
    assert scenario["finished"]["code"] == 0, scenario["finished"]["out"][-4000:]
    _check_log(scenario["run"])
