"""The trainer ranks' loop (trainer rank 0 also runs the controller).

    evaluate the initial policy on held-out prompts
    for step in 0..total_steps-1:
        batch ← controller: B groups, each at most η versions old   (generators never wait)
        decoupled-PPO update on the batch (GRPO advantages, π_prox, ppo_minibatches steps)
        version += 1; send the HF-named weights to every generator engine (one sender per
            pipeline stage) and wait until all of them run the new version
    evaluate the final policy; stop generators; save the trained policy
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..config import RunConfig
from ..data.prompts import load_prompts_of
from ..topology import Topology
from .. import preemption
from ..storage.checkpoint import find_latest
from ..storage.tensorboard import TensorBoardLog
from ..transport import mpi as coll
from . import checkpoint
from .actor import Actor
from .weight_publisher import WeightPublisher

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.actor = Actor(
            cfg.train, cfg.model.path, group_size=cfg.rollout.group_size,
            temperature=cfg.rollout.temperature, device=cfg.topology.device,
            dtype=cfg.model.dtype, layout=topo.init_trainer_layout(cfg.train.seed))
        self.version = 0
        self.controller = None
        self.tb = None                  # TensorBoardLog (rank 0), opened when the loop starts
        self.resumed = self._resume() if cfg.checkpoint.resume == "auto" else None
        if topo.is_controller:
            from transformers import AutoTokenizer

            from ..rollout.controller import Controller
            d = cfg.data
            train_rows = load_prompts_of(cfg, d.train_path)
            self.eval_rows = load_prompts_of(cfg, d.eval_path) if d.eval_path else []
            if d.eval_limit:
                self.eval_rows = self.eval_rows[: d.eval_limit]
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            self.controller = Controller(cfg, topo, train_rows, tokenizer,
                                         resume=self.resumed["controller"] if self.resumed else None)
        self.publisher = WeightPublisher.for_trainer(cfg, topo, self.actor, self.controller)

    # -- checkpoints ------------------------------------------------------------------------------
    def _resume(self) -> dict | None:
        """Load the newest valid checkpoint of this run, if any (collective); returns its state.
        A run dir with a rollout log but no usable checkpoint (killed before its first one) is
        started afresh, its old files kept under an attempt name."""
        cfg, comm = self.cfg, self.topo.role_comm
        found = None
        if comm.Get_rank() == 0:
            hit = find_latest(cfg.run_dir)
            found = str(hit[0]) if hit else None
            if hit is None and (cfg.run_dir / "rollouts.h5").exists():
                k = 1 + len(list(cfg.run_dir.glob("rollouts.attempt-*.h5")))
                for name in ("rollouts.h5", "metrics.jsonl", "eval.json"):
                    old = cfg.run_dir / name
                    if old.exists():
                        old.rename(cfg.run_dir / name.replace(".", f".attempt-{k}.", 1))
                log.warning("run dir %s has no usable checkpoint: starting afresh (the previous "
                            "attempt's files are kept as *.attempt-%d.*)", cfg.run_dir, k)
        found = coll.bcast(comm, found, root=0, timeout_s=cfg.rollout.collective_timeout_s,
                           what="resume: the checkpoint to load (trainer rank 0 validates it)")
        if found is None:
            return None
        a = self.actor
        state = checkpoint.load(Path(found), model=a.model, optimizer=a.optimizer,
                                scheduler=a.lr_scheduler, comm=comm)
        self.version = state["step"]
        if comm.Get_rank() == 0:
            log.info("resuming from %s: %d of %d steps done", found, self.version,
                     cfg.train.total_steps)
            metrics = cfg.run_dir / "metrics.jsonl"     # drop the steps that are trained again
            if metrics.exists():
                lines = [ln for ln in metrics.read_text().splitlines()
                         if ln.strip() and json.loads(ln)["step"] < self.version]
                metrics.write_text("".join(ln + "\n" for ln in lines))
        return state

    def _checkpoint(self) -> None:
        """Checkpoint after `self.version` steps (collective over the trainer ranks)."""
        from ..config import to_yaml
        a = self.actor
        checkpoint.save(self.cfg.run_dir, self.version, model=a.model, optimizer=a.optimizer,
                        scheduler=a.lr_scheduler,
                        controller_state=self.controller.state() if self.controller else None,
                        config_yaml=to_yaml(self.cfg), keep=self.cfg.checkpoint.keep,
                        comm=self.topo.role_comm)

    # -- rank 0 helpers ---------------------------------------------------------------------------
    def _evaluate(self, label: str) -> dict | None:
        if self.controller is None or not self.eval_rows:
            return None
        t0 = time.monotonic()
        self.controller.request_eval(self.eval_rows, self.cfg.data.eval_samples)
        res = self.controller.eval_result()
        self._eval_s += time.monotonic() - t0
        res["label"], res["step"], res["time"] = label, self.version, time.time()
        log.info("held-out accuracy (%s, version %d): %.3f over %d samples in %.1fs",
                 label, res["version"], res["accuracy"], res["samples"], res["seconds"])
        if self.tb is not None:
            self.tb.evaluation(res)
        return res

    def _batch(self, progress) -> tuple[list[dict], dict]:
        """Rank 0 gathers the batch from the controller; every trainer rank gets all of it (the
        Actor splits it into minibatches and data-parallel shares, alike on every rank)."""
        if self.controller is not None:
            # (None, None) when a preemption signal arrived (checked while waiting, too)
            trajs, stats = self.controller.next_batch(on_wait=progress.waiting,
                                                      should_stop=preemption.requested)
        else:
            trajs, stats = None, None
        return coll.bcast(self.topo.role_comm, (trajs, stats), root=0,
                          timeout_s=self.cfg.rollout.collective_timeout_s,
                          what=f"the batch of step {self.version} (trainer rank 0 waits for it)")

    def _record(self, step: int, stats: dict, train_stats: dict, weight_sync_s: float) -> dict:
        """One line of metrics.jsonl (rank 0): batch, update and generation statistics."""
        now = time.monotonic()
        gen_tokens = self.controller.generated_tokens
        record = {"step": step, "version": self.version, **stats, **train_stats,
                  "weight_sync_s": weight_sync_s,
                  "gen_tok_per_s": (gen_tokens - self._gen_tokens) / (now - self._t_record),
                  # wall clock, and this attempt's seconds since its first step began, held-out
                  # evaluations excluded (a clock for time-to-accuracy)
                  "time": time.time(), "elapsed_s": now - self._t_loop - self._eval_s}
        self._gen_tokens, self._t_record = gen_tokens, now
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            self.tb.step(record)
        return record

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `total_steps` (from a checkpoint when resumed); returns the exit code: 0, or
        EXIT_PREEMPTED after a preemption signal (generators stopped; a checkpoint written if
        this attempt trained a step: otherwise the rerun resumes from the checkpoint this attempt
        started from, or starts afresh if there is none)."""
        from ..progress import Progress
        cfg, ck = self.cfg, self.cfg.checkpoint
        start = self.version
        self._eval_s = 0.0
        if self.resumed:
            self.publisher.publish(self.version)    # generators start from the checkpoint's weights
            evals = self._previous_evals()
        else:
            evals = [e for e in [self._evaluate("initial")] if e]
            self._save_evals(evals)     # kept by a resume
        if self.controller is not None and cfg.tensorboard:   # every step once, across requeues
            self.tb = TensorBoardLog.open(cfg.run_dir, [e for e in evals if e])
        progress = Progress(cfg.train.total_steps, enabled=self.controller is not None, initial=start)
        self._gen_tokens = self.controller.generated_tokens if self.controller else 0
        self._t_record = self._t_loop = time.monotonic()
        self._eval_s = 0.0
        for step in range(start, cfg.train.total_steps):
            trajs, stats = self._batch(progress)            # B groups, none older than η
            if trajs is None:                               # preempted: stop, checkpoint, requeue
                progress.close()
                if self.controller is not None:
                    self.controller.stop(preempted=True)    # in-flight groups land in the buffer
                # Before this attempt's first step there is nothing new to save: the rerun starts
                # from the checkpoint this attempt resumed from (its rollout-log rows after it
                # rolled back), or, with none, afresh (`_resume` sets this attempt's files aside).
                trained = self.version > start
                if trained:
                    self._checkpoint()
                if self.controller is not None:
                    self.controller.close()
                if self.tb is not None:
                    self.tb.close()
                if trained:
                    log.warning("preempted after %d steps: checkpoint written; exiting with %d "
                                "for a requeue", self.version, preemption.EXIT_PREEMPTED)
                else:
                    log.warning("preempted before this attempt's first training step (%d steps "
                                "done): no checkpoint written; exiting with %d for a requeue",
                                self.version, preemption.EXIT_PREEMPTED)
                return preemption.EXIT_PREEMPTED
            train_stats = self.actor.train_step(trajs, self.version)  # decoupled PPO
            self.version = step + 1
            weight_sync_s = self.publisher.publish(self.version)  # generators go on with it
            if self.controller is not None:
                self.controller.on_trained(stats.pop("rows"), step, self.version)
                progress.step(self._record(step, stats, train_stats, weight_sync_s))
            if ck.every_steps and self.version % ck.every_steps == 0 \
                    and self.version < cfg.train.total_steps:
                self._checkpoint()
            every = cfg.data.eval_every_steps
            if every and self.version % every == 0 and self.version < cfg.train.total_steps:
                evals.append(self._evaluate(f"step {self.version}"))
                self._save_evals([e for e in evals if e])
        progress.close()
        complete_before = start >= cfg.train.total_steps
        if complete_before:
            log.info("run %s was already complete (%d steps)", cfg.name, start)
        else:
            evals.append(self._evaluate("final"))
            self.actor.save_hf(cfg.run_dir / "policy")
        if self.controller is not None:
            self.controller.stop()      # what is still in flight lands in the buffer first
        if not complete_before:
            self._checkpoint()
        if self.controller is not None:
            self.controller.close()
            evals = [e for e in evals if e]
            self._save_evals(evals)
            progress.eval_table(evals)
        if self.tb is not None:
            self.tb.generators(cfg.run_dir / "generators.json", self.version)
            self.tb.close()
        return 0

    def _save_evals(self, evals: list[dict]) -> None:
        if self.controller is not None:
            (self.cfg.run_dir / "eval.json").write_text(json.dumps(evals, indent=1))

    def _previous_evals(self) -> list[dict]:
        path = self.cfg.run_dir / "eval.json"
        if self.controller is None or not path.exists():
            return []
        # evaluations after the checkpoint resumed from are of steps trained again
        return [e for e in json.loads(path.read_text())
                if e.get("label") != "final" and e.get("step", 0) <= self.version]


def run_trainer(cfg: RunConfig, topo: Topology) -> int:
    return Trainer(cfg, topo).run()
