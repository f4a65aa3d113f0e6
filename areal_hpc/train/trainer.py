"""The trainer ranks' loop (trainer rank 0 also runs the controller).

    evaluate the initial policy on held-out prompts
    for step in 0..total_steps-1:
        batch ← controller: B groups, each at most η versions old   (generators never wait)
        decoupled-PPO update on the batch (π_prox recomputed, GRPO advantages)
        version += 1; broadcast the HF-named weights to every generator engine
    evaluate the final policy; stop generators; save the trained policy
"""
from __future__ import annotations

import json
import logging
import time

from ..config import RunConfig
from ..data.jsonl import load_jsonl
from ..topology import Topology
from ..transport import weights as wsync
from .actor import Actor

log = logging.getLogger(__name__)


def _weight_meta(state: dict, bucket_mb: int):
    named = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
    return wsync.plan_buckets(named, bucket_mb << 20)


class Trainer:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        topo.init_trainer_process_group()
        t, tr = cfg.topology, cfg.train
        self.actor = Actor(
            model_dir=cfg.model.path, tp=t.tp, pp=t.pp, lr=tr.lr, weight_decay=tr.weight_decay,
            betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_eps, clip_grad=tr.clip_grad,
            temperature=cfg.rollout.temperature, eps_clip=tr.eps_clip,
            behav_imp_weight_cap=tr.behav_imp_weight_cap, max_tokens_per_mb=tr.max_tokens_per_mb,
            group_size=cfg.rollout.group_size, device=t.device, seed=tr.seed)
        self.version = 0
        self.controller = None
        if topo.is_controller:
            from transformers import AutoTokenizer

            from ..rollout.controller import Controller
            d = cfg.data
            train_rows = load_jsonl(d.train_path, d.question_key, d.answer_key)
            self.eval_rows = load_jsonl(d.eval_path, d.question_key, d.answer_key) if d.eval_path else []
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
        meta = _weight_meta(state, self.cfg.weights.bucket_mb)
        self.controller.send_weights_notice(self.version, meta)
        wsync.broadcast_weights(self.weight_group, state, meta)
        return time.monotonic() - t0

    def _batch(self, progress) -> tuple[list[dict], dict]:
        """Rank 0 gathers the batch from the controller; every trainer rank gets it."""
        if self.controller is not None:
            trajs, stats = self.controller.next_batch(on_wait=progress.waiting)
        else:
            trajs, stats = None, None
        return self.topo.role_comm.bcast((trajs, stats), root=0)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        from ..progress import Progress
        cfg = self.cfg
        evals = [self._evaluate("initial")]
        progress = Progress(cfg.train.total_steps, enabled=self.controller is not None)
        metrics_path = cfg.run_dir / "metrics.jsonl"
        gen_tokens_before, t_prev = 0, time.monotonic()
        for step in range(cfg.train.total_steps):
            trajs, stats = self._batch(progress)
            train_stats = self.actor.train_step(trajs)
            self.version = step + 1
            weight_sync_s = self._publish_weights()
            if self.controller is not None:
                self.controller.on_trained(stats.pop("rows"), step, self.version)
                stats["weight_sync_s"] = weight_sync_s
                now = time.monotonic()
                gen_tokens = self.controller.generated_tokens
                stats["gen_tok_per_s"] = (gen_tokens - gen_tokens_before) / (now - t_prev)
                gen_tokens_before, t_prev = gen_tokens, now
                record = {"step": step, "version": self.version, **stats, **train_stats}
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                progress.step(record)
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
