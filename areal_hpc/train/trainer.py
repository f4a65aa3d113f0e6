"""The trainer ranks' loop (trainer rank 0 also runs the controller).

    evaluate the initial policy on held-out prompts
    for step in 0..total_steps-1:
        batch ← controller: B groups, each at most η versions old   (generators never wait)
        decoupled-PPO update on the batch (GRPO advantages, π_prox, ppo_minibatches steps)
        version += 1; broadcast the HF-named weights to every generator engine
    evaluate the final policy; stop generators; save the trained policy
"""
from __future__ import annotations

import json
import logging
import time

from ..config import RunConfig
from ..data.prompts import load_prompts
from ..topology import Topology
from ..transport import weights as wsync
from .actor import Actor

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        topo.init_trainer_process_group()
        t = cfg.topology
        self.actor = Actor(
            cfg.train, cfg.model.path, tp=t.tp, pp=t.pp, group_size=cfg.rollout.group_size,
            temperature=cfg.rollout.temperature, device=t.device, dtype=cfg.model.dtype)
        self.version = 0
        self.weight_meta = None         # bucket plan of the HF weights: fixed for the run
        self.controller = None
        if topo.is_controller:
            from transformers import AutoTokenizer

            from ..rollout.controller import Controller
            d = cfg.data
            keys = (d.kind, d.question_key, d.answer_key)
            train_rows = load_prompts(d.train_path, *keys)
            self.eval_rows = load_prompts(d.eval_path, *keys) if d.eval_path else []
            if d.eval_limit:
                self.eval_rows = self.eval_rows[: d.eval_limit]
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            self.controller = Controller(cfg, topo, train_rows, tokenizer)
            self.weight_group = wsync.init_sender_group(
                topo.controller_addr, topo.weight_port, topo.weight_group_size, t.weight_backend)

    # -- rank 0 helpers ---------------------------------------------------------------------------
    def _evaluate(self, label: str) -> dict | None:
        if self.controller is None or not self.eval_rows:
            return None
        self.controller.request_eval(self.eval_rows, self.cfg.data.eval_samples)
        res = self.controller.eval_result()
        res["label"] = label
        log.info("held-out accuracy (%s, version %d): %.3f over %d samples in %.1fs",
                 label, res["version"], res["accuracy"], res["samples"], res["seconds"])
        return res

    def _publish_weights(self) -> float:
        """Gather the HF-named weights (collective over the trainer ranks); trainer rank 0 tells
        every generator a new version is coming, then broadcasts it in buckets."""
        t0 = time.monotonic()
        state = self.actor.hf_state_dict()
        if self.controller is None:
            return 0.0
        if self.weight_meta is None:
            named = [(k, tuple(v.shape), wsync.dtype_to_str(v.dtype)) for k, v in state.items()]
            self.weight_meta = wsync.plan_buckets(named, self.cfg.weights.bucket_mb << 20)
        self.controller.send_weights_notice(self.version, self.weight_meta)
        wsync.broadcast_weights(self.weight_group, state, self.weight_meta)
        return time.monotonic() - t0

    def _batch(self, progress) -> tuple[list[dict], dict]:
        """Rank 0 gathers the batch from the controller; every trainer rank gets all of it (the
        Actor splits it into minibatches and data-parallel shares, alike on every rank)."""
        if self.controller is not None:
            trajs, stats = self.controller.next_batch(on_wait=progress.waiting)
        else:
            trajs, stats = None, None
        return self.topo.role_comm.bcast((trajs, stats), root=0)

    def _record(self, step: int, stats: dict, train_stats: dict, weight_sync_s: float) -> dict:
        """One line of metrics.jsonl (rank 0): batch, update and generation statistics."""
        now = time.monotonic()
        gen_tokens = self.controller.generated_tokens
        record = {"step": step, "version": self.version, **stats, **train_stats,
                  "weight_sync_s": weight_sync_s,
                  "gen_tok_per_s": (gen_tokens - self._gen_tokens) / (now - self._t_record)}
        self._gen_tokens, self._t_record = gen_tokens, now
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        from ..progress import Progress
        cfg = self.cfg
        evals = [self._evaluate("initial")]
        progress = Progress(cfg.train.total_steps, enabled=self.controller is not None)
        self._gen_tokens, self._t_record = 0, time.monotonic()
        for step in range(cfg.train.total_steps):
            trajs, stats = self._batch(progress)            # B groups, none older than η
            train_stats = self.actor.train_step(trajs, self.version)  # decoupled PPO
            self.version = step + 1
            weight_sync_s = self._publish_weights()         # generators go on with the new version
            if self.controller is not None:
                self.controller.on_trained(stats.pop("rows"), step, self.version)
                progress.step(self._record(step, stats, train_stats, weight_sync_s))
        progress.close()
        evals.append(self._evaluate("final"))
        self.actor.save_hf(cfg.run_dir / "policy")
        if self.controller is not None:
            self.controller.stop()
            evals = [e for e in evals if e]
            with open(cfg.run_dir / "eval.json", "w") as f:
                json.dump(evals, f, indent=1)
            progress.eval_table(evals)


def run_trainer(cfg: RunConfig, topo: Topology) -> None:
    Trainer(cfg, topo).run()
