"""The trainer side of a weight update: one object owns it, from the plan to the outcome.

Every trainer rank holds a `WeightPublisher` and calls `publish(version)` after each step; the
call is collective over the trainer ranks, and what a rank does in it depends on its place:

    stage sender (dp = tp = 0 of stage s)   gathers stage s's HF tensors with its TP peers and
                                            broadcasts them in buckets over the weight group
                                            (or writes them as safetensors files, disk mode)
    its TP peers (dp = 0, tp > 0)           join that gather: `iter_hf_weights` is a collective
                                            over the TP group, so they run it and send nothing
    other data-parallel replicas            hold the same weights: only the outcome
    trainer rank 0 (the controller)         announces the update to the generators, waits for
                                            their acknowledgements, decides the outcome

and every rank ends with the same outcome: the update done, a `WeightSyncError` naming the
generators that did not take it, or, during a preemption, "go on to the stop and checkpoint".

The plan (which tensors go in which bucket from which stage) is computed once, collectively, at
the first update: shapes never change during a run. The wire formats are in
`areal_hpc.transport.weights` (plan, broadcast, disk, acknowledgements).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from typing import Protocol

from .. import preemption
from ..storage.run_dir import RunDir
from ..transport import mpi as coll
from ..transport import weights as wsync

log = logging.getLogger(__name__)

# Test hook: a weight sender stops itself (SIGSTOP) halfway through the tensors of this weights
# version, so that a trainer stall lands inside a broadcast at a moment chosen, not hoped for
# (tests/e2e/test_trainer_death.py).
STOP_IN_BROADCAST_ENV = "AREAL_TEST_STOP_IN_BROADCAST"


def _test_stop(tensors, plan: wsync.Plan, version: int):
    """`tensors`, with the hook's stop halfway through them at its version."""
    if os.environ.get(STOP_IN_BROADCAST_ENV) != str(version):
        yield from tensors
        return
    half = sum(len(bucket) for _, bucket in plan) // 2
    for i, item in enumerate(tensors):
        if i == half:
            log.warning("test hook %s: stopping this rank halfway through sending weights v%d",
                        STOP_IN_BROADCAST_ENV, version)
            os.kill(os.getpid(), signal.SIGSTOP)
        yield item

# Sends of one version at most: the first, and again over a re-formed weight group after a
# generator's engine failed in it (each such failure also counts against that generator's
# rollout.engine_restarts).
SENDS = 3


class WeightNotifier(Protocol):
    """Who tells the generators about an update and collects their acknowledgements: trainer
    rank 0's `Controller`; `SILENT` on every other rank (and in tests that play the generator
    themselves)."""
    collects_acks: bool

    def regroup(self, force: bool = False) -> int | None: ...

    def send_weights_notice(self, version: int, *, plan=None, path: str | None = None,
                            generation: int | None = None) -> None: ...

    def wait_weights_acks(self, version: int, timeout_s: float,
                          cause: BaseException | None = None) -> bool: ...


class _Silent:
    """The notifier of a rank that announces nothing and waits for no acknowledgement."""
    collects_acks = False

    def regroup(self, force: bool = False) -> int | None:
        return None

    def send_weights_notice(self, version: int, *, plan=None, path: str | None = None,
                            generation: int | None = None) -> None:
        pass

    def wait_weights_acks(self, version: int, timeout_s: float,
                          cause: BaseException | None = None) -> bool:
        return False


SILENT: WeightNotifier = _Silent()


class WeightPublisher:
    """Publish the actor's weights to the generators, one version at a time.

    Args:
        cfg: the run's `weights` section (mode, bucket_mb, timeout_s, disk_dir).
        actor: this rank's `Actor` (its stage, its place in the TP group, its HF weights).
        comm: the trainer ranks' communicator (every collective of the update runs over it).
        pp: pipeline stages (one sender each).
        collective_timeout_s: bounds the collectives of an update among live peers.
        weight_dir: where disk mode writes its versions.
        alive: trainer rank 0's liveness (`beacon.RankWatch`; None: `collective_timeout_s`):
            bounds the other ranks' wait for the outcome, which comes after rank 0's waits.
        group: the weight group, on stage senders in broadcast mode (else None).
        notifier: announces the update and collects the acknowledgements (`WeightNotifier`:
            trainer rank 0's `Controller`; `SILENT` elsewhere).
    """

    def __init__(self, cfg, actor, comm, *, pp: int, collective_timeout_s: float,
                 weight_dir: str, group=None, notifier: WeightNotifier = SILENT, address=None,
                 alive=None):
        self.cfg, self.actor, self.comm, self.alive = cfg, actor, comm, alive
        self.pp, self.collective_timeout_s = pp, collective_timeout_s
        self.weight_dir, self.group, self.notifier = weight_dir, group, notifier
        self.address = address      # the weight group's, for its later generations (senders)
        self._plan: wsync.Plan | None = None

    @classmethod
    def for_trainer(cls, cfg, topo, actor, notifier: WeightNotifier = SILENT) -> "WeightPublisher":
        """The trainer's publisher: stage senders join the weight group (weight rank = stage)."""
        w, t = cfg.weights, cfg.topology
        group = address = None
        if w.mode == "broadcast" and actor.is_weight_sender:
            address = topo.weight_group_address(w)
            group = wsync.init_weight_group(address, actor.weight_stage)
        return cls(w, actor, topo.role_comm, pp=t.pp,
                   collective_timeout_s=cfg.rollout.collective_timeout_s,
                   weight_dir=w.disk_dir or str(RunDir(cfg.run_dir).weights), group=group,
                   notifier=notifier, address=address,
                   alive=topo.controller_alive)

    # -- the plan -------------------------------------------------------------------------------
    def plan(self) -> wsync.Plan:
        """The update plan (collective the first time): each stage's sender lists its HF
        tensors, trainer rank 0 buckets them per stage, every trainer rank gets the plan."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> wsync.Plan:
        a = self.actor
        specs = None
        if a.weight_stage is not None:      # TP peers gather along with their sender
            specs = [(k, tuple(v.shape), wsync.dtype_to_str(v.dtype)) for k, v in a.iter_hf_weights()]
        sent = coll.gather(self.comm, (a.weight_stage, specs) if a.is_weight_sender else None,
                           root=0, timeout_s=self.collective_timeout_s,
                           what="weight plan: each stage's tensor list")
        plan = None
        if self.comm.Get_rank() == 0:
            by_stage = dict(x for x in sent if x is not None)
            plan = wsync.plan_stages([by_stage[s] for s in range(self.pp)], self.cfg.bucket_mb << 20)
        return coll.bcast(self.comm, plan, root=0, timeout_s=self.collective_timeout_s,
                          what="weight plan")

    # -- one update -----------------------------------------------------------------------------
    def publish(self, version: int) -> float:
        """Send `version` to every generator and wait until each runs it; returns the seconds.

        Collective over the trainer ranks. If a generator does not acknowledge within
        `weights.timeout_s`, or a collective times out, every trainer rank raises the same
        `WeightSyncError` naming the generators (rank, host) instead of hanging. During a
        preemption a failed update returns normally on every rank: the job goes on to its
        checkpoint, and the resumed job publishes these weights first."""
        t0 = time.monotonic()
        plan = self.plan()
        for attempt in range(1, SENDS + 1):
            # A generator waiting for weights (a new engine), or the last attempt's failure:
            # the group's next generation is formed first (rank 0 decides for every rank).
            generation = coll.bcast(self.comm, self.notifier.regroup(force=attempt > 1), root=0,
                                    timeout_s=self.collective_timeout_s,
                                    what=f"weight update to version {version}: the group")
            error = None
            try:
                self._send(version, plan, generation)
            except Exception as exc:            # rank 0 names the generators; all raise below
                log.error("weight update to version %d failed on this rank: %s", version, exc)
                error = exc
            failure, stopping, again = self._acknowledged(version, error)
            # Rank 0 arrives after the broadcast and the acknowledgements (each bounded by
            # weights.timeout_s; while a generator restarts its engine, by weights.join_timeout_s
            # too): the others wait for it as long as it is alive (its beacon), not a number of
            # seconds, which could end a healthy job first.
            message, stopping, again = coll.bcast(
                self.comm, (None if failure is None else str(failure), stopping, again), root=0,
                timeout_s=self.collective_timeout_s,
                what=f"weight update to version {version}: its outcome", alive=self.alive)
            if not (again and attempt < SENDS and not stopping):
                break
            log.warning("weight update to version %d: a generator's engine failed in it; sending "
                        "it again over a re-formed weight group (attempt %d of %d)", version,
                        attempt + 1, SENDS)
        if again and failure is None and message is None:
            message = (f"weight update to version {version}: generators still wait for it after "
                       f"{SENDS} sends over re-formed weight groups")
        if stopping:        # every rank goes on to the stop and its checkpoint (rank 0 decides)
            log.warning("weight update to version %d failed during a preemption (%s): going on "
                        "to stop and checkpoint; the resumed job publishes these weights first",
                        version, message)
            return time.monotonic() - t0
        if failure is not None:
            raise failure
        if message is not None:
            raise wsync.WeightSyncError(message) from error
        if error is not None:
            raise error
        return time.monotonic() - t0

    def _send(self, version: int, plan: wsync.Plan, generation: int | None = None) -> None:
        """This rank's part of moving the tensors (see the module docstring's table); a
        stage sender joins the weight group's `generation` first, when it is re-formed."""
        a, w = self.actor, self.cfg
        stage = a.weight_stage
        if w.mode == "broadcast":
            self.notifier.send_weights_notice(version, plan=plan, generation=generation)
            if a.is_weight_sender and generation is not None:
                wsync.close_weight_group(self.group)
                self.group = None
                self.group = wsync.init_weight_group(replace(self.address, generation=generation),
                                                     stage)
            if a.is_weight_sender:
                wsync.broadcast_stage(self.group, plan, stage,
                                      _test_stop(a.iter_hf_weights(), plan, version), a.device,
                                      w.timeout_s)
            elif stage is not None:
                self._join_gather()
            return
        if a.is_weight_sender:
            wsync.write_stage(self.weight_dir, version, plan, stage, a.iter_hf_weights())
        elif stage is not None:
            self._join_gather()
        coll.barrier(self.comm, w.timeout_s,      # every stage's files are in place
                     what=f"weight update to version {version}: files written")
        self.notifier.send_weights_notice(version, path=str(wsync.version_dir(self.weight_dir, version)))

    def _join_gather(self) -> None:
        """A TP peer of a stage sender: take part in gathering the stage's full tensors (each
        one is a collective over the TP group) without sending anything. Skipping this would
        leave the sender waiting in its first gather."""
        join_gather(self.actor.iter_hf_weights(), self.cfg.bucket_mb << 20)

    def _acknowledged(self, version: int, error: BaseException | None) -> tuple:
        """Rank 0: wait for every generator to run `version`; returns (failure, stopping,
        again: send it again over a re-formed group). Every other rank: (None, False, False);
        rank 0's outcome reaches it in `publish`."""
        if not self.notifier.collects_acks:
            return None, False, False
        w = self.cfg
        # A preemption's TERM reaches vLLM's processes too, which die mid-update: no grace for
        # acknowledgements then, the job is stopping and the checkpoint is what counts.
        grace = 0.0 if error is not None and preemption.requested() else w.timeout_s
        failure, again = None, False
        try:
            again = bool(self.notifier.wait_weights_acks(version, grace, error))
        except wsync.WeightSyncError as exc:
            failure = exc
        if failure is None and not again and w.mode == "disk":
            wsync.prune_versions(self.weight_dir, keep=version)
        return failure, failure is not None and preemption.requested(), again


def join_gather(tensors, bound_bytes: int) -> int:
    """Drain a TP peer's side of a stage's gathering iterator ((name, tensor) pairs), waiting
    for the device every `bound_bytes` of gathered tensors; returns the bytes gathered.

    On NCCL a gather returns as soon as it is enqueued, and its output stays reserved until the
    collective completes, which needs the stage's sender (busy sending each bucket to the
    generators, or writing the export) to join it: a peer that only drops the tensors would run
    ahead by up to the whole stage's full weights (7 GiB at 32B). Synchronising its stream every
    bucket bounds that to about one bucket (plan/memory.py counts it so). A no-op wait on CPU,
    where gloo's collectives are blocking."""
    total = since = 0
    for _, tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        total, since = total + n, since + n
        if since >= bound_bytes and tensor.is_cuda:
            import torch
            torch.cuda.current_stream(tensor.device).synchronize()
            since = 0
    return total
