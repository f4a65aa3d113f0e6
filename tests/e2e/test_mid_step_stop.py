"""A step stopped midway (checkpoint.mid_step_stop) in the real job (mpiexec, vLLM, Megatron,
HDF5), two trainer ranks (data parallel: the decision is collective): the test hook raises the
preemption flag after minibatch 1 of step AT while the job's end (SLURM_JOB_END_TIME) is already
past. The job restores the step's start state, puts its batch
back in the buffer, checkpoints at AT and exits 3; the rerun trains the rest, and the audit
finds nothing lost and nothing trained twice."""
import json
import re
import subprocess
import sys
import time


from areal_hpc.preemption import TEST_HOOK_ENV
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import RolloutReader

STEPS, B, N, AT = 4, 3, 2, 2
ARGS = [f"train.total_steps={STEPS}", f"train.batch_prompts={B}", f"rollout.group_size={N}",
        "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
        "checkpoint.every_steps=0", "train.ppo_minibatches=2", "tensorboard=false",
        "topology.n_trainers=2"]


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_step_stopped_midway_is_kept_and_retrained(jobs, tiny_model, tmp_path):
    # Rewards that differ within every group: the barely pre-trained model answers nothing right,
    # and a batch without learning signal skips its step whole (no decision point to stop at).
    # Not a function of the text: a group's two samples cut at max_new_tokens often have equal
    # lengths (CI at fc9d054: step AT's batch scored all-equal within each group and the hook
    # never fired).
    fn = tmp_path / "spread.py"
    fn.write_text("import random\n"
                  "def spread(completion, reference, row):\n"
                  "    return random.random()\n")
    args = jobs.args(tiny_model, tmp_path, "mid", *ARGS, f"reward.fn={fn}:spread")
    run_dir = tmp_path / "mid"
    env = jobs.env()
    env[TEST_HOOK_ENV] = f"{AT}:1"
    env["SLURM_JOB_END_TIME"] = str(int(time.time()) + 5)     # past by then: cannot be met
    proc = subprocess.run([sys.executable, *args], cwd=jobs.root, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]
    assert "preemption signal pending during step" not in out      # no step went on
    m = re.search(rf"step {AT} abandoned after 1 of 2 minibatches: a preemption signal came .* "
                  rf"left before the job's end \(SLURM_JOB_END_TIME\).*; the step's start state "
                  rf"restored, its {B} groups back in the buffer \(prompts ([\d ]+)\)", out)
    assert m, out[-4000:]
    prompts = {int(p) for p in m.group(1).split()}
    assert len(prompts) == B
    assert [x["step"] for x in _metrics(run_dir)] == list(range(AT))
    path, meta = ck.find_latest(run_dir)
    assert meta["step"] == AT                       # the steps completed before the stopped one
    ctrl = ck.read_state(path / ck.STATE)["controller"]
    with RolloutReader(run_dir / "rollouts.h5") as r:
        pid = r.column("prompt_id")
    buffered = pid[ctrl.buffer_rows].tolist()
    for p in prompts:                               # each group whole in the buffer
        assert buffered.count(p) == N, (p, buffered)

    rerun = subprocess.run([sys.executable, *args], cwd=jobs.root, env=jobs.env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    assert f"resuming from {ck.step_dir(run_dir, AT)}" in rerun.stdout
    assert [x["step"] for x in _metrics(run_dir)] == list(range(STEPS))
    with RolloutReader(run_dir / "rollouts.h5") as r:
        pid, consumed = r.column("prompt_id"), r.column("consumed_step")
    for p in prompts:                               # trained after all, once, from step AT
        steps = consumed[(pid == p) & (consumed >= 0)].tolist()
        assert len(steps) == N and min(steps) >= AT, (p, steps)
    audit = subprocess.run([sys.executable, "tools/audit_run.py", str(run_dir)], cwd=jobs.root,
                           text=True, capture_output=True, timeout=300)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]
    assert not jobs.leftovers(), "processes of the job are still running"
