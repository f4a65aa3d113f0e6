"""Preemption and resume of the real job (mpiexec, vLLM, Megatron, HDF5): a preemption signal at a
random step, a hard kill between checkpoints, and N straight vs N/2 + preempt + resume.

Afterwards rollouts.h5 must show every trajectory consumed at most once, every step consumed exactly
B groups, no accepted trajectory lost (pending rows are exactly the final checkpoint's buffer), and
metrics.jsonl and the TensorBoard event files must hold each step once."""
import collections
import json
import random
import signal
import time

import numpy as np
import psutil
import pytest

from areal_hpc.audit import audit
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import NOT_CONSUMED, PARTIAL, ROLLED_BACK, RolloutReader
from areal_hpc.storage.tensorboard import read_scalars

STEPS, B, N = 6, 3, 2
SMALL = [f"train.total_steps={STEPS}", f"train.batch_prompts={B}", f"rollout.group_size={N}",
         "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
         "checkpoint.every_steps=2"]


# Samples that never stop early: each runs LONG_TOKENS decode steps (an EOS does not end it).
LONG_TOKENS = 320
LONG = ["rollout.temperature=2.0", f"rollout.max_new_tokens={LONG_TOKENS}", "rollout.ignore_eos=true",
        "rollout.max_model_len=512"]


def _partial(run_dir):
    """The PARTIAL rows of the log: {row: (prompt_id, sample_idx, tokens, logprobs, versions,
    finish_reason)}."""
    with RolloutReader(run_dir / "rollouts.h5") as r:
        rows = np.flatnonzero(r.column("consumed_step") == PARTIAL).tolist()
        return {i: (x["prompt_id"], x["sample_idx"], x["output_tokens"], x["behav_logprobs"],
                    x["versions"], x["finish_reason"]) for i in rows for x in [r[i]]}


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


def _check_log(run_dir, steps=STEPS):
    """The guarantees a resumed run gives, read from its files."""
    with RolloutReader(run_dir / "rollouts.h5") as r:
        consumed = r.column("consumed_step")
        keys = list(zip(r.column("prompt_id").tolist(), r.column("sample_idx").tolist()))
    trained = collections.Counter(k for k, c in zip(keys, consumed) if c >= 0)
    assert max(trained.values()) == 1, "a trajectory was trained twice"
    per_step = collections.Counter(int(c) for c in consumed if c >= 0)
    assert per_step == {s: B * N for s in range(steps)}, per_step
    # nothing lost: pending rows are exactly the final checkpoint's buffer
    state = ck.read_state(ck.find_latest(run_dir)[0] / ck.STATE)
    pending = {i for i, c in enumerate(consumed) if c == NOT_CONSUMED}
    assert pending == set(state["controller"]["buffer_rows"].tolist())
    # a rolled-back trajectory's prompt was issued again (same prompt id)
    rolled = {k[0] for k, c in zip(keys, consumed) if c == ROLLED_BACK}
    live = {k[0] for k, c in zip(keys, consumed) if c != ROLLED_BACK}
    assert rolled <= live, rolled - live
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    # the TensorBoard files, rebuilt at the resume, hold each step once too (at steps trained)
    tb = read_scalars(run_dir)
    assert [p[0] for p in tb["train/loss"]] == list(range(1, steps + 1))
    assert [p[2] for p in tb["train/loss"]] == [x["time"] for x in lines]
    assert [p[0] for p in tb["eval/accuracy"]] == [0, steps]
    report = audit(run_dir)             # the independent audit agrees
    assert report.exit_code == 0, report.text()
    return consumed, keys


# One seed (the kill step it draws): a second one cost two minutes of a suite near its 45-minute
# budget; the hard-kill test below preempts at another step.
@pytest.mark.parametrize("seed", [1])
def test_preempt_at_a_random_step_then_resume(jobs, tiny_model, tmp_path, seed):
    """TERM to every process of the job, as Slurm's preemption sends it: vLLM's processes die
    with it, mid-generation or mid-update; the ranks still stop at the step boundary, write the
    checkpoint there and exit for a requeue. (USR1, the time-limit warning, spares vLLM: the
    other tests here and tests/launch use it.)"""
    kill_after = random.Random(seed).randint(1, STEPS - 2)
    args = jobs.args(tiny_model, tmp_path, "p", *SMALL)
    run_dir = tmp_path / "p"
    proc = jobs.start(args)
    _wait_for(lambda: _steps_done(run_dir) >= kill_after, proc)
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

    code, out = _finish(jobs.start(args))
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


def test_resume_equivalence_sync(jobs, tiny_model, tmp_path):
    """Sync mode (η = 0, deterministic prompt order): N steps straight and N/2 + preempt + resume +
    N/2 consume the same prompts with the same step count. Weights are not compared: vLLM's
    sampling depends on its batch composition and RNG state, which a restart changes.

    The preemption comes while step N/2's batch is being generated, so samples are
    mid-generation: they are kept as PARTIAL rows, the checkpoint names
    them, and the resume continues each from its prefix, which keeps its tokens,
    log-probabilities and versions; a sample that had finished is kept whole."""
    # One group in flight at a time, each LONG_TOKENS decode steps long (0.5-1 s here, by the
    # build of the tiny model): the first group of step N/2 is issued just before step N/2 - 1's
    # metrics line is written, and the batch is generated group by group. A group's time is
    # measured from that line (its wait for the batch, B groups one after another); the signal
    # goes out half a group minus 0.1 s after the line, and the job stops its generator
    # 0.01-0.17 s later (measured), so in the middle of the first group. (A fixed 0.4 s once
    # stopped it between two 0.55 s groups, with nothing mid-generation. Before that: the
    # batch's groups issued together, most samples ending at an early EOS, a whole batch took
    # 0.3-0.5 s, and the stop could find nothing in flight.)
    sync = [*SMALL, *LONG, "rollout.mode=sync", "checkpoint.every_steps=0",
            "rollout.max_concurrent_prompts=1"]
    code, out = _finish(jobs.start(jobs.args(tiny_model, tmp_path, "straight", *sync)))
    assert code == 0, out[-4000:]

    args = jobs.args(tiny_model, tmp_path, "resumed", *sync)
    run_dir = tmp_path / "resumed"
    proc = jobs.start(args)
    half = STEPS // 2
    _wait_for(lambda: _steps_done(run_dir) >= 1, proc)
    ranks = jobs.processes(ranks_only=True)    # found once: the signal goes out without a scan
    _wait_for(lambda: _steps_done(run_dir) >= half, proc, poll=0.05)
    group_s = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["wait_s"] / B
    time.sleep(max(0.05, group_s / 2 - 0.1))
    for p in ranks:
        p.send_signal(signal.SIGUSR1)
    code, out = _finish(proc)
    assert code == 3, out[-4000:]
    done = _steps_done(run_dir)
    assert ck.find_latest(run_dir)[1]["step"] == done
    partial = _partial(run_dir)
    cut = [i for i, p in partial.items() if p[5] == "abort" and 0 < len(p[2]) < LONG_TOKENS]
    assert cut, f"no sample was mid-generation at the preemption: {partial}"
    ctrl = ck.read_state(ck.find_latest(run_dir)[0] / ck.STATE)["controller"]
    referenced = {r for first, n in zip(ctrl["partial_first_row"], ctrl["partial_rows"])
                  for r in range(first, first + n)}
    assert referenced == set(partial)
    assert set(ctrl["partial_prompt_ids"]) <= set(ctrl["inflight_prompt_ids"])

    code, out = _finish(jobs.start(args))
    assert code == 0, out[-4000:]
    assert f"continued from {sum(len(p[2]) for p in partial.values())} partial tokens" in out
    consumed, keys = _check_log(run_dir)               # with the audit's check of each prefix
    with RolloutReader(run_dir / "rollouts.h5") as r:
        for i, (pid, idx, tokens, logprobs, versions, finish) in partial.items():
            j = next(j for j in range(i + 1, len(keys)) if keys[j] == (pid, idx))
            row, k = r[j], len(tokens)
            assert consumed[j] != PARTIAL and row["output_tokens"][:k].tolist() == tokens.tolist()
            assert row["behav_logprobs"][:k].tolist() == logprobs.tolist()
            assert row["versions"][:k].tolist() == versions.tolist()   # earlier tokens keep theirs
            assert (row["versions"][k:] == done).all()                 # later ones: the resumed
            if finish != "abort":                                      # a finished one is kept
                assert len(row["output_tokens"]) == k and row["finish_reason"] == finish

    def trained(run):
        consumed, keys = _check_log(tmp_path / run)
        return sorted(k for k, c in zip(keys, consumed) if c >= 0)
    assert trained("straight") == trained("resumed")
    assert len(np.unique([k[0] for k in trained("resumed")])) == STEPS * B
