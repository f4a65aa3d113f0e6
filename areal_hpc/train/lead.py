"""Trainer rank 0's work beside training, behind one interface, so that the trainer's loop reads
the same on every rank.

Trainer rank 0 is the `Lead`: it owns the controller (prompts out, groups in, the batch, weight
notices, evaluations), the run directory's files (metrics.jsonl, eval.json, generators.json),
TensorBoard and the progress display. Every other trainer rank holds a `Follower`, whose methods
do nothing and return nothing: its data-parallel share of each batch reaches it from rank 0
(`Trainer._batch`).
"""
from __future__ import annotations

import logging
import time

from .. import preemption
from ..config import RunConfig
from ..data.prompts import load_prompts_of
from ..progress import Progress
from ..rollout.staleness import Batch
from ..storage.run_dir import RunDir
from ..storage.run_state import ControllerState
from ..storage.tensorboard import TensorBoardLog
from ..topology import Topology
from .diagnostics import CollapseWatch
from .weight_publisher import SILENT

log = logging.getLogger(__name__)


class Follower:
    """A trainer rank other than 0: none of rank 0's duties."""
    controller = None
    weight_notifier = SILENT

    def state(self) -> dict | None:
        return None

    def begin(self, version: int, resumed: bool) -> None:
        pass

    def batch(self) -> Batch | None:
        return None

    def trained(self, step: int, version: int, batch: Batch | None, train_stats: dict,
                weight_sync_s: float) -> None:
        pass

    def evaluate(self, label: str, version: int) -> None:
        pass

    def put_back(self) -> list[int]:
        return []

    def steps_done(self) -> None:
        pass

    def stop(self, preempted: bool = False) -> None:
        pass

    def close(self, version: int | None = None) -> None:
        pass


class Lead(Follower):
    """Trainer rank 0: the controller, the run directory's files, TensorBoard, the progress."""

    def __init__(self, cfg: RunConfig, topo: Topology, resume: ControllerState | None):
        from transformers import AutoTokenizer

        from ..rollout.controller import Controller     # the lead rank only (the controller's writer)
        self.cfg, self.run = cfg, RunDir(cfg.run_dir)
        d = cfg.data
        train_rows = load_prompts_of(cfg, d.train_path)
        self.eval_rows = load_prompts_of(cfg, d.eval_path) if d.eval_path else []
        if d.eval_limit:
            self.eval_rows = self.eval_rows[: d.eval_limit]
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.controller = Controller.start(cfg, topo, train_rows, tokenizer, resume=resume)
        self.weight_notifier = self.controller      # announces updates, collects acknowledgements
        self.tb: TensorBoardLog | None = None
        self.progress = None
        self.evals: list[dict] = []
        self._eval_s = 0.0
        self.watch = CollapseWatch()

    def state(self) -> dict:
        """The controller's part of a checkpoint."""
        return self.controller.state()

    def begin(self, version: int, resumed: bool) -> None:
        """Before the first step of this attempt (the generators run `version`'s weights): the
        initial evaluation, or a resumed run's earlier ones; TensorBoard rebuilt from
        metrics.jsonl, so that a requeued run holds every step once; the progress bar."""
        if resumed:
            self.evals = self.run.read_evals(up_to_step=version)
        else:
            self.evals = []
            self.evaluate("initial", version)
            self.run.write_evals(self.evals)    # kept by a resume
        if self.cfg.tensorboard:
            self.tb = TensorBoardLog.open(self.run.path, self.evals)
        self.progress = Progress(self.cfg.train.total_steps, initial=version)
        self._gen_tokens = self.controller.generated_tokens
        self._t_record = self._t_loop = time.monotonic()
        self._eval_s = 0.0

    def batch(self) -> Batch | str | None:
        """B groups, none older than η; None when a preemption signal arrived (checked while
        waiting, too); `messages.RESEND_WEIGHTS` when a generator's new engine waits for the
        weights first."""
        return self.controller.next_batch(on_wait=self.progress.waiting,
                                          should_stop=preemption.requested)

    def trained(self, step: int, version: int, batch: Batch, train_stats: dict,
                weight_sync_s: float) -> None:
        """Step `step` is trained and `version` published: mark its rows, write its metrics."""
        self.controller.on_trained(batch.rows, step, version)
        now = time.monotonic()
        gen_tokens = self.controller.generated_tokens
        record = {"step": step, "version": version, **batch.stats, **train_stats,
                  "weight_sync_s": weight_sync_s,
                  "gen_tok_per_s": (gen_tokens - self._gen_tokens) / (now - self._t_record),
                  # wall clock, and this attempt's seconds since its first step began, held-out
                  # evaluations excluded (a clock for time-to-accuracy)
                  "time": time.time(), "elapsed_s": now - self._t_loop - self._eval_s}
        self._gen_tokens, self._t_record = gen_tokens, now
        self.run.append_metrics(record)
        if self.tb is not None:
            self.tb.step(record)
        self.progress.step(record)
        for warning in self.watch.check(record):
            log.warning("%s", warning)

    def put_back(self) -> list[int]:
        """The step's batch was not trained (stopped midway): back to the controller's buffer;
        returns its prompt ids."""
        return self.controller.put_back()

    def evaluate(self, label: str, version: int) -> None:
        """Held-out accuracy of the generators' current policy, kept in eval.json."""
        if not self.eval_rows:
            return
        t0 = time.monotonic()
        self.controller.request_eval(self.eval_rows, self.cfg.data.eval_samples)
        res = self.controller.eval_result()
        self._eval_s += time.monotonic() - t0
        res["label"], res["step"], res["time"] = label, version, time.time()
        if res["accuracy"] is None:
            log.warning("held-out evaluation (%s, version %d): no samples, the generators' engines "
                        "were restarting; not recorded", label, res["version"])
            return
        log.info("held-out accuracy (%s, version %d): %.3f over %d samples in %.1fs",
                 label, res["version"], res["accuracy"], res["samples"], res["seconds"])
        if self.tb is not None:
            self.tb.evaluation(res)
        self.evals.append(res)
        self.run.write_evals(self.evals)

    def steps_done(self) -> None:
        """No more training steps in this attempt: the progress bar closes."""
        if self.progress is not None:
            self.progress.close()

    def stop(self, preempted: bool = False) -> None:
        """The generators stop (what is in flight lands in the buffer first; at a preemption,
        as PARTIAL rows)."""
        self.controller.stop(preempted=preempted)

    def close(self, version: int | None = None) -> None:
        """After the last checkpoint: the rollout log closes; at the end of a run (`version`
        given), the held-out table is printed and the generators' totals go to TensorBoard."""
        self.controller.close()
        if version is not None:
            self.run.write_evals(self.evals)
            self.progress.eval_table(self.evals)
            if self.tb is not None:
                self.tb.generators(self.run.path, version)
        if self.tb is not None:
            self.tb.close()


def lead_of(cfg: RunConfig, topo: Topology, resume: ControllerState | None) -> Follower:
    """This trainer rank's share of rank 0's duties: a `Lead` on rank 0, else a `Follower`."""
    return Lead(cfg, topo, resume) if topo.is_controller else Follower()
