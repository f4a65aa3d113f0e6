"""A generator that hangs or dies mid-run ends the real job (mpiexec, vLLM, Megatron) within its
configured bounds, with a message naming the generator, and leaves no process behind.

- stall: the generator's vLLM EngineCore is stopped (SIGSTOP) after a few steps. The generator's
  loop then blocks inside vLLM, so it neither reports nor takes the next weight update: the
  trainer raises either `GeneratorLostError` (it was waiting for rollouts) or `WeightSyncError`
  (it was publishing weights), whichever bound it meets first; both name the generator.
- kill: the generator rank itself is killed (SIGKILL, as when its node is lost); mpiexec ends the
  job. Nothing names the lost rank reliably yet: hydra tears the job down silently, and the
  rank's reaper says "rank 1 (generator, …) ended without a clean exit" a poll after the rank's
  end, by when mpiexec, which carried its output, is often gone (seen in two of two runs; the
  trainer's kill, tests/e2e/test_trainer_death.py, is named). The job's end within its bound and
  nothing left behind are what is checked.
- kill_all: every process of the job except the ranks' reapers is killed at once (launcher,
  mpiexec, its proxy, all ranks: as when the launching session is lost). Nobody is left to tear
  the job down, nor to read what a reaper says (its output went to the killed launcher); each
  rank's reaper (areal_hpc.reaper) kills its vLLM engine and other children, which would
  otherwise run on (vLLM's EngineCore does not always notice its parent's death): the proof is
  that nothing is left.
In every case the trainer trained no step after the fault beyond what it already held: at
most the η window (rollout.max_staleness + 1 steps) past the step the fault came at.
"""
import re
import signal
import time

import psutil
import pytest

BOUND_S = 20
ETA = 1         # configs/tiny_cpu.yaml's rollout.max_staleness
ARGS = [f"rollout.max_staleness={ETA}", "train.total_steps=400", "train.batch_prompts=3", "rollout.group_size=2",
        "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
        "checkpoint.every_steps=100", f"rollout.generator_timeout_s={BOUND_S}",
        "rollout.heartbeat_s=2", f"weights.timeout_s={BOUND_S}", "rollout.engine_restarts=0"]


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _find(jobs, needle):
    for p in jobs.processes():
        try:
            if needle in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


def _run_until(jobs, proc, run_dir, steps, timeout=600):
    deadline = time.time() + timeout
    while _steps_done(run_dir) < steps:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "the job made no progress"
        time.sleep(0.2)


def _no_leftovers(jobs):
    psutil.wait_procs(jobs.processes(), timeout=30)
    left = jobs.leftovers()
    for p in jobs.processes():      # do not let a failure here slow down the tests after it
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"processes of the job are still running: {left}"


@pytest.mark.parametrize("how", ["stall", "kill", "kill_all"])
def test_generator_failure_ends_the_job(jobs, tiny_model, tmp_path, how):
    run_dir = tmp_path / how
    proc = jobs.start(jobs.args(tiny_model, tmp_path, how, *ARGS))
    try:
        _run_until(jobs, proc, run_dir, 2)
        if how == "stall":
            victim = _find(jobs, "EngineCore")
            assert victim is not None, "no vLLM EngineCore process found"
            at = _steps_done(run_dir)           # the steps done as the fault comes
            victim.send_signal(signal.SIGSTOP)
        else:
            engine = _find(jobs, "EngineCore")
            assert engine is not None, "no vLLM EngineCore process found"
            victim = next(p for p in jobs.processes(ranks_only=True)
                          if engine in p.children(recursive=True))     # the generator rank
            everything = jobs.processes()        # notes the whole tree before the kill
            if how == "kill":
                at = _steps_done(run_dir)
                victim.kill()
            else:
                victims = [p for p in everything if "areal_hpc.reaper" not in " ".join(p.cmdline())
                           and "VLLM::" not in " ".join(p.cmdline())]
                assert len(victims) >= 5, victims     # launcher, mpiexec, proxy, 2 ranks
                at = _steps_done(run_dir)
                for p in victims:
                    p.kill()
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=BOUND_S + 180)
        ended_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps = _steps_done(run_dir)
    print(f"\n{how}: job ended {ended_s:.1f} s after the {how} (exit {proc.returncode}, "
          f"{steps} steps done)")
    assert proc.returncode != 0, out[-4000:]
    assert at <= steps <= at + ETA + 1, (at, steps)
    if how == "stall":
        errors = re.findall(r"(GeneratorLostError|WeightSyncError): (.*)", out)
        assert errors, out[-4000:]
        kind, message = errors[0]
        print(f"{kind}: {message}")
        assert re.search(r"generator rank 1 \(host \S+\)", message), message
        assert ended_s < BOUND_S + 120, ended_s
    else:
        assert ended_s < 120, ended_s
    _no_leftovers(jobs)
