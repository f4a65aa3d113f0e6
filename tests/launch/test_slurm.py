"""The Slurm path on a real local cluster (tools/local_slurm.sh: slurmctld, slurmdbd, 4 slurmd on
this host): the tiny job as a heterogeneous job through sbatch and through submitit, the batch
script's signal forwarding and requeue, and the GPU scripts' consistency with their configs."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.config import load
from areal_hpc.launch.placement import sbatch_components
from areal_hpc.launch.rehearse import step_sockets
from areal_hpc.launch.submit import Component, hetjob_layout
from areal_hpc.preemption import HOLD_HOOK_ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "slurm").glob("*.sh"))
RECIPES = sorted((ROOT / "slurm").glob("areal_*.sh"))
SMALL = ["train.total_steps=3", "train.batch_prompts=2", "rollout.group_size=2",
         "rollout.max_new_tokens=24", "data.eval_limit=6", "data.eval_samples=1"]


def _sh(*cmd, env=None, timeout=60, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert not check or r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r


def _client_env(status: str) -> dict:
    """os.environ plus what tools/local_slurm.sh's `up` or `status` says a client exports."""
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", status, re.M))
    assert "SLURM_CONF" in exports, status
    return {**os.environ, **exports}


@pytest.fixture(scope="session")
def slurm_env():
    """The environment of a Slurm client (SLURM_CONF) for the project's local cluster, brought up
    for this session unless one already runs (then it is left running)."""
    tool = str(ROOT / "tools/local_slurm.sh")
    status = _sh(tool, "status", check=False)
    started = status.returncode != 0
    if started:
        have = all(shutil.which(c) or os.path.exists(f"/usr/sbin/{c}") for c in ("slurmctld", "slurmd", "slurmdbd"))
        if not have and (os.geteuid() != 0 or shutil.which("apt-get") is None):
            pytest.skip("no local Slurm: tools/local_slurm.sh installs it with apt-get, which needs root")
        up = _sh(tool, "up", timeout=900, check=False)
        assert up.returncode == 0, (up.stdout, up.stderr[-4000:])
        status = up
    yield _client_env(status.stdout)
    if started:
        _sh(tool, "down", timeout=120, check=False)


def _model_args(model, out_dir, name):
    return [f"model.path={model}", f"data.train_path={model}/train.jsonl",
            f"data.eval_path={model}/heldout.jsonl", f"output_dir={out_dir}", f"name={name}"]


def _ranks_log_tail(run_dir, job, n: int = 3000) -> str:
    """The end of what the ranks of `job` printed (what explains a failed job)."""
    logs = sorted(Path(run_dir).glob(f"logs/job-{job}/attempt-*/ranks.log"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-n:]}" for p in logs) or "no ranks.log"


def _steps(run_dir) -> list[int]:
    import json
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sacct(env, job) -> dict[str, str]:
    """{JobID: State} of a job's het components and steps."""
    out = _sh("sacct", "-n", "-P", "-o", "JobID,State", "-j", str(job), env=env).stdout
    return dict(line.split("|")[:2] for line in out.splitlines() if line)


def _job(env, job) -> dict[str, str]:
    out = _sh("scontrol", "-o", "show", "job", str(job), env=env).stdout.splitlines()[0]
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _release(env, job):
    """Start a requeued job now, once its previous attempt is gone (the rehearsal's `release`)."""
    from areal_hpc.launch.rehearse import release
    release(str(job), env, timeout=120)


def _until(cond, timeout, what):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# --- no cluster needed ---------------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    _sh("bash", "-n", str(script))


def _sbatch_components(script: Path) -> tuple[str, list[Component]]:
    """The config a recipe script runs and its het components, read from its #SBATCH lines."""
    comps = sbatch_components(script.read_text())
    config = re.search(r"slurm/job\.sh (configs/\S+\.yaml)", script.read_text()).group(1)
    return config, [Component(int(c["nodes"]), int(c["ntasks-per-node"]), int(c.get("gpus-per-node", 0)))
                    for c in comps]


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_recipe_scripts_match_their_configs(script):
    """Component 0 holds exactly the config's trainer ranks (one GPU each), component 1 its
    generator ranks, as submit.py's hetjob_layout would lay them out."""
    config, comps = _sbatch_components(script)
    assert len(comps) == 2, "a trainer and a generator component"
    topo = load(ROOT / config, ["model.path=x", "data.train_path=x"]).topology
    trainers, generators = comps
    assert trainers.ntasks == topo.n_trainers and generators.ntasks == topo.n_generators
    gpus_per_generator = max(1, generators.gpus_per_node // generators.ntasks_per_node)
    assert hetjob_layout(topo, trainers.gpus_per_node, gpus_per_generator) == (trainers, generators)
    if trainers.gpus_per_node:          # AReaL's split: 3/4 of the GPUs generate
        gpus = [c.nodes * c.gpus_per_node for c in comps]
        assert gpus[1] == 3 * gpus[0], gpus


def test_hetjob_layout():
    topo = load(ROOT / "configs/qwen2_5_32b_math.yaml", ["model.path=x", "data.train_path=x"]).topology
    assert hetjob_layout(topo, 8, 8) == (Component(4, 8, 8), Component(12, 1, 8))
    assert hetjob_layout(topo, 8, 2) == (Component(4, 8, 8), Component(3, 4, 8))
    tiny = load(ROOT / "configs/tiny_cpu.yaml", ["topology.n_generators=2"]).topology
    assert hetjob_layout(tiny) == (Component(1, 1), Component(1, 2))
    assert hetjob_layout(tiny, 4) == (Component(1, 1, 4), Component(1, 2, 4))
    with pytest.raises(ValueError, match="do not fill whole nodes"):
        hetjob_layout(load(ROOT / "configs/tiny_cpu.yaml", ["topology.n_trainers=12"]).topology, 8)
    with pytest.raises(ValueError, match="do not divide"):
        hetjob_layout(topo, 8, 3)


@pytest.mark.parametrize("local", [[], ["--local"]], ids=["slurm", "local"])
def test_submit_bad_config_fails_before_submitting(tmp_path, local):
    r = _sh(sys.executable, "-m", "areal_hpc.launch.submit", "configs/tiny_cpu.yaml",
            f"model.path={tmp_path}/nope", f"output_dir={tmp_path}", *local, check=False)
    assert r.returncode == 2 and "no HF model at" in r.stderr and "Traceback" not in r.stderr


# --- on the local cluster --------------------------------------------------------------------------

def test_local_slurm_status(slurm_env):
    r = _sh(str(ROOT / "tools/local_slurm.sh"), "status")
    assert re.search(r"debug\*\s+up\s+infinite\s+\d+\s+(idle|mix|alloc)", r.stdout), r.stdout
    assert f"export SLURM_CONF={slurm_env['SLURM_CONF']}" in r.stdout


FAKE_RANK = """#!/usr/bin/env bash
# Stands in for python in slurm/job.sh: the launch.env step runs for real, the ranks are fakes that
# follow the contract of areal_hpc.main: on USR1, exit 3 ("checkpointed"); a later attempt finishes.
# A fake rank is one python process with no children, as a real rank is: a bash loop around
# `sleep` would let proctrack/linuxproc's walk of the task's processes signal the sleep alone.
if [ "$2" = areal_hpc.launch.env ]; then exec {python} "$@"; fi
exec {python} -c '
import os, pathlib, signal, sys, time
rank, attempt = os.environ["SLURM_PROCID"], os.environ.get("SLURM_RESTART_COUNT", "0")
node = os.environ["SLURMD_NODENAME"]
print(f"rank {{rank}} attempt {{attempt}} on {{node}}", flush=True)
if attempt != "0":
    sys.exit(0)
flags = pathlib.Path("{flags}")
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
(flags / f"started.{{rank}}").touch()
while not got:
    time.sleep(0.1)
print(f"rank {{rank}} got USR1", flush=True)
(flags / f"got.{{rank}}").touch()
# as the real ranks leave together (a collective checkpoint), a fake waits up to 60 s for the
# other to get the signal too: exit 3 is a bad exit to srun, which would end the other at once
for _ in range(600):
    if all((flags / f"got.{{r}}").exists() for r in "01"):
        break
    time.sleep(0.1)
sys.exit(3)
'
"""


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_usr1_is_forwarded_and_the_job_requeued(slurm_env, jobs, tiny_model, tmp_path, sig):
    """The batch shell's USR1 (what --signal=B:USR1@... sends before the time limit) or TERM reaches
    every rank as USR1 (srun would cancel the step on a TERM); ranks exiting with EXIT_PREEMPTED
    (3) make slurm/job.sh requeue the job, and the next attempt (SLURM_RESTART_COUNT=1) runs the
    same command with its own log folder. The release is not misled by another cluster's step
    daemon of the same job id (two local clusters run side by side in the suite)."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_RANK.format(python=sys.executable, flags=tmp_path))
    fake.chmod(0o755)
    out = tmp_path / "batch.out"
    env = {**jobs.env(slurm_env), "AREAL_PYTHON": str(fake)}
    job = _sh("sbatch", "--parsable", f"--output={out}", "slurm/areal_tiny.sh",
              *_model_args(tiny_model, tmp_path, "rq"), env=env).stdout.strip().split(";")[0]
    other = subprocess.Popen(["bash", "-c", f'exec -a "slurmstepd: [{job}.0]" sleep 600'])
    try:
        _until(lambda: all((tmp_path / f"started.{i}").exists() for i in (0, 1)), 120, "both ranks")
        assert step_sockets(job, slurm_env), "no step socket of the running job"
        _sh("scancel", "--batch", f"--signal={sig}", job, env=slurm_env)
        _until(lambda: _job(slurm_env, job).get("Restarts") == "1", 120, "the requeue")
        _release(slurm_env, job)
        _until(lambda: _job(slurm_env, job)["JobState"] == "COMPLETED", 120, "the second attempt")
        _until(lambda: not step_sockets(job, slurm_env), 60, "the step daemons' end")
    finally:
        other.kill()
        other.wait()
        subprocess.run(["scancel", job], env=slurm_env, capture_output=True)
    log = out.read_text(errors="replace")
    assert f"SIG{sig}: asking the ranks to checkpoint" in log and "requeueing job" in log, log
    assert "attempt 1" in log and log.rstrip().endswith("ranks ended with exit code 0"), log
    first = (tmp_path / f"rq/logs/job-{job}/attempt-0/ranks.log").read_text(errors="replace")
    assert "rank 0 got USR1" in first and "rank 1 got USR1" in first, first
    second = (tmp_path / f"rq/logs/job-{job}/attempt-1/ranks.log").read_text(errors="replace")
    nodes = re.findall(r"rank (\d) attempt 1 on (\S+)", second)
    assert len(nodes) == 2 and nodes[0][1] != nodes[1][1], second   # one rank per het component


PREEMPT_STEPS = 6


def _held_mark(run: Path) -> Path:
    return run.parent / (run.name + ".held")


def _held(env: dict, run: Path) -> dict:
    """`env` with the generator's test hook (preemption.HOLD_HOOK_ENV): the first attempt holds
    once a sample of weights version 1 has a token, so the signal always finds the job before its
    end (η = 1: at most 2 of PREEMPT_STEPS steps done); the requeued attempt runs free."""
    return {**env, HOLD_HOOK_ENV: f"1:1:{_held_mark(run)}"}


def _preempt_and_resume(env, run, job_id, signal_args, log) -> int:
    """Once the generator holds (`_held`): signal the job, wait for its requeue, release it, wait
    for the end. `job_id()` finds the job's id, `log()` reads what explains a failure. Returns
    the number of steps done when the job was requeued."""
    def running(cond):      # cond, failing at once if the job ended
        def check():
            state = _job(env, job_id())["JobState"] if job_id() else "PENDING"
            assert state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"), (state, log())
            return cond()
        return check
    _until(running(_held_mark(run).exists), 600, "the generator held after a step")
    job = job_id()
    try:
        _sh("scancel", *signal_args, job, env=env)
        _until(running(lambda: _job(env, job).get("Restarts") == "1"), 300, "the requeue")
        stopped_at = len(_steps(run))
        _release(env, job)
        _until(lambda: _job(env, job)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), 600,
               "the second attempt")
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
    assert _job(env, job)["JobState"] == "COMPLETED", log()
    assert 1 <= stopped_at < PREEMPT_STEPS
    assert _steps(run) == list(range(PREEMPT_STEPS)), _steps(run)
    return stopped_at


def test_preempted_tiny_job_resumes_after_requeue(slurm_env, jobs, tiny_model, tmp_path):
    """The real job, slurm/areal_tiny.sh: one trainer + one generator rank in a two-component
    hetjob, one MPI world over both. USR1 to the batch shell mid-run (as --signal=B:USR1@...
    sends it) → the ranks checkpoint at the next step boundary → slurm/job.sh requeues → the next
    attempt resumes and completes; every step appears once in metrics.jsonl, both components
    COMPLETED. (Also the plain sbatch run: its second attempt runs to the end.)"""
    out, run = tmp_path / "batch.out", tmp_path / "pre"
    small = [f"train.total_steps={PREEMPT_STEPS}", *SMALL[1:], "data.eval_limit=4"]
    job = _sh("sbatch", "--parsable", f"--output={out}", "slurm/areal_tiny.sh", *small,
              *_model_args(tiny_model, tmp_path, "pre"),
              env=_held(jobs.env(slurm_env), run)).stdout.strip()
    _preempt_and_resume(slurm_env, run, lambda: job, ["--batch", "--signal=USR1"], lambda: out.read_text(errors="replace"))
    log = out.read_text(errors="replace")
    assert "requeueing job" in log and f"job {job} attempt 1" in log, log
    assert "2 het component(s)" in log and "ranks ended with exit code 0" in log, log
    _until(lambda: {_sacct(slurm_env, job).get(f"{job}+{c}") for c in (0, 1)} == {"COMPLETED"}, 60,
           f"sacct: both components of {job} COMPLETED")
    ranks = (run / f"logs/job-{job}/attempt-1/ranks.log").read_text(errors="replace")
    assert re.search(r"^0: ", ranks, re.M) and re.search(r"^1: ", ranks, re.M)  # both components spoke
    assert (run / "rollouts.h5").exists()
    assert not jobs.leftovers(), "processes of the job are still running"


def test_preempted_submitit_job_resumes_after_requeue(slurm_env, jobs, tiny_model, tmp_path):
    """The same through `python -m areal_hpc.launch.submit` (submitit + the hetjob splice): USR1 to the ranks (as its --signal=USR1@... sends it) → main
    returns EXIT_PREEMPTED → run_rank requeues, leaving no result → the waiting submit process
    sees the requeued job finish."""
    run = tmp_path / "pre"
    small = [f"train.total_steps={PREEMPT_STEPS}", *SMALL[1:], "data.eval_limit=4"]
    proc = subprocess.Popen([sys.executable, "-m", "areal_hpc.launch.submit", "configs/tiny_cpu.yaml",
                             *small, *_model_args(tiny_model, tmp_path, "pre")],
                            cwd=ROOT, env=_held(jobs.env(slurm_env), run), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def job_id():
        pickles = list((run / "submitit").glob("*_submitted.pkl"))
        return pickles[0].name.split("_")[0] if pickles else None

    def log():
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run / "submitit").glob("*.out")))
    try:
        _preempt_and_resume(slurm_env, run, job_id, ["--signal=USR1"], log)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and f"exit code 0, {PREEMPT_STEPS} step(s)" in out, out[-3000:]
    job = job_id()
    folder = run / "submitit"
    rank0 = (folder / f"{job}_0_log.out").read_text(errors="replace")
    assert "[submit] preempted: requeueing job" in rank0, rank0[-3000:]
    assert "#SBATCH hetjob" in (folder / f"{job}_submission.sh").read_text()
    assert (folder / f"{job}_0_result.pkl").exists() and (folder / f"{job}_1_result.pkl").exists()
    assert (run / "rollouts.h5").exists()
    # The result is in before Slurm has finished the job: give it a moment.
    _until(lambda: {_sacct(slurm_env, job).get(f"{job}+{c}") for c in (0, 1)} == {"COMPLETED"}, 60,
           f"sacct: both components of {job} COMPLETED")
    assert not jobs.leftovers(), "processes of the job are still running"


# --- the GPU recipes on the simulated GPU cluster (tools/local_slurm.sh: 8 placeholder GPUs and
# 128 CPUs per fake node, as GRES; Slurm binds them as on a real cluster) -----------------------

GPU_RECIPES = [p for p in RECIPES if p.name != "areal_tiny.sh"]
DEVICE_PROBE = """import errno, glob, os
can = []
for f in sorted(glob.glob("{dev}/nvidia*"), key=lambda f: int(f.rsplit("nvidia", 1)[1])):
    try:
        os.close(os.open(f, os.O_RDWR))
        can.append(f.rsplit("nvidia", 1)[1])
    except OSError as exc:      # ENXIO: allowed, no driver behind the placeholder
        if exc.errno != errno.EPERM:
            can.append(f.rsplit("nvidia", 1)[1])
print("task", os.environ["SLURM_PROCID"], "opens", ",".join(can), flush=True)
"""
PLACED = re.compile(r"^(?:\d+:)?\s+rank\s+(\d+) (trainer|generator)\s+local (\d+)/(\d+)\s+(?:GPU (\S+) of (\d+)|no GPU)\s+"
                    r"cores unbound, (\d+) allocated \(asked (\d+)\)\s+iface (\S+)", re.M)


def _recipe_model(script: Path, tiny_model, tmp_path) -> Path:
    """A model directory for a recipe's dry run: the recipe model's config.json (shapes for the
    memory preflight), the tiny model's tokenizer, a weight index naming an empty shard (the
    dry run reads no weights)."""
    config = re.search(r"slurm/job\.sh (configs/\S+\.yaml)", script.read_text()).group(1)
    name = Path(str(load(ROOT / config, ["data.train_path=x"]).model.path)).name
    out = tmp_path / name
    out.mkdir()
    shutil.copy(ROOT / "configs/models" / name / "config.json", out)
    for f in Path(tiny_model).glob("tokenizer*"):
        shutil.copy(f, out)
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-1.safetensors"}}')
    (out / "model-1.safetensors").write_bytes(b"")
    return out


def _scaled_recipe(script: Path, tmp_path, tiny_model, edit=lambda text: text):
    """The recipe's batch script with each component on one node (its other #SBATCH options as
    they are), and the overrides that make its config's topology match: (script, args)."""
    config, (trainers, generators) = _sbatch_components(script)
    topo = load(ROOT / config, ["model.path=x", "data.train_path=x"]).topology
    n_t, n_g = trainers.ntasks_per_node, generators.ntasks_per_node
    pp = min(topo.pp, n_t // topo.tp)
    scaled = tmp_path / script.name
    scaled.write_text(edit(re.sub(r"--nodes=\d+", "--nodes=1", script.read_text())))
    model = _recipe_model(script, tiny_model, tmp_path)
    args = [f"model.path={model}", f"data.train_path={tiny_model}/train.jsonl", "data.eval_path=null",
            f"output_dir={tmp_path}", f"topology.n_trainers={n_t}", f"topology.n_generators={n_g}",
            f"topology.pp={pp}",
            # the memory plan, the step-time budget and the disk plan (1.3 TB of 32B checkpoints)
            # are for the full size, not this slice of it on this box
            "topology.gpu_mem_gib=0", "topology.gpu=''", "checkpoint.disk_margin_gb=null"]
    return scaled, args


MPI_VARS = re.compile(r"^(MPIR_CVAR|FI|UCX|I_MPI|OMPI_MCA|PMIX_MCA)_")


def _gpu_env(jobs, slurm_env):
    """The GPU recipes' environment here. The GPU software stack is not on this box: the version
    check is for the real cluster. No MPI variables of the client's (tools/local_slurm.sh's
    client_env runs the tiny jobs over OFI tcp): the MPI settings are slurm/site_gpu.sh's as
    shipped, what a user gets."""
    env = {k: v for k, v in jobs.env(slurm_env).items() if not MPI_VARS.match(k)}
    return {**env, "AREAL_PYTHON": sys.executable, "AREAL_SKIP_VERSION_CHECK": "1"}


@pytest.mark.parametrize("script", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipe_places_every_rank_on_its_own_gpus_and_cores(slurm_env, jobs, tiny_model, tmp_path, script):
    """Each GPU recipe's #SBATCH layout (one node per component) through sbatch and the real
    slurm/job.sh --dry-run: every rank reports the GPUs it took, disjoint on every node (1 per
    trainer rank, rollout.engine_tp per generator rank), and the CPUs its component asked for.
    The local cluster constrains devices as GPU sites do (task/cgroup, ConstrainDevices=yes): a
    task may open only the GPU device files it was given. job.sh binds no task to GPUs: every
    task is given its node's 8 and takes its own by local rank, so a trainer can open its TP/DP
    peers' GPUs (NCCL's P2P needs them). The 32B recipe's allocation also shows, with a probe
    that opens every device file: bound per task (`--gpus-per-task=1 --gpu-bind=per_task:1`,
    job.sh's binding before) each trainer task opens its own GPU alone (the others: EPERM), given
    the node's it opens all 8; and runs the placement under a plain `srun --het-group=0,1` (what
    submitit starts) and under the per-task binding, which it refuses naming why: Slurm numbers
    every task's one GPU 0 under the device cgroups.
    The MPI world starts under slurm/site_gpu.sh's MPI default as shipped (the MPICH wheel over
    OFI, srun --mpi=pmi2): 8 ranks per node in the 1.5B and 7B layouts, where MPICH's default UCX
    can fail under pmi2, the likelier the busier the box (areal_hpc/launch/mpi_env.py).
    (Cancelled at the end whatever happens, so no other test meets its processes.)"""
    config, comps = _sbatch_components(script)
    cpt = [int(re.findall(r"--cpus-per-task=(\d+)", script.read_text())[k]) for k in (0, 1)]
    plain = script.name == "areal_32b.sh"
    placement = '"$AREAL_PYTHON" -m mpi4py -m areal_hpc.launch.placement ' + config + ' "${@:2}"'
    probe = tmp_path / "devices.py"     # which placeholder GPU devices a task may open (EPERM: not)
    probe.write_text(DEVICE_PROBE.format(dev=Path(slurm_env["SLURM_CONF"]).parent.parent / "dev"))
    opens = (f'echo "devices: per-task"\nsrun --het-group=0 --gpus-per-task=1 --gpu-bind=per_task:1 '
             f'"$AREAL_PYTHON" {probe}\necho "devices: job.sh"\nsrun --het-group=0 "$AREAL_PYTHON" {probe}\n'
             'echo "devices: done"\n')
    edit = (lambda t: t.replace("exec bash slurm/job.sh", opens +
                                'srun --het-group=0,1 --mpi=pmi2 --kill-on-bad-exit=1 ' + placement + '\n'
                                'echo "per-task binding: the placement"\n'
                                'srun --het-group=0 --mpi=pmi2 --kill-on-bad-exit=1 --gpus-per-task=1 '
                                '--gpu-bind=per_task:1 ' + placement + ' : --het-group=1 --gpus-per-task=8 '
                                '--gpu-bind=per_task:8 ' + placement + ' 2>&1\n'
                                'echo "per-task binding: done"\n'
                                'exec bash slurm/job.sh')) if plain else (lambda t: t)
    scaled, args = _scaled_recipe(script, tmp_path, tiny_model, edit)
    engine_tp = load(ROOT / config, ["model.path=x", "data.train_path=x"]).rollout.engine_tp
    out = tmp_path / "batch.out"
    name = f"placement-{tmp_path.name}"
    try:
        r = _sh("sbatch", "--wait", f"--job-name={name}", f"--output={out}", str(scaled), "--dry-run",
                *args, env=_gpu_env(jobs, slurm_env), timeout=240, check=False)
    except subprocess.TimeoutExpired as exc:
        r = subprocess.CompletedProcess(exc.cmd, 124, "", "timed out")
    finally:
        _sh("scancel", "-n", name, env=slurm_env, check=False)
    log = out.read_text(errors="replace") if out.exists() else ""
    assert r.returncode == 0, (r.stderr[-2000:], log[-4000:])
    assert "GPUs: each task sees its node's GPUs and takes its own by local rank" in log
    if plain:       # the device cgroups (ConstrainDevices=yes): what each trainer task can open
        per_task, _, rest = log.partition("devices: per-task")[2].partition("devices: job.sh")
        shared = rest.partition("devices: done")[0]
        opened = [dict((int(t), g) for t, g in re.findall(r"^task (\d+) opens (\S*)$", part, re.M))
                  for part in (per_task, shared)]
        assert opened[0] == {t: str(t) for t in range(8)}, per_task   # its own GPU: peers' EPERM
        assert opened[1] == {t: "0,1,2,3,4,5,6,7" for t in range(8)}, shared   # every GPU of its node
    if plain:       # the per-task binding: each trainer given its GPU alone, flagged
        before, _, rest = log.partition("per-task binding: the placement")
        bound, _, after = rest.partition("per-task binding: done")
        offered = [(m[1], int(m[5])) for m in PLACED.findall(bound)]
        assert [n for role, n in offered if role == "trainer"] == [1] * 8, bound[-3000:]
        # under the device cgroups every task's one GPU is "0": refused, the renumbering named
        assert re.search(r"error: placement: node1: GPU 0 is given to rank 0 and rank 1 \(each was "
                         r"given only its own GPUs: under ConstrainDevices=yes Slurm numbers every "
                         r"task's GPUs from 0", bound), bound[-3000:]
        assert "error: placement" not in before + after
        log = before + after
    runs = log.split("dry run: the placement")
    assert len(runs) == 2, log[-3000:]
    assert "MPI: srun --mpi=pmi2; FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi\n" in log, log[-3000:]   # the site file's alone
    srun_line = runs[1].splitlines()[0]
    trainers_opts = srun_line.split(" : ")[0] + " "
    assert f"--cpus-per-task={cpt[0]} " in trainers_opts and "--gpu" not in srun_line, srun_line
    assert f"--cpus-per-task={cpt[1]})" in srun_line.split(" : ")[1], srun_line
    for i, part in enumerate(runs if plain else runs[1:]):
        placed = [(int(rk), role, int(lr), int(ls), g.split(",") if g else [], int(alloc), int(asked), iface)
                  for rk, role, lr, ls, g, of, alloc, asked, iface in PLACED.findall(part)]
        given = {int(rk): int(of) for rk, role, lr, ls, g, of, *_ in PLACED.findall(part) if of}
        n_t = comps[0].ntasks_per_node
        assert all(given[rk] == 8 for rk in range(n_t)), given     # a trainer sees its node's GPUs
        assert all(given[rk] == 8 for rk in given if rk >= n_t), given    # a generator too
        n_t, n_g = comps[0].ntasks_per_node, comps[1].ntasks_per_node
        assert [p[0] for p in placed] == list(range(n_t + n_g)), part[-3000:]
        assert "GPUs disjoint on every node" in part and "rendezvous: " in part
        for rk, role, lr, ls, gpus, alloc, asked, iface in placed:
            assert role == ("trainer" if rk < n_t else "generator")
            assert len(gpus) == (1 if role == "trainer" else engine_tp), (rk, gpus)
            assert asked == cpt[rk >= n_t] and iface == "auto"
            if i == len(runs) - 1 or not plain:     # job.sh's step: exactly the component's -c
                assert alloc == asked, (rk, alloc, asked)
        for role, n in (("trainer", n_t), ("generator", n_g)):   # one node per role: disjoint
            held = [g for p in placed if p[1] == role for g in p[4]]
            assert sorted(held, key=int) == [str(g) for g in range(len(held))] and len(held) <= 8, held


def test_plan_placement_reads_the_clusters_cores_from_sinfo(slurm_env, tmp_path):
    """`python -m areal_hpc.plan placement` asks the local cluster's sinfo for each node's CPUs
    (128): the 7B recipe fits; with 24 CPUs per task (192 per node) it is refused in one line per
    component naming the recipe's numbers."""
    plan = [sys.executable, "-m", "areal_hpc.plan", "placement", "configs/qwen2_5_7b_math.yaml",
            "model.path=x", "data.train_path=x", "--script"]
    n = len(_sh("sinfo", "-h", "-N", "-o", "%N", env=slurm_env).stdout.split())
    r = _sh(*plan, "slurm/areal_7b.sh", env=slurm_env)
    assert f"nodes x CPUs (sinfo): component 0: {n} x 128; component 1: {n} x 128" in r.stdout, r.stdout
    big = tmp_path / "areal_7b.sh"
    big.write_text((ROOT / "slurm/areal_7b.sh").read_text().replace("--cpus-per-task=12", "--cpus-per-task=24"))
    r = _sh(*plan, str(big), env=slurm_env, check=False)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: placement: het component {k}: {nodes} node(s) of 8 task(s) x 24 CPU(s) = 192 CPU(s) each, "
        f"but sinfo lists 0 node(s) with that many (nodes x CPUs: {n} x 128)" for k, nodes in ((0, 4), (1, 12))], r.stderr


def test_overlapping_gpu_layout_is_refused_before_any_rank_starts(slurm_env, jobs, tiny_model, tmp_path):
    """The 32B recipe with two 8-GPU engines asked per 8-GPU node: job.sh refuses in one line,
    before srun starts a rank."""
    script = ROOT / "slurm/areal_32b.sh"
    lines = script.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH --nodes"))
    lines[last] = lines[last].replace("--ntasks-per-node=1", "--ntasks-per-node=2").replace(
        "--cpus-per-task=96", "--cpus-per-task=48")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / script.name).write_text("\n".join(lines) + "\n")
    scaled, args = _scaled_recipe(bad / script.name, tmp_path, tiny_model)
    out = tmp_path / "batch.out"
    r = _sh("sbatch", "--wait", f"--output={out}", str(scaled), *args, env=_gpu_env(jobs, slurm_env),
            timeout=600, check=False)
    log = out.read_text(errors="replace")
    assert r.returncode != 0, log
    errors = [line for line in log.splitlines() if "error" in line]
    assert len(errors) == 1 and "het component 1 (generators) runs 2 task(s) per node x 8 GPU(s) each " \
        "but has 8 GPU(s) per node" in errors[0], log
    assert not list(tmp_path.glob("*/logs/job-*/attempt-*/ranks.log")), "no rank may have started"
