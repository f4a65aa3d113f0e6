"""Per-rank entry point: `python -m mpi4py -m areal_hpc.main CONFIG.yaml [key=value ...]`.

Every rank loads and validates the config (and checks the input paths and the installed
torch / vLLM / Megatron-core releases) before MPI work starts, so a bad config or environment
ends all ranks with one clear message. MPI is imported inside `main()` only: vLLM's
spawned engine processes re-import this module and must not join the MPI job.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .preemption import EXIT_PREEMPTED  # 3: stopped for a requeue after a preemption signal
from .storage.run_dir import RunDir


def _parse(argv):
    ap = argparse.ArgumentParser(prog="areal_hpc.main", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="recipe YAML (e.g. configs/tiny_cpu.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.total_steps=5")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    from .config import ConfigError
    from .preflight import rank as preflight
    rank_env = (os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
                or os.environ.get("SLURM_PROCID") or "0")
    try:
        cfg = preflight(args.config, args.overrides)     # on this rank's node
    except (ConfigError, FileNotFoundError) as exc:
        if rank_env == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2

    export_only = False
    if cfg.checkpoint.resume == "auto":     # a rerun of a finished run: nothing to start
        from .storage.checkpoint import find_latest
        from .train.hf_export import is_complete
        found = find_latest(cfg.run_dir, check_crc=False)
        if found and found[1]["step"] >= cfg.train.total_steps:
            if is_complete(RunDir(cfg.run_dir).policy, found[1]["step"]):
                if rank_env == "0":
                    print(f"run {cfg.name} is already complete ({found[1]['step']} steps, "
                          f"{found[0]}); raise train.total_steps to continue it, or choose "
                          f"another name=...", flush=True)
                return 0
            # trained and checkpointed, but its policy/ export is missing or incomplete: the
            # trainer ranks export it from the final checkpoint (no training, no generation)
            export_only = True
            if rank_env == "0":
                print(f"run {cfg.name} is complete ({found[1]['step']} steps, {found[0]}) but "
                      f"its policy/ export is missing or incomplete: exporting it only",
                      flush=True)

    # A killed job's MPICH segments on this node: a requeued job's MPI start-up would take them
    # for its own (same names) and fail or hang in MPI_Init (reaper.SHM_PREFIX says why).
    from .reaper import remove_stale_segments
    stale = remove_stale_segments()
    if stale:
        print(f"[rank {rank_env}] removed {len(stale)} MPI shared-memory segment(s) left on this "
              f"node by a killed job ({', '.join(os.path.basename(p) for p in stale[:4])}"
              f"{', ...' if len(stale) > 4 else ''})", file=sys.stderr, flush=True)
    from mpi4py import MPI

    from .topology import CONTROLLER_RANK, Topology
    from .transport import mpi as coll
    coll.set_default_timeout(cfg.rollout.collective_timeout_s)     # bounds every MPI collective
    world = MPI.COMM_WORLD
    logging.basicConfig(level=logging.WARNING, datefmt="%H:%M:%S",
                        format=f"%(asctime)s [rank {world.Get_rank()}] %(name)s: %(message)s")
    logging.getLogger("areal_hpc").setLevel(logging.INFO)
    try:
        topo = Topology.build(cfg.topology, world, engine_tp=cfg.rollout.engine_tp)
    except ConfigError as exc:
        if world.Get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    # Trainer rank 0's sign of life: the waits for its work (the first batch after the initial
    # evaluation, the final checkpoint) are bounded by it, not by a number of seconds.
    from .transport.beacon import Beacon
    beacon = Beacon(world, CONTROLLER_RANK, topo.hosts, cfg.rollout.heartbeat_s,
                    cfg.rollout.generator_timeout_s)
    topo.controller_alive = beacon.watch
    try:
        code, agreed = _run(cfg, topo, world, export_only)
    finally:
        beacon.stop()       # its thread makes MPI calls: stopped before MPI is finalized
    if code and agreed:
        # Every rank agreed on this code: finalize, or `python -m mpi4py` turns the non-zero
        # exit into MPI_Abort and srun reports the step as killed (137) instead of 3.
        MPI.Finalize()
    return code


def _run(cfg, topo, world, export_only: bool) -> tuple[int, bool]:
    """This rank's part, once the world and the beacon are up: (exit code, whether every rank
    reached the end with it; else a non-zero code aborts the job)."""
    from . import preemption, reaper
    from .config import to_yaml
    from .topology import TRAINER
    from .transport import mpi as coll
    # Every rank's GPUs (CUDA_VISIBLE_DEVICES narrowed to its own), cores and interface, checked
    # together on rank 0 before torch or vLLM touch a device: a wrong layout stops here.
    from .launch.placement import gather_and_check
    _, _, problems = gather_and_check(world, cfg.topology, cfg.rollout.engine_tp, topo.rank, topo.role,
                                      topo.controller_addr)
    if problems:
        if world.Get_rank() == 0:
            print(f"error: placement: {problems[0]}" + (f" (and {len(problems) - 1} more; "
                  f"slurm/job.sh --dry-run prints the table)" if len(problems) > 1 else ""),
                  file=sys.stderr, flush=True)
        # every rank has the verdict: none leaves before rank 0 has said why (an early exit
        # would abort the world first), and all exit 2 together
        coll.barrier(world, what="start-up: the placement refused")
        return 2, True
    from .cpus import bind_rank, check_cpus, format_cpus
    try:
        check_cpus(cfg.topology)
        cpus = bind_rank(cfg.topology, topo.role, topo.local_rank, topo.local_size)
    except ValueError as exc:
        print(f"error: rank {world.Get_rank()} on {topo.hosts[world.Get_rank()]}: {exc}", file=sys.stderr)
        return 2, False
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
        from .train.trainer import run_export, run_trainer
        code = run_export(cfg, topo) if export_only else run_trainer(cfg, topo)
    elif export_only:
        code = 0
    else:
        from .preflight import generator_node
        from .rollout.generator import run_generator
        with preemption.shield_children():      # the sandbox's probe must outlive a USR1
            generator_node(cfg)     # this node, before the generator's children: the code sandbox
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
