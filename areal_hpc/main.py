"""Per-rank entry point: `python -m mpi4py -m areal_hpc.main CONFIG.yaml [key=value ...]`.

Every rank loads and validates the config (and checks the input paths and the installed
torch / vLLM / Megatron-core releases) before MPI work starts, so a bad config or environment
ends all ranks with one clear message (`_refused`: a refused start's one path). MPI is imported
once the checks pass (`_mpi_world`), never at import: vLLM's spawned engine processes re-import
this module and must not join the MPI job.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import preemption, preflight, reaper
from .config import ConfigError, to_yaml
from .cpus import format_cpus
from .preemption import EXIT_PREEMPTED  # 3: stopped for a requeue after a preemption signal
from . import stuck
from .reward.contain import protect_from_children
from .storage import disk
from .storage.run_dir import RunDir
from .topology import CONTROLLER_RANK, TRAINER, Topology
from .transport import mpi as coll
from .transport.beacon import Beacon, thread_level_problem


def _parse(argv):
    ap = argparse.ArgumentParser(prog="areal_hpc.main", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="recipe YAML (e.g. configs/tiny_cpu.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.total_steps=5")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    protect_from_children()     # as root: no environment or reward child reaches a rank's memory
    world = None
    try:
        cfg = preflight.rank(args.config, args.overrides)     # on this rank's node
        hdf5 = disk.locking_warning(cfg.run_dir)      # a start that no launcher prepared
        if hdf5 and _rank() == 0:
            print(f"warning: {hdf5}", file=sys.stderr, flush=True)
        todo, said = preflight.what_to_run(cfg)
        if said and _rank() == 0:
            print(said, flush=True)
        if todo == preflight.DONE:
            return 0
        world = _mpi_world(cfg)
        topo = Topology.build(cfg.topology, world, engine_tp=cfg.rollout.engine_tp)
        cpus = preflight.placed(cfg, topo, world)
        problem = thread_level_problem(world, CONTROLLER_RANK, topo.hosts)
        if problem:
            raise preflight.Refused(problem, every_rank=False)
    except (ConfigError, FileNotFoundError) as exc:
        return _refused(exc, world)
    # Trainer rank 0's sign of life: the waits for its work (the first batch after the initial
    # evaluation, the final checkpoint) are bounded by it, not by a number of seconds.
    beacon = Beacon(world, CONTROLLER_RANK, topo.hosts, cfg.rollout.heartbeat_s,
                    cfg.rollout.generator_timeout_s)
    topo.controller_alive = beacon.watch
    # A rank alive but stuck is named (areal_hpc/stuck.py): armed when the trainer's or the
    # generator's loop starts, after the start-up (whose waits have bounds of their own).
    stuck.configure(cfg.rollout.progress_timeout_s, world.Get_rank(), topo.role,
                    topo.hosts[world.Get_rank()], stuck.flag_path(cfg.run_dir))
    try:
        code, agreed = _run(cfg, topo, world, cpus, export_only=todo == preflight.EXPORT)
    finally:
        stuck.stop()
        beacon.stop()       # its thread makes MPI calls: stopped before MPI is finalized
    if code and agreed:
        _finalize()
    return code


def _rank() -> int:
    """This rank's number in the job, from the launcher's environment (before MPI starts)."""
    return int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
               or os.environ.get("SLURM_PROCID") or 0)


def _mpi_world(cfg):
    """MPI started, every collective bounded, logging named by rank: the world communicator."""
    # A killed job's MPICH segments on this node: a requeued job's MPI start-up would take them
    # for its own (same names) and fail or hang in MPI_Init (reaper.SHM_PREFIX says why).
    stale = reaper.remove_stale_segments()
    if stale:
        print(f"[rank {_rank()}] removed {len(stale)} MPI shared-memory segment(s) left on this "
              f"node by a killed job ({', '.join(os.path.basename(p) for p in stale[:4])}"
              f"{', ...' if len(stale) > 4 else ''})", file=sys.stderr, flush=True)
    from mpi4py import MPI

    coll.set_default_timeout(cfg.rollout.collective_timeout_s)     # bounds every MPI collective
    world = MPI.COMM_WORLD
    logging.basicConfig(level=logging.WARNING, datefmt="%H:%M:%S",
                        format=f"%(asctime)s [rank {world.Get_rank()}] %(name)s: %(message)s")
    logging.getLogger("areal_hpc").setLevel(logging.INFO)
    return world


def _refused(exc: Exception, world) -> int:
    """The one error path of a refused start: exit 2 with one line. A verdict every rank
    reached is said by rank 0 (before MPI starts every rank checks the same config; after, a
    preflight.Refused with every_rank); once MPI has started, such ranks leave together
    (none before rank 0 has said why: an early exit would abort the world first) and
    finalize. Any other is said by the rank that found it, and its exit ends the job."""
    every = exc.every_rank if isinstance(exc, preflight.Refused) else True
    rank = _rank() if world is None else world.Get_rank()
    if rank == 0 or not every:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if every and isinstance(exc, preflight.Refused):        # raised once MPI had started
        coll.barrier(world, what="start-up: the start refused")
        _finalize()
    return 2


def _finalize() -> None:
    """Every rank agreed on a non-zero exit code: finalize, or `python -m mpi4py` turns it into
    MPI_Abort and srun reports the step as killed (137) instead of the code."""
    from mpi4py import MPI
    MPI.Finalize()


def _run(cfg, topo, world, cpus, export_only: bool) -> tuple[int, bool]:
    """This rank's part, once the world and the beacon are up: (exit code, whether every rank
    reached the end with it; else a non-zero code aborts the job)."""
    if cpus is not None:
        print(f"rank {world.Get_rank()} ({topo.role}): CPUs {format_cpus(cpus)}, {len(cpus)} "
              f"compute thread(s)", flush=True)
    if topo.is_controller:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        RunDir(cfg.run_dir).config.write_text(to_yaml(cfg))
        print(f"run {cfg.name}: {cfg.topology.n_trainers} trainer + {cfg.topology.n_generators} "
              f"generator rank(s), output in {cfg.run_dir}", flush=True)
    # However this rank ends, its child processes (vLLM engine, reward workers) end with it.
    reaper.start(f"rank {world.Get_rank()} ({topo.role}, host {topo.hosts[world.Get_rank()]})")
    # A preemption signal only sets a flag: trainer rank 0 acts on it between steps. Generators
    # install it after their engines are up (preemption.shield_children).
    preemption.install(cfg.checkpoint.signals)
    if topo.role == TRAINER:
        from .train.trainer import run_export, run_trainer  # torch, Megatron: trainers only
        code = run_export(cfg, topo) if export_only else run_trainer(cfg, topo)
    elif export_only:
        code = 0
    else:
        from .rollout.generator import run_generator  # vLLM: imported by generators only
        with preemption.shield_children():      # the sandbox's probe must outlive a USR1
            preflight.generator_node(cfg)     # this node, before the generator's children: the code sandbox
        code = run_generator(cfg, topo)
    # Every rank but trainer rank 0 waits here for its final evaluation, checkpoint and export:
    # as long as rank 0 is alive (the beacon); rank 0 waits for the others within the bound.
    coll.barrier(world, what=f"end of job ({topo.role} rank {topo.role_rank} finished, code {code})",
                 alive=topo.controller_alive)
    if code == EXIT_PREEMPTED and world.Get_rank() == 0:
        print(f"run {cfg.name}: preempted; rerun the same command (or let Slurm requeue) to "
              f"resume from the newest checkpoint (or from the start if none was written)",
              flush=True)
    return code, True


if __name__ == "__main__":
    sys.exit(main())
