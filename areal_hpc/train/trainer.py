"""The trainer ranks' loop (trainer rank 0 also runs the controller).

    evaluate the initial policy on held-out prompts
    for step in 0..total_steps-1:
        batch ← controller: B groups, each at most η versions old   (generators never wait)
            split on rank 0 (advantages, minibatches, data-parallel shares); each trainer rank
            receives only its data-parallel share
        decoupled-PPO update on the share (π_prox, ppo_minibatches steps); a preemption signal
            with too little time left for the rest of the step stops it midway (the step's
            start state restored, its batch back in the buffer): checkpoint.mid_step_stop
        version += 1; send the HF-named weights to every generator engine (one sender per
            pipeline stage) and wait until all of them run the new version
    evaluate the final policy; stop generators; checkpoint; export the policy (HF, streamed)

The loop reads the same on every trainer rank: rank 0's duties (the controller, metrics,
evaluations, TensorBoard, progress) sit behind `self.lead` (train/lead.py), which does nothing on
the other ranks; the weight update behind `self.publisher` (train/weight_publisher.py).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from .. import preemption, stuck
from ..config import RunConfig, to_yaml
from ..plan.memory import read_arch
from ..rollout.staleness import Batch
from ..storage import disk
from ..storage.run_dir import RunDir, is_complete
from ..topology import Topology
from ..transport import messages as msgs
from ..transport import mpi as coll
from . import checkpoint, hf_export
from .actor import Actor, StepAbandoned
from .layout import ParallelLayout, trainer_layout
from .lead import lead_of
from .mid_step import MidStepJudge
from .shares import BatchShare, split_batch
from .weight_publisher import WeightPublisher

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo, self.run_dir = cfg, topo, RunDir(cfg.run_dir)
        self.actor = make_actor(cfg, trainer_layout(topo, cfg.train.seed))
        self.version = 0
        # what the mid-step decision knows of the time things take (this attempt; rank 0's clock)
        self.judge = MidStepJudge(lambda signal_at: preemption.job_end(cfg, signal_at))
        self._hook = preemption.test_hook()
        t0 = time.monotonic()
        self.resumed = self._resume() if cfg.checkpoint.resume == "auto" else None
        if self.resumed:
            self.judge.checkpoint_s = time.monotonic() - t0
        self.lead = lead_of(cfg, topo, self.resumed["controller"] if self.resumed else None)
        self.publisher = WeightPublisher.for_trainer(cfg, topo, self.actor, self.lead.weight_notifier)
        # The stage senders have joined the weight group, which waits for the generators' vLLM
        # engines to start (minutes): the others wait here, polling, as long as rank 0 is alive,
        # not in the blocking (spinning, unbounded) communicator splits of the batch route.
        coll.barrier(topo.role_comm, what="trainer start-up (the weight group waits for the "
                     "generators' engines)", alive=topo.controller_alive)
        # each batch: rank 0 -> one rank per data-parallel rank -> its TP/PP peers
        self.shares = coll.GroupScatter(topo.role_comm, group=self.actor.layout.dp_rank,
                                        timeout_s=self.timeout_s,
                                        what="the trainer's batch route")

    @property
    def timeout_s(self) -> float:
        """The bound of every collective wait among the trainer ranks that no beacon bounds."""
        return self.cfg.rollout.collective_timeout_s

    # -- checkpoints ------------------------------------------------------------------------------
    def _resume(self) -> dict | None:
        """Load the newest valid checkpoint of this run, if any (collective); returns its state.
        A run dir with a rollout log but no usable checkpoint (killed before its first one) is
        started afresh, its old files kept under an attempt name."""
        cfg, comm = self.cfg, self.topo.role_comm
        # collective: every trainer rank checks the CRC-32s of its share of the files
        hit = checkpoint.find_resume(cfg.run_dir, comm, timeout_s=self.timeout_s)
        if hit is None:
            if comm.Get_rank() == 0:
                self.run_dir.set_aside_attempt()
            coll.barrier(comm, timeout_s=self.timeout_s,
                         what="resume: the old run files set aside (trainer rank 0)")
            return None
        found = str(hit[0])
        a = self.actor
        state = checkpoint.load(Path(found), model=a.model, optimizer=a.optimizer,
                                scheduler=a.lr_scheduler, comm=comm)
        self.version = state["step"]
        if comm.Get_rank() == 0:
            log.info("resuming from %s: %d of %d steps done", found, self.version,
                     cfg.train.total_steps)
            self.run_dir.truncate_metrics(self.version)     # the later steps are trained again
        return state

    _saver: checkpoint.Checkpointer | None = None      # made at the first checkpoint

    def _checkpoint(self, wait: bool = True) -> None:
        """Checkpoint after `self.version` steps (collective over the trainer ranks). With
        checkpoint.async_save and not `wait` (the periodic ones) the shards are written while
        the next steps train, and the checkpoint is complete at the first `_poll_checkpoint`
        after; the final and preemption checkpoints are complete on return (a save first
        completes the one in flight)."""
        # Rank 0 may come from hours of controller work (the final evaluation, the generators'
        # last rows): the others wait for it as long as it is alive, then save together.
        coll.barrier(self.topo.role_comm, what=f"the checkpoint of step {self.version} (trainer "
                     f"rank 0 finishing its controller work)", alive=self.topo.controller_alive)
        a, ck = self.actor, self.cfg.checkpoint
        if self._saver is None:
            self._saver = checkpoint.Checkpointer(
                self.cfg.run_dir, keep=ck.keep, comm=self.topo.role_comm, async_save=ck.async_save,
                max_host_bytes=int(ck.async_max_host_gb * 2**30),
                space=disk.SaveSpace(self.cfg, lambda: read_arch(self.cfg).total_params))
        with stuck.expect(self.cfg.rollout.collective_timeout_s,
                          f"the checkpoint of step {self.version}"):
            self._saver.save(self.version, model=a.model, optimizer=a.optimizer,
                             scheduler=a.lr_scheduler, controller_state=self.lead.state(),
                             config_yaml=to_yaml(self.cfg), wait=wait)
        # the last complete one's time, as a synchronous save takes it (a preemption's may)
        self.judge.checkpoint_s = self._saver.seconds or self.judge.checkpoint_s

    def _poll_checkpoint(self) -> None:
        """Complete the asynchronous checkpoint in flight if its write has ended on every rank
        (collective, never waits: at step boundaries and the mid-step decision points)."""
        if self._saver is not None and self._saver.poll() is not None:
            self.judge.checkpoint_s = self._saver.seconds

    def _batch(self) -> tuple[BatchShare | None, Batch | None]:
        """Rank 0 gathers the batch from the controller and splits it (advantages, batch
        statistics, minibatches, data-parallel shares: `shares.split_batch`); every trainer
        rank receives only its data-parallel share (TP/PP peers the same one), in messages of
        at most `transport.mpi.MAX_MESSAGE_BYTES` (`GroupScatter`). Returns (share, the
        controller's `Batch` on rank 0, None elsewhere); (None, None) when a preemption
        signal arrived. A batch that cannot be split raises on every rank."""
        layout = self.actor.layout
        parts = None
        batch = self.lead.batch()
        if isinstance(batch, str):      # msgs.RESEND_WEIGHTS: a new engine waits for weights
            parts = [batch] * layout.dp
        elif self.topo.is_controller:
            try:
                parts = ([None] * layout.dp if batch is None else
                         split_batch(batch.trajectories, self.cfg.train, self.cfg.rollout.group_size, layout.dp,
                                     self.cfg.rollout.max_new_tokens, self.cfg.env.on_error))
            except ValueError as exc:       # every rank raises it, none waits for a share
                parts = [exc] * layout.dp
        # The other ranks wait while rank 0 evaluates and the generators make the batch: as
        # long as rank 0 is alive (the beacon), not a number of seconds.
        share = self.shares.scatter(
            parts, timeout_s=self.timeout_s,
            what=f"the batch of step {self.version} (trainer rank 0 waits for it)",
            alive=self.topo.controller_alive)
        if isinstance(share, Exception):
            raise share
        if isinstance(share, str) and share == msgs.RESEND_WEIGHTS:
            self._publish()                 # every rank; then the batch is waited on again
            return self._batch()
        return share, batch

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `total_steps` (from a checkpoint when resumed); returns the exit code: 0, or
        EXIT_PREEMPTED after a preemption signal (generators stopped; a checkpoint written if
        this attempt trained a step: otherwise the rerun resumes from the checkpoint this attempt
        started from, or starts afresh if there is none)."""
        cfg, ck, total = self.cfg, self.cfg.checkpoint, self.cfg.train.total_steps
        start = self.version
        stuck.arm()                     # a rank alive but stuck is named (areal_hpc/stuck.py)
        if self.resumed:
            self._publish()                 # generators start from the checkpoint's weights
        self.lead.begin(self.version, resumed=bool(self.resumed))
        for step in range(start, total):
            stuck.progress(f"step {step}: waiting for its batch")
            _test_hang(self.topo, step)
            share, batch = self._batch()                    # B groups, none older than η
            if share is None:                               # preempted: stop, checkpoint, requeue
                return self._preempted(start)
            try:                                            # decoupled PPO
                train_stats = self.actor.train_share(
                    share, self.version, should_stop=self._should_stop if ck.mid_step_stop else None)
            except StepAbandoned as stop:                   # too little time left: stop midway
                return self._abandoned(start, stop)
            self.judge.last_step_s = train_stats["seconds"]
            self.version = step + 1
            weight_sync_s = self._publish()                 # generators go on with it
            self.judge.last_publish_s = weight_sync_s
            self.lead.trained(step, self.version, batch, train_stats, weight_sync_s)
            if ck.every_steps and self.version % ck.every_steps == 0 and self.version < total:
                self._checkpoint(wait=False)
            else:
                self._poll_checkpoint()
            every = cfg.data.eval_every_steps
            if every and self.version % every == 0 and self.version < total:
                self.lead.evaluate(f"step {self.version}", self.version)
        self.lead.steps_done()
        complete_before = start >= total
        if complete_before:
            log.info("run %s was already complete (%d steps)", cfg.name, start)
        else:
            self.lead.evaluate("final", self.version)
        self._stop()                    # what is still in flight lands in the buffer first
        if not complete_before:
            self._checkpoint()
        self.lead.close(self.version)
        # The export comes after the final checkpoint: a failed one is redone from it, without
        # training (main.py: a complete run whose policy/ is missing exports only).
        with stuck.expect(cfg.rollout.collective_timeout_s, "the export of the policy"):
            export_policy(self.actor, cfg, self.topo.role_comm, self.version,
                          force=not complete_before)
        return 0

    def _publish(self) -> float:
        w = self.cfg.weights        # a re-formed group's join, then the update and its acks
        with stuck.expect(w.join_timeout_s + w.timeout_s, f"publishing weights v{self.version}"):
            return self.publisher.publish(self.version)

    # -- stopping mid-step ------------------------------------------------------------------------
    def _should_stop(self, done: int, total: int, minibatch_s: float) -> bool:
        """`train_share`'s decision point, collective over the trainer ranks (every rank takes
        the same branch): a preemption signal pending on any rank (its time gathered on rank 0,
        which adopts it, so the step boundary sees it too), and rank 0 judges whether the rest
        of the step can end before the job's end (`preemption.mid_step_verdict`). First, an
        asynchronous checkpoint whose write has ended is completed (`_poll_checkpoint`)."""
        self._poll_checkpoint()
        comm, t = self.topo.role_comm, self.timeout_s
        rank0 = comm.Get_rank() == 0
        if rank0 and self._hook == (self.version, done):    # test hook (preemption.TEST_HOOK_ENV)
            preemption.request()
        at = coll.gather(comm, preemption.requested_at(), root=0, timeout_s=t,
                         what=f"step {self.version}: preemption signals (mid-step decision)")
        stop = False
        if rank0:
            times = [x for x in at if x is not None]
            if times:
                if not preemption.requested():
                    preemption.request(at=min(times))
                stop = self.judge.stop(self.version, min(times), done, total, minibatch_s)
        return bool(coll.bcast(comm, stop, root=0, timeout_s=t,
                               what=f"step {self.version}: the mid-step decision"))

    _stopped = False        # the generators were told to stop

    def _stop(self, preempted: bool = False) -> None:
        self.lead.stop(preempted=preempted)
        self._stopped = True

    def out_of_space(self, exc: disk.NoSpace) -> int:
        """A checkpoint save refused for want of room (`disk.NoSpace`, raised on every trainer
        rank before any byte of it was written: the newest checkpoint is as it was): the line
        said once, the generators stopped (unless they were), the rollout log closed; returns
        disk.EXIT_NO_SPACE, which slurm/job.sh does not requeue (storage/disk.py says why)."""
        if self.topo.is_controller:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if not self._stopped:
            self.lead.steps_done()
            self._stop()
        self.lead.close()
        return disk.EXIT_NO_SPACE

    def _abandoned(self, start: int, stop: StepAbandoned) -> int:
        """The step was stopped midway (`train_share` restored its start state on every rank):
        its batch goes back to the controller's buffer, then as at a preemption."""
        prompts = self.lead.put_back()
        if self.topo.is_controller:
            log.warning("step %d abandoned after %d of %d minibatches: %s; the step's start state "
                        "restored, its %d groups back in the buffer (prompts %s)", self.version,
                        stop.done, stop.total, self.judge.why, len(prompts),
                        " ".join(map(str, prompts)))
        return self._preempted(start)

    def _preempted(self, start: int) -> int:
        """A preemption signal arrived while waiting for a batch (or a step was stopped midway):
        generators send back what is in flight (PARTIAL rows), a checkpoint is written at this
        step, the job exits for a requeue."""
        self.lead.steps_done()
        self._stop(preempted=True)          # in-flight groups land in the buffer
        # Before this attempt's first step there is nothing new to save: the rerun starts from
        # the checkpoint this attempt resumed from (its rollout-log rows after it rolled back),
        # or, with none, afresh (`_resume` sets this attempt's files aside).
        trained = self.version > start
        if trained:
            self._checkpoint()
        self.lead.close()
        if trained:
            log.warning("preempted after %d steps: checkpoint written; exiting with %d for a "
                        "requeue", self.version, preemption.EXIT_PREEMPTED)
        else:
            log.warning("preempted before this attempt's first training step (%d steps done): "
                        "no checkpoint written; exiting with %d for a requeue",
                        self.version, preemption.EXIT_PREEMPTED)
        return preemption.EXIT_PREEMPTED


def make_actor(cfg: RunConfig, layout: ParallelLayout | None, device: str | None = None) -> Actor:
    """The run's Actor on this rank's layout (None: one process, tp = pp = 1): the one place an
    Actor is built from the config (training, export-only, and a replay, which may choose
    another `device` than topology.device)."""
    return Actor(cfg.train, cfg.model.path, group_size=cfg.rollout.group_size,
                 temperature=cfg.rollout.temperature, device=device or cfg.topology.device,
                 dtype=cfg.model.dtype, layout=layout, deterministic=cfg.deterministic)


HANG_ENV = "AREAL_TEST_HANG"       # test hook: "STEP:ROLE_RANK": that trainer rank hangs there


def _test_hang(topo: Topology, step: int) -> None:
    """The test hook of the stuck-rank watch: this trainer rank stops making progress at the
    start of step STEP (a Python loop: the rank's other threads, its beacon, run on)."""
    spec = os.environ.get(HANG_ENV, "")
    if spec and spec == f"{step}:{topo.role_rank}":
        log.warning("test hook %s: trainer rank %d hangs at step %d", HANG_ENV, topo.role_rank, step)
        while True:
            time.sleep(1)


def run_trainer(cfg: RunConfig, topo: Topology) -> int:
    trainer = Trainer(cfg, topo)
    try:
        return trainer.run()
    except disk.NoSpace as exc:         # a save refused before its first byte (storage/disk.py)
        return trainer.out_of_space(exc)


def export_policy(actor: Actor, cfg: RunConfig, comm, step: int, force: bool = True) -> None:
    """Write the run's policy/ (collective over the trainer ranks), streamed in chunks of
    `checkpoint.export_chunk_mb` (train/hf_export.py); unless `force`, only when policy/ is not
    already a complete export of `step` (trainer rank 0 looks)."""
    policy = RunDir(cfg.run_dir).policy
    t = cfg.rollout.collective_timeout_s
    if not force:
        done = is_complete(policy, step) if comm.Get_rank() == 0 else None
        if coll.bcast(comm, done, root=0, timeout_s=t, what="export: is policy/ complete"):
            return
    hf_export.export(actor, policy, chunk_bytes=cfg.checkpoint.export_chunk_mb << 20, step=step,
                     comm=comm, timeout_s=t)


def run_export(cfg: RunConfig, topo: Topology, layout: ParallelLayout | None = None) -> int:
    """Export only: the run is complete (its final checkpoint exists) but its policy/ is not.
    The trainer ranks load the model of the newest checkpoint (no optimizer state, no
    generators, no weight group) and write policy/. `layout`: this rank's, where its groups are
    made already (a test's world of one); by default made here (`trainer_layout`)."""
    comm, t = topo.role_comm, cfg.rollout.collective_timeout_s
    actor = make_actor(cfg, layout or trainer_layout(topo, cfg.train.seed))
    hit = checkpoint.find_resume(cfg.run_dir, comm, timeout_s=t)     # collective
    found = (str(hit[0]), hit[1]["step"]) if hit else None
    if found is None:
        raise RuntimeError(f"{cfg.run_dir}: no valid checkpoint to export")
    checkpoint.load_model(Path(found[0]), actor.model)
    log.info("exporting the policy of %s (step %d) to %s", found[0], found[1],
             RunDir(cfg.run_dir).policy)
    export_policy(actor, cfg, comm, found[1])
    return 0
