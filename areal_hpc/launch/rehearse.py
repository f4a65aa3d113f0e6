"""A dress rehearsal of a GPU recipe on the simulated Slurm cluster: its real training path at its
layout's structure, scaled to what one CPU box holds.

    python -m areal_hpc.launch.rehearse slurm/areal_32b.sh --model models/tiny --out runs/rehearse
    (tools/rehearse.sh RECIPE brings the namespaced 4-node cluster up and builds the model first)

What runs: `sbatch` of the recipe's own batch script, with only its #SBATCH node and task counts
scaled (its other options, `source slurm/site_gpu.sh` and `exec bash slurm/job.sh` unchanged), so
slurm/job.sh starts `areal_hpc.main` (not a dry run) in one MPI world over both het components,
with the shipped site file's MPI and environment. The layout keeps the recipe's structure:

- each component on 2 nodes (on the namespaced cluster every node is a host of its own: nothing
  works through one host name or loopback);
- the trainer's TP, PP and DP each min(recipe's, 2), so every parallel dimension the recipe has is
  there (32B: TP 2 x PP 2 x DP 2 = 8 ranks, 4 a node), with the recipe's distributed optimizer,
  sequence parallelism and recompute; a vLLM engine of min(rollout.engine_tp, 2) workers;
  generator ranks per node min(recipe's, 2);
- the recipe's algorithm (objective, minibatches, staleness, checkpoint cadence) as it is; the
  model is the tiny Qwen2 (4 heads, 2 KV heads, 2 layers: legal for TP 2, PP 2 and an engine of 2
  workers), the task the tiny one, lengths and batch shrunk, on CPU with gloo;
- the preflight on: the config at its scaled size with the version check against this CPU stack;
  and, before anything is submitted, the memory plan and the time budget of the recipe at its real
  size on its GPU (`full_scale_preflight`).

It trains a few steps, gets USR1 at the batch shell mid-run (what --signal=B:USR1@... sends),
checkpoints, is requeued by job.sh, resumes, finishes, exports policy/, and the audit of the
run's files must pass (`tools/audit_run.py`). What only a GPU can show (NCCL, CUDA binding of
the ranks, the real step time, memory at size) is listed in the README's "Dress rehearsal".
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import load
from ..plan import check_fits, estimate
from ..plan.budget import check_time
from ..slurm_job import lead_from_script, parse_slurm_time
from ..storage.run_dir import RunDir, RunFileError
from .placement import sbatch_components

ROOT = Path(__file__).resolve().parents[2]
NODES = 2           # nodes per het component


@dataclass(frozen=True)
class Layout:
    """The rehearsal's layout of one recipe."""
    config: str                 # the recipe's config, as its batch script names it
    tp: int
    pp: int
    dp: int
    engine_tp: int
    trainers_per_node: int
    generators_per_node: int

    @property
    def n_trainers(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_generators(self) -> int:
        return NODES * self.generators_per_node


def recipe_config(script_text: str) -> str:
    m = re.search(r"slurm/job\.sh (configs/\S+\.yaml)", script_text)
    if not m:
        raise ValueError("not a recipe batch script: no `slurm/job.sh configs/....yaml` line")
    return m.group(1)


def layout(script_text: str) -> Layout:
    """The scaled layout of the recipe `script_text` runs (its config read from the repository)."""
    config = recipe_config(script_text)
    cfg = load(ROOT / config, ["model.path=x", "data.train_path=x"])
    t = cfg.topology
    dp = t.n_trainers // (t.tp * t.pp)
    tp, pp, dp2 = min(t.tp, 2), min(t.pp, 2), min(dp, 2)
    per_node = int(sbatch_components(script_text)[1].get("ntasks-per-node", 1))
    return Layout(config, tp, pp, dp2, min(cfg.rollout.engine_tp, 2),
                  trainers_per_node=max(1, tp * pp * dp2 // NODES),
                  generators_per_node=min(per_node, 2))


def scaled_script(script_text: str, lay: Layout) -> str:
    """The batch script with each component's --nodes and --ntasks-per-node scaled; every other
    line as it is."""
    out, comp = [], 0
    for line in script_text.splitlines():
        if line.startswith("#SBATCH") and line.split()[1:] == ["hetjob"]:
            comp += 1
        elif line.startswith("#SBATCH") and "--nodes=" in line:
            per = lay.trainers_per_node if comp == 0 else lay.generators_per_node
            line = re.sub(r"--nodes=\d+", f"--nodes={NODES}", line)
            line = re.sub(r"--ntasks-per-node=\d+", f"--ntasks-per-node={per}", line)
        out.append(line)
    return "\n".join(out) + "\n"


# Rewards that differ within a group whatever the model knows: a barely trained tiny model answers
# nothing right, and a batch without learning signal skips its optimizer steps (no gradient
# through TP, PP and DP to rehearse). Float32-exact values, as the rollout log stores them.
REWARD_FN = "def by_length(completion, reference, row):\n    return (len(completion) % 7) / 8\n"


def overrides(lay: Layout, model: Path, out_dir: Path, name: str, steps: int) -> list[str]:
    """The config overrides: the scaled topology, the tiny model and task, short lengths, CPU, a
    reward with signal (`REWARD_FN`, written to out_dir)."""
    fn = out_dir / "by_length.py"
    fn.write_text(REWARD_FN)
    return [f"reward.fn={fn}:by_length",
        f"name={name}", f"output_dir={out_dir}",
        f"model.path={model}", "model.dtype=float32",
        f"data.train_path={model}/train.jsonl", f"data.eval_path={model}/heldout.jsonl",
        'data.prompt_template="{question}"', "data.eval_limit=8", "data.eval_samples=1",
        f"topology.n_trainers={lay.n_trainers}", f"topology.tp={lay.tp}", f"topology.pp={lay.pp}",
        f"topology.n_generators={lay.n_generators}", "topology.device=cpu",
        "topology.trainer_backend=gloo", "topology.weight_backend=gloo",
        # the memory plan and the time budget are for the recipe's real size (full_scale_preflight)
        "topology.gpu=''", "topology.gpu_mem_gib=0",
        f"rollout.engine_tp={lay.engine_tp}", "rollout.group_size=4", "rollout.max_new_tokens=24",
        "rollout.max_model_len=256", "rollout.max_concurrent_prompts=16", "rollout.kv_cache_gib=1",
        "rollout.enforce_eager=true", "rollout.max_num_seqs=null",
        "rollout.max_num_batched_tokens=null",
        f"train.total_steps={steps}", "train.batch_prompts=4", "train.max_tokens_per_mb=2048",
        "train.lr=3.0e-4", "checkpoint.every_steps=1", "tensorboard=false",
    ]


def full_scale_preflight(script_text: str) -> list[str]:
    """The memory plan and the time budget of the recipe at its real size on its GPU, with its
    batch script's clock (--time, the USR1 lead): one line each. ConfigError if refused."""
    config = recipe_config(script_text)
    # the recipe's own model path: the memory model falls back to configs/models/<name>/config.json
    cfg0 = load(ROOT / config)
    lead = lead_from_script(script_text, list(cfg0.checkpoint.signals))
    limit = parse_slurm_time(re.search(r"--time=(\S+)", script_text).group(1))
    cfg = load(ROOT / config, [f"checkpoint.signal_lead_s={lead}", f"checkpoint.time_limit_s={limit}"])
    check_fits(cfg)
    plan = estimate(cfg)
    worst, gen = plan.worst_stage().total / 2**30, plan.generator.total / 2**30
    warned: list[str] = []
    est = check_time(cfg, env={}, warn=warned.append)
    return [f"memory: the busiest trainer GPU ~{worst:.1f} GiB, a generator GPU ~{gen:.1f} GiB, "
            f"of topology.gpu_mem_gib = {cfg.topology.gpu_mem_gib:g} (python -m areal_hpc.plan "
            f"memory {config})",
            f"time: a step ~{est.step_s / 3600:.2f} h on {est.gpu.name} at MFU {est.mfu:g}, its "
            f"checkpoint {est.ckpt_s:.0f} s, within the {lead:.0f} s USR1 lead; every fixed wait "
            f"covers its work (python -m areal_hpc.plan time {config})", *warned]


# -- driving the job on a Slurm cluster ------------------------------------------------------------

def _sh(*cmd, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def job_info(job: str, env=None) -> dict[str, str]:
    """`scontrol show job` of one job as a dict ({} once Slurm has forgotten it)."""
    r = _sh("scontrol", "-o", "show", "job", str(job), env=env)
    if r.returncode != 0 or not r.stdout.strip():
        return {}
    return dict(kv.split("=", 1) for kv in r.stdout.splitlines()[0].split() if "=" in kv)


def until(cond, timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def step_sockets(job: str, env=None) -> list[Path]:
    """The sockets the step daemons of `job`'s attempts hold open in this cluster's slurmd spool
    folders (`<node>_<job>.<step>`, made at a step's start, removed at its end), for both
    components of a hetjob (job, job + 1). By name only: another cluster on this host numbers
    its jobs from 1 too, so its `slurmstepd: [1.0]` says nothing about this one's job 1."""
    pattern = _spool_pattern((os.environ if env is None else env).get("SLURM_CONF", ""))
    return [s for c in (0, 1) for s in Path("/").glob(f"{pattern}/*_{int(job) + c}.*")
            if s.is_socket()]


@functools.lru_cache(maxsize=8)
def _spool_pattern(slurm_conf: str) -> str:
    """The glob (relative to /) of every slurmd spool folder of the cluster `slurm_conf` names
    (its SlurmdSpoolDir, %n and %h any node), asked once per cluster: the waits poll it."""
    env = {**os.environ, "SLURM_CONF": slurm_conf} if slurm_conf else None
    conf = _sh("scontrol", "show", "config", env=env).stdout
    spool = re.search(r"^SlurmdSpoolDir\s*=\s*(\S+)", conf, re.M)
    if spool is None:
        raise RuntimeError(f"no SlurmdSpoolDir in `scontrol show config`:\n{conf[-2000:]}")
    return spool[1].replace("%n", "*").replace("%h", "*").lstrip("/")


def release(job: str, env=None, timeout: float = 180) -> None:
    """Start a requeued job now instead of after Slurm's BeginTime hold (~120 s), once its
    previous attempt's step daemons are gone (released earlier, the new attempt is killed with
    "Job credential revoked"). A job that started by itself meanwhile is left as it is."""
    started = ("RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")

    def settled():
        state = job_info(job, env).get("JobState")
        return state in started or (state == "PENDING" and not step_sockets(job, env))
    until(settled, timeout, f"job {job} back in the queue")
    if job_info(job, env).get("JobState") != "PENDING":
        return
    # slurmd revokes the ended attempt's credential with a time stamp in whole seconds, and
    # refuses a launch whose credential is not newer: a start within that second is killed
    time.sleep(2.0)
    _sh("scontrol", "update", f"jobid={job}", "starttime=now", env=env)


def last_lines(ranks_log: str) -> list[str]:
    """The last line each rank wrote to an `srun --label` log (progress bars left out): where
    each one was when a wait on the job ran out."""
    last: dict[int, str] = {}
    for line in ranks_log.splitlines():
        label, sep, rest = line.partition(": ")
        if sep and label.strip().isdigit() and rest.strip() and "\r" not in rest \
                and not rest.lstrip().startswith(("train:", "gen:")):
            last[int(label)] = line[:300]
    return [last[r] for r in sorted(last)]


def steps_done(run: Path) -> list[int]:
    """The steps metrics.jsonl holds so far ([] before the first, or while a line is being
    written: the caller polls again)."""
    try:
        return [m["step"] for m in RunDir(run).read_metrics()]
    except RunFileError:
        return []


def rehearse(script: Path, model: Path, out_dir: Path, steps: int = 4, env=None,
             timeout: float = 1500, say=print) -> dict:
    """Submit the scaled recipe, USR1 it once a step is done, release its requeue, wait for the
    end, audit the run. Returns what happened (job id, steps at the stop, attempts, audit exit
    code, the log paths); raises on a failure with the log's end."""
    # site_gpu.sh's default is the python3 on PATH; the ranks need this environment's
    env = {**(os.environ if env is None else env)}
    env.setdefault("AREAL_PYTHON", sys.executable)
    text = script.read_text()
    for line in full_scale_preflight(text):
        say(f"[rehearse] full scale: {line}")
    lay = layout(text)
    nodes = _sh("sinfo", "-h", "-N", "-o", "%N", env=env).stdout.split()
    if len(set(nodes)) < 2 * NODES:
        raise RuntimeError(f"the cluster has {len(set(nodes))} node(s); the rehearsal needs "
                           f"{2 * NODES} (AREAL_SLURM_NETNS=1 tools/local_slurm.sh up {2 * NODES})")
    out_dir.mkdir(parents=True, exist_ok=True)
    scaled = out_dir / script.name
    scaled.write_text(scaled_script(text, lay))
    name = f"rehearse-{script.stem}"
    run = out_dir / name
    say(f"[rehearse] {script.name}: trainer TP {lay.tp} x PP {lay.pp} x DP {lay.dp} = "
        f"{lay.n_trainers} ranks on {NODES} nodes, {lay.n_generators} generator ranks on {NODES} "
        f"nodes (vLLM TP {lay.engine_tp}); output {run}")
    batch_out = out_dir / "batch.out"
    t0 = time.monotonic()
    r = _sh("sbatch", "--parsable", f"--job-name={name}", f"--output={batch_out}", str(scaled),
            *overrides(lay, model, out_dir, name, steps), env=env, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"sbatch failed: {r.stderr.strip()[-2000:]}")
    job = r.stdout.strip().split(";")[0]

    def log_tail() -> str:
        parts = [batch_out.read_text(errors="replace")[-3000:] if batch_out.exists() else ""]
        for log in sorted(run.glob(f"logs/job-{job}/attempt-*/ranks.log")):
            text = log.read_text(errors="replace")
            parts += [f"--- {log}\n{text[-4000:]}", "--- each rank's last line:", *last_lines(text)]
        return "\n".join(parts)

    def alive(cond):
        def check():
            state = job_info(job, env).get("JobState", "")
            if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "COMPLETED"):
                raise RuntimeError(f"job {job} ended ({state}) before the preemption\n{log_tail()}")
            return cond()
        return check
    try:
        until(alive(lambda: len(steps_done(run)) >= 1), timeout, "the first step")
        _sh("scancel", "--batch", "--signal=USR1", job, env=env)
        signalled = len(steps_done(run))
        say(f"[rehearse] USR1 to job {job} after {signalled} step(s) "
            f"({time.monotonic() - t0:.0f} s)")
        until(alive(lambda: job_info(job, env).get("Restarts") == "1"), timeout, "the requeue")
        stopped = len(steps_done(run))
        release(job, env)
        until(lambda: job_info(job, env).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
              timeout, "the second attempt")
    except TimeoutError as exc:      # where the job was when the wait ran out, not just that it did
        info = job_info(job, env)
        nodes = _sh("sinfo", "-h", "-N", "-o", "%N %T %E", env=env).stdout.strip()
        raise TimeoutError(f"job {job}: {exc}; JobState={info.get('JobState')} "
                           f"Reason={info.get('Reason')} Restarts={info.get('Restarts')}; nodes:\n"
                           f"{nodes}\n{log_tail()}") from None
    finally:
        _sh("scancel", job, env=env)
    state = job_info(job, env).get("JobState")
    if state != "COMPLETED":
        raise RuntimeError(f"job {job}: {state}\n{log_tail()}")
    audit = _sh(sys.executable, "tools/audit_run.py", str(run), env=env, timeout=300)
    result = {"job": job, "run": str(run), "stopped_at": stopped, "signalled_at": signalled,
              "steps": steps_done(run), "seconds": round(time.monotonic() - t0),
              "audit": audit.returncode, "audit_out": audit.stdout[-3000:] + audit.stderr[-2000:],
              "layout": lay, "batch_out": str(batch_out)}
    say(f"[rehearse] job {job} COMPLETED in {result['seconds']} s: preempted after {stopped} "
        f"step(s), resumed, {len(result['steps'])} steps in metrics.jsonl; audit exit {audit.returncode}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="areal_hpc.launch.rehearse", description=__doc__.splitlines()[0])
    ap.add_argument("recipe", type=Path, help="a GPU recipe's batch script, e.g. slurm/areal_32b.sh")
    ap.add_argument("--model", type=Path, default=ROOT / "models/tiny", help="the tiny model's directory")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/rehearse")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    try:
        res = rehearse(args.recipe.resolve(), args.model.resolve(), args.out.resolve(), args.steps)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"[rehearse] error: {exc}", file=sys.stderr)
        return 1
    print(res["audit_out"])
    return 0 if res["audit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
