"""Submit a recipe as one heterogeneous Slurm job through submitit, wait for it and report.

    python -m areal_hpc.launch.submit CONFIG.yaml [key=value ...] [--local] [--no-wait]
        [--partition P] [--time-min M] [--gpus-per-node G] [--gpus-per-generator K]
        [--cpus-per-task C] [--signal-delay-s S]

The job is the one the slurm/ batch scripts build: het component 0 holds topology.n_trainers
tasks, component 1 topology.n_generators tasks, and one step `srun --het-group=0,1 --mpi=pmi2
--kill-on-bad-exit=1` runs every rank in one MPI world. Each task runs `run_rank`, which is
`areal_hpc.main` (after `preflight.launcher` on the submitting host). With --local, or where
there is no `sbatch`, the same recipe runs through the local launcher (mpiexec) instead.

submitit has no API for heterogeneous jobs; `HetSlurmExecutor` splices `#SBATCH hetjob` and the
generator component's lines into the batch file submitit writes, and `HetSlurmJob` reads the
leader's state from sacct (which names the components J+0, J+1; submitit asks for J and would
otherwise see UNKNOWN forever for a failed job). submitit's log folder here has no %j in it, so
component 1's output path (where %j is the component's own id, J+1) needs no folder made first.

Preemption and requeue. Slurm sends SIGUSR1 to the ranks `--signal-delay-s` before the time
limit (and SIGTERM on preemption or scancel). `areal_hpc.main` agrees across ranks to stop at the
next step boundary, checkpoints, and returns EXIT_PREEMPTED (3). `run_rank` then has global
rank 0 run `scontrol requeue` and every rank exit without a result, so submitit keeps waiting on
the same job id; the next attempt unpickles the same call and `main` resumes from the checkpoint.
submitit's own mechanism (a `checkpoint()` method called from its signal handler on rank 0
alone, then an immediate requeue) cannot wait for a step boundary on every rank, so it is used
only as the fallback for a signal that arrives before `main` has installed its handler:
SUBMITIT_PREEMPT_SIGNAL=USR1 makes submitit's handler requeue the job from the last checkpoint.
A requeued job waits about two minutes on BeginTime before Slurm starts it again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from .. import main as entry
from ..config import ConfigError, TopologyConfig
from ..preemption import EXIT_PREEMPTED
from ..preflight import launcher
from ..storage.run_dir import RunDir
from . import local
from .env import export_lines


@dataclass(frozen=True)
class Component:
    """One het component: `nodes` × `ntasks_per_node` ranks, `gpus_per_node` GPUs (0 on CPU)."""
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int = 0

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node


def _pack(ranks: int, per_node: int, gpus_per_node: int, what: str) -> Component:
    per_node = min(ranks, per_node)
    if ranks % per_node:
        raise ConfigError(f"config key 'topology.n_{what}s': {ranks} {what} ranks do not fill whole "
                          f"nodes of {per_node}")
    return Component(ranks // per_node, per_node, gpus_per_node)


def hetjob_layout(topo: TopologyConfig, gpus_per_node: int = 0,
                  gpus_per_generator: int = 1) -> tuple[Component, Component]:
    """(trainer component, generator component) for a topology. On CPU (gpus_per_node = 0) each
    role fits on one node. On GPUs a trainer rank owns one GPU and a generator rank (one vLLM
    engine, its own TP inside) `gpus_per_generator`; nodes are filled whole."""
    if gpus_per_node == 0:
        return Component(1, topo.n_trainers), Component(1, topo.n_generators)
    if gpus_per_generator < 1 or gpus_per_node % gpus_per_generator:
        raise ConfigError(f"{gpus_per_generator} GPUs per generator do not divide {gpus_per_node} "
                          f"GPUs per node")
    return (_pack(topo.n_trainers, gpus_per_node, gpus_per_node, "trainer"),
            _pack(topo.n_generators, gpus_per_node // gpus_per_generator, gpus_per_node, "generator"))


def run_rank(config: str, overrides: list[str]) -> int:
    """One task of the job: `areal_hpc.main`; after a checkpoint on a signal, requeue (see the
    module docstring) and leave no result behind."""
    try:
        rc = entry.main([config, *overrides])
    except BaseException:
        # What `python -m mpi4py` does: a rank that fails aborts the MPI job at exit, instead of
        # waiting in MPI_Finalize while the others wait for it in a collective.
        from mpi4py.run import set_abort_status
        set_abort_status(1)
        raise
    if rc == EXIT_PREEMPTED:
        import submitit
        env = submitit.JobEnvironment()
        if env.global_rank == 0:
            print(f"[submit] preempted: requeueing job {env.job_id}", flush=True)
            subprocess.run(["scontrol", "requeue", env.job_id], check=False, timeout=60)
        sys.exit(rc)    # SystemExit: submitit writes no result pickle for this attempt
    return rc


def _slurm_classes():
    """The executor and job classes, built on first use so that --local needs no submitit."""
    from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

    class HetInfoWatcher(SlurmInfoWatcher):
        def read_info(self, string):
            info = super().read_info(string)
            for key, stats in list(info.items()):
                if key.endswith("+0"):              # the leader component stands for the job
                    info.setdefault(key[:-2], stats)
            return info

    class HetSlurmJob(SlurmJob):
        watcher = HetInfoWatcher(delay_s=30)

    class HetSlurmExecutor(SlurmExecutor):
        job_class = HetSlurmJob

        def __init__(self, folder, het_lines: list[str], **kwargs):
            super().__init__(folder, **kwargs)
            self.het_lines = het_lines

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            lines = super()._make_submission_file_text(command, uid).split("\n")
            last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
            return "\n".join([*lines[:last + 1], "#SBATCH hetjob", *self.het_lines, *lines[last + 1:]])

    return HetSlurmExecutor


def _sbatch_line(**options) -> str:
    return "#SBATCH " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in options.items() if v is not None)


def submit(args) -> int:
    cfg = launcher(args.config, args.overrides)
    per_gen = cfg.rollout.engine_tp if args.gpus_per_generator is None else args.gpus_per_generator
    if args.gpus_per_node and per_gen != cfg.rollout.engine_tp:
        raise ConfigError(f"--gpus-per-generator {per_gen} differs from the recipe's "
                          f"rollout.engine_tp = {cfg.rollout.engine_tp} (vLLM workers per engine, "
                          f"one GPU each); set rollout.engine_tp={per_gen} instead")
    trainers, generators = hetjob_layout(cfg.topology, args.gpus_per_node, per_gen)
    folder = (cfg.run_dir / "submitit").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    signal = f"USR1@{args.signal_delay_s}"
    common = dict(time=args.time_min, partition=args.partition, cpus_per_task=args.cpus_per_task)
    gpus = {"gpus_per_node": generators.gpus_per_node} if generators.gpus_per_node else {}
    executor = _slurm_classes()(folder, het_lines=[_sbatch_line(
        nodes=generators.nodes, ntasks_per_node=generators.ntasks_per_node, signal=signal, **gpus, **common)])
    executor.update_parameters(
        job_name=f"areal-{cfg.name}", nodes=trainers.nodes, ntasks_per_node=trainers.ntasks_per_node,
        gpus_per_node=trainers.gpus_per_node or None, signal_delay_s=args.signal_delay_s,
        stderr_to_stdout=True,
        srun_args=["--het-group=0,1", f"--mpi={args.mpi}", "--kill-on-bad-exit=1"],
        # srun (Slurm >= 22.05) does not inherit --cpus-per-task: without this every rank of
        # the step would be bound to one core. Both components ask for the same count here.
        setup=[*export_lines(cfg), "export SUBMITIT_PREEMPT_SIGNAL=USR1",
               f"export SRUN_CPUS_PER_TASK={args.cpus_per_task}"],
        additional_parameters={"requeue": True, "signal": signal}, **common)
    job = executor.submit(run_rank, args.config, list(args.overrides))
    print(f"[submit] job {job.job_id}: {trainers.ntasks} trainer + {generators.ntasks} generator "
          f"rank(s) on {trainers.nodes} + {generators.nodes} node(s); logs in {folder}", flush=True)
    if args.no_wait:
        return 0
    try:
        rc = job.result()
    except Exception as exc:    # submitit: the job failed or was cancelled; its error is in the log
        print(f"[submit] job {job.job_id} ended as {job.state}: {str(exc).strip()[-3000:]}", file=sys.stderr)
        return 1
    metrics = RunDir(cfg.run_dir).metrics
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    print(f"[submit] job {job.job_id} {job.state}: exit code {rc}, {len(steps)} step(s) in {metrics}",
          flush=True)
    return rc


def _parse(argv):
    ap = argparse.ArgumentParser(prog="areal_hpc.launch.submit", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="recipe YAML (e.g. configs/tiny_cpu.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.total_steps=5")
    ap.add_argument("--local", action="store_true", help="run with mpiexec on this machine")
    ap.add_argument("--no-wait", action="store_true", help="submit and return")
    ap.add_argument("--partition", default=None)
    ap.add_argument("--time-min", type=int, default=60, help="time limit of one attempt, minutes")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="0 = CPU nodes")
    ap.add_argument("--gpus-per-generator", type=int, default=None,
                    help="GPUs of one vLLM engine (default: the recipe's rollout.engine_tp)")
    ap.add_argument("--cpus-per-task", type=int, default=1)
    ap.add_argument("--signal-delay-s", type=int, default=120,
                    help="SIGUSR1 this long before the time limit: checkpoint and requeue")
    ap.add_argument("--mpi", default=os.environ.get("AREAL_SRUN_MPI", "pmi2"), help="srun --mpi plugin")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.local or shutil.which("sbatch") is None:
        if not args.local:
            print("[submit] no sbatch on PATH: running locally with mpiexec", flush=True)
        return local.main([args.config, *args.overrides])
    try:
        return submit(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
