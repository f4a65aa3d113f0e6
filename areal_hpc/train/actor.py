"""The policy on the trainer ranks: Megatron GPTModel + DDP + Megatron optimizer, TP × PP × DP.

One `train_step` is one decoupled-PPO step on a batch (AReaL's `ppo_update`):

    advantages (reward shaping, GRPO group norm, optional token-level norm), whole batch
    split the batch into `ppo_minibatches` minibatches; each into data-parallel shares
        (`shares.split_batch`; these two lines run once, on trainer rank 0, in the trainer)
    this rank's share of each minibatch into packed micro-batches (equal counts on every
        data-parallel rank)  (`train_share`, on every rank)
    π_prox: one forward pass with the step's initial weights over all minibatches but the first,
        whose training forward runs with those weights (recompute: its log-probs, detached), or
        π_behav (behaviour), or AReaL's loglinear approximation inside the loss (loglinear)
    per minibatch: forward/backward over its micro-batches, one optimizer step, lr schedule step

The minibatch split depends on the sequence lengths only, not on the data-parallel size: DP = 2
trains on exactly the minibatches DP = 1 does. The trainer splits each batch once, on its rank 0,
and sends every rank only its data-parallel share (`train_share`); `train_step` on a whole batch
takes its share from the same split, so both train the same sequences in the same order.

Loss aggregation is a token mean over the minibatch (across micro-batches and data-parallel
ranks): each micro-batch returns its loss *sum* and token count, and Megatron
(`calculate_per_token_loss`) divides the accumulated gradient by the minibatch's global token
count.

Micro-batches are padding-free (`areal_hpc.train.micro_batches`): a share's sequences are
planned into micro-batches of at most `train.max_tokens_per_mb` tokens, the same count on every
data-parallel rank, and each is packed into one row (varlen attention by default, a dense
block-diagonal mask with `train.attention: mask`).

Log-probs come from the last hidden states in chunks of `train.logprob_chunk_tokens` tokens
(`areal_hpc.train.logprobs`): the model's output layer hands back hidden states, and no
`[tokens, vocab]` tensor is formed.

With pipeline parallelism, logits exist only on the last stage: log-probs and statistics are sent
from there to the other stages, and `hf_state_dict` collects all stages on the first one.

Every trainer rank constructs an Actor and calls its methods together (they are collective over
Megatron's groups).
"""

from __future__ import annotations

import os
import shutil
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from areal_hpc.train import mcore as _mcore  # noqa: F401 - first: Megatron imported with compiles deferred
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import save_file

from areal_hpc import determinism, stuck
from areal_hpc.algo.ppo import OffPolicy, decoupled_ppo_loss, loglinear_prox_logprobs
from areal_hpc.config import TrainConfig
from areal_hpc.train import megatron_model
from areal_hpc.train.hf_export import WEIGHT_SUFFIXES
from areal_hpc.train.layout import ParallelLayout
from areal_hpc.train.cpu_compat import CudaToCpuMode
from areal_hpc.train.logprobs import chunked_token_logprobs
from areal_hpc.train.micro_batches import MicroBatch, pack, plan_micro_batches
from areal_hpc.train.step_snapshot import StepSnapshot
from areal_hpc.train.shares import BatchShare, dp_split, sequence_lengths, split_batch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-micro-batch sums returned by the PPO loss (last pipeline stage), reduced over the batch.
# Token sums (the loss's token means times the micro-batch's tokens), then sequence sums.
_TOKEN_STATS = ("clip_frac", "ratio_mean", "dropped_frac", "seq_masked_frac", "tr_masked_frac",
                "approx_kl", "kl_behav", "kl_prox_behav", "r_mean", "r_sq_mean")
_SEQ_STATS = ("seq_r_mean", "seq_r_sq_mean")
_SUM_KEYS = ("loss", *_TOKEN_STATS, "imp_weight_mean", "kept", "n_seqs", *_SEQ_STATS,
             "signal_tokens")
# The diagnostics of a step: not measured (None in metrics.jsonl) when no forward pass ran.
_DIAGNOSTICS = ("loss", "grad_norm", "clip_frac", "ratio_mean", "imp_weight_mean",
                "dropped_frac", "approx_kl", "seq_masked_frac", "tr_masked_frac", "kl_behav",
                "kl_prox_behav", "ess", "seq_ess")
_NAN = float("nan")


def off_policy_of(cfg: TrainConfig) -> OffPolicy:
    """The loss's off-policy correction from the `train` section."""
    return OffPolicy(cfg.off_policy, w_low=cfg.behav_imp_weight_floor,
                     w_high=cfg.behav_imp_weight_cap, seq_low=cfg.seq_imp_weight_low,
                     seq_high=cfg.seq_imp_weight_high, behav_clip=cfg.behav_clip,
                     kl_coef=cfg.behav_kl_coef)


def _ess(total: float, sq_total: float, n: float) -> float:
    """(Σx)² / (n Σx²), the normalised effective sample size of weights x (NaN when none: not
    measured, which is not the same as on-policy)."""
    return total * total / (n * sq_total) if n > 0 and sq_total > 0 else _NAN


class StepAbandoned(Exception):
    """`train_share` stopped at a decision point (`should_stop`): `done` of `total` minibatches
    had run; the rank's model, optimizer, scheduler and RNG are back at the step's start."""

    def __init__(self, done: int, total: int):
        super().__init__(f"step abandoned after {done} of {total} minibatches")
        self.done, self.total = done, total


class Actor:
    """The trained policy on one trainer rank (its TP shard of its pipeline stage).

    Args:
        cfg: the run's `train` section (optimizer, lr schedule, PPO, advantages, packing).
        model_dir: HF directory (config.json + *.safetensors) of the initial policy.
        tp, pp: Megatron parallel sizes; dp = world size / (tp * pp) (ignored with `layout`).
        group_size: samples per prompt (GRPO groups are contiguous in a batch).
        temperature: sampling temperature; logits are divided by it so that recomputed
            log-probs match the inference engine's.
        device: "cpu" or "cuda" (the current CUDA device of this rank).
        dtype: parameter dtype, "float32" | "bfloat16" | "float16"; half precision keeps fp32
            main parameters and gradients in Megatron's optimizer (fp16 with loss scaling).
        layout: this rank's `ParallelLayout` (the trainer's, from `layout.trainer_layout`).
            Without it, Megatron's parallel state is initialised here (seed `cfg.seed`) unless it
            already is, and the layout read from it.
    torch.distributed must already be initialised over the trainer ranks.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model_dir: str,
        *,
        tp: int = 1,
        pp: int = 1,
        group_size: int = 1,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        layout: ParallelLayout | None = None,
        deterministic: bool = False,
    ):
        self.cfg = cfg
        self.off_policy = off_policy_of(cfg)
        # Where π_prox comes from: naive PPO clips against π_behav itself.
        self.prox = "behaviour" if cfg.off_policy == "naive" else cfg.prox
        self.model_dir = model_dir
        self.group_size = group_size
        self.temperature = temperature
        self.device = torch.device(device)
        self.hf_config = megatron_model.read_hf_config(model_dir)
        if layout is None:      # a single process or a test: Megatron's groups, if not there yet
            if not parallel_state.model_parallel_is_initialized():
                megatron_model.init_megatron_parallel(tp, pp, cfg.seed)
            layout = ParallelLayout.read()
        self.layout = layout
        self.tp, self.pp = tp, pp = layout.tp, layout.pp
        self.params_dtype = params_dtype = _DTYPES[dtype]

        model = megatron_model.build_gpt_model(
            self.hf_config, params_dtype=params_dtype, tp=tp, pp=pp, device=self.device,
            calculate_per_token_loss=True,
            attention=cfg.attention,
            recompute_granularity=cfg.recompute_granularity,
            recompute_method=cfg.recompute_method,
            recompute_num_layers=cfg.recompute_num_layers,
            sequence_parallel=cfg.sequence_parallel,
            deterministic_mode=deterministic,       # the `deterministic` key (determinism.py)
        )
        if deterministic:
            determinism.enable_torch(self.device.type)
        megatron_model.load_hf_checkpoint(model, model_dir, self.hf_config)
        megatron_model.output_hidden_states(model)  # log-probs from hidden states, in chunks
        self.attention = "varlen" if cfg.attention == "auto" else cfg.attention
        # Rows are padded to a multiple of this (sequence parallelism splits them over TP).
        self._row_multiple = tp if cfg.sequence_parallel else 1
        self.model = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.distributed_optimizer),
            module=model,
        )
        config = model.config
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=cfg.distributed_optimizer,
            # fp16 only. Each micro-batch's loss is a token *sum*, so per-token gradients are O(1)
            # and a scale of 2**16 already overflows fp16 (Megatron's default 2**32 would skip
            # dozens of steps, each a whole RL batch). Dynamic scaling adjusts it from here.
            initial_loss_scale=2.0**10,
        )
        with CudaToCpuMode():
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        if params_dtype == torch.float16:  # the schedule scales each micro-batch loss by this
            config.grad_scale_func = self.optimizer.scale_loss
        decay_steps = cfg.lr_decay_steps or cfg.total_steps * cfg.ppo_minibatches
        # `step(1)` runs before each optimizer step, so optimizer step n of the warm-up uses
        # lr * n / warmup (none is wasted at lr 0) and step `decay_steps` uses min_lr.
        self.lr_scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.lr_warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=cfg.lr_decay_style,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )
        self._snapshot: StepSnapshot | None = None   # host buffers of a mid-step stop, reused

    # ---------------------------------------------------------------- batches

    def _plan(self, lengths: list[int], equalise_dp: bool) -> list[list[int]]:
        """Micro-batches of `lengths` (`micro_batches.plan`); with `equalise_dp` as many as on
        the busiest data-parallel rank (AReaL all-gathers the count and takes the max; so do we,
        by all-reduce)."""
        def busiest(n: int) -> int:
            k = torch.tensor(n, device=self.device)
            dist.all_reduce(k, op=dist.ReduceOp.MAX, group=self.layout.dp_group())
            return int(k)
        return plan_micro_batches(lengths, self.cfg.max_tokens_per_mb, self.pp,
                                  busiest if equalise_dp and self.layout.dp > 1 else None)

    def _pack(self, seqs: list[dict], mb_ids: list[int], per_token: dict | None = None) -> MicroBatch:
        return pack(seqs, mb_ids, per_token, attention=self.attention,
                    row_multiple=self._row_multiple, device=self.device)

    # ---------------------------------------------------------------- forward

    def _token_logprobs(self, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """`[N]` log π(a_t|s_t) at temperature T from the last hidden states `[1, S, H]`,
        against this TP rank's vocabulary slice, `logprob_chunk_tokens` tokens at a time."""
        weight = megatron_model.output_weight(self.model)
        vocab_start = self.layout.tp_rank * weight.shape[0]
        group = self.layout.tp_group() if self.tp > 1 else None
        return chunked_token_logprobs(hidden[0, mb.out_pos], weight, mb.targets[0],
                                      self.temperature, self.cfg.logprob_chunk_tokens,
                                      vocab_start, group)

    def _forward_step(self, loss_fn, data_iterator, model):
        stuck.progress()                # each micro-batch is progress (areal_hpc/stuck.py)
        mb = next(data_iterator)
        # first stage: token ids in; later stages: the schedule has set the previous stage's
        # activations as input. The mask / sequence lengths are needed on every stage.
        output = model(mb.tokens, mb.position_ids, mb.attention_mask,
                       packed_seq_params=mb.packed_seq_params)  # last stage: [1, S, H]
        return output, partial(loss_fn, mb)

    def _run(self, micro_batches: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict]:
        """Megatron's schedule over the micro-batches (1F1B with pp > 1); the loss outputs on
        the last pipeline stage, [] on the others."""
        with CudaToCpuMode():
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn),
                data_iterator=iter(micro_batches),
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def _n_tokens(self, n: int) -> torch.Tensor:
        return torch.tensor(n, dtype=torch.int, device=self.device)

    def _logprob_loss(self, mb: MicroBatch, hidden: torch.Tensor):
        logprobs = self._token_logprobs(hidden, mb)
        zero = torch.zeros((), device=self.device)
        return zero, self._n_tokens(mb.n_tokens), {"logprobs": logprobs.detach().clone()}

    @torch.no_grad()
    def _forward_logprobs(self, micro_batches: list[MicroBatch], to_all_stages: bool) -> list:
        """`[N]` float32 log-probs per micro-batch (tensors): on the last stage, and on every
        stage with `to_all_stages` (sent from the last stage); None elsewhere."""
        outputs = self._run(micro_batches, self._logprob_loss, forward_only=True)
        last = self.layout.last_stage
        per_mb = [o["logprobs"].float() for o in outputs] if last else None
        if to_all_stages and self.pp > 1:
            flat = torch.cat(per_mb) if last else torch.empty(
                sum(mb.n_tokens for mb in micro_batches), dtype=torch.float32, device=self.device)
            dist.broadcast(flat, src=self.layout.pp_last_rank(), group=self.layout.pp_group())
            per_mb = list(torch.split(flat, [mb.n_tokens for mb in micro_batches]))
        return per_mb if per_mb is not None else [None] * len(micro_batches)

    def compute_logprobs(self, seqs: list[dict]) -> list[np.ndarray]:
        """log π(a_t|s_t) of every output token with the current weights, at `temperature`.

        Collective over this rank's pipeline and TP groups (not over data parallelism: each
        data-parallel rank computes what it is given).

        Args:
            seqs: dicts with `prompt_tokens` and `output_tokens` (int arrays; prompt non-empty).
        Returns:
            one float32 array `[len(output_tokens)]` per sequence, in input order, on every
            pipeline stage.
        """
        if not seqs:
            return []
        lengths = [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs]
        micro_batches = [self._pack(seqs, ids) for ids in self._plan(lengths, equalise_dp=False)]
        result: list[np.ndarray | None] = [None] * len(seqs)
        for mb, lp in zip(micro_batches, self._forward_logprobs(micro_batches, to_all_stages=True)):
            for i, part in zip(mb.seq_ids, torch.split(lp.cpu(), mb.out_lens)):
                result[i] = part.numpy()
        return result

    # ---------------------------------------------------------------- train

    @staticmethod
    def _prox_pass(plan: list[list[MicroBatch]]) -> list[MicroBatch]:
        """The micro-batches whose π_prox (recompute) needs a forward pass before the first
        optimizer step: every minibatch's but the first's. The first minibatch's training forward
        runs with the step's initial weights, so `_ppo_loss` takes its log-probs, detached
        (its prox_logprobs stay None). `TrainConfig.prox_pass_share` is this rule for the
        planners."""
        return [mb for minibatch in plan[1:] for mb in minibatch]

    def _ppo_loss(self, version: int, mb: MicroBatch, hidden: torch.Tensor):
        logprobs = self._token_logprobs(hidden, mb)
        if self.prox == "loglinear":
            prox = loglinear_prox_logprobs(mb.behav_logprobs, logprobs, mb.versions, version)
        elif mb.prox_logprobs is None:     # recompute, first minibatch: the weights are π_prox's
            prox = logprobs.detach()
        else:
            prox = mb.prox_logprobs
        loss, stats = decoupled_ppo_loss(
            logprobs,
            prox,
            mb.behav_logprobs,
            mb.advantages,
            mb.loss_mask,
            eps_clip=self.cfg.eps_clip,
            eps_clip_high=self.cfg.eps_clip_high,
            dual_clip=self.cfg.dual_clip,
            off_policy=self.off_policy,
            seq_lens=mb.out_lens,
        )
        n = mb.n_trained    # its mask's tokens: an observation token is in no count
        # decoupled_ppo_loss averages over this micro-batch; Megatron wants the sum and divides
        # the accumulated gradient by the minibatch's total token count.
        loss_sum = loss * n
        kept = n * (1.0 - stats["dropped_frac"])
        sums = {
            "loss": loss_sum.detach().clone(),  # .clone(): the schedule may rescale in place
            **{key: stats[key] * n for key in _TOKEN_STATS},
            "imp_weight_mean": stats["imp_weight_mean"] * kept,
            "kept": kept,
            "n_seqs": stats["n_seqs"],
            **{key: stats[key] * stats["n_seqs"] for key in _SEQ_STATS},
            "signal_tokens": stats["signal_tokens"],
        }
        return loss_sum, self._n_tokens(n), sums

    def plan_step(self, seqs: list[dict], per_token: dict) -> list[list[MicroBatch]]:
        """This rank's packed micro-batches, per minibatch (see the module docstring), of a
        whole batch."""
        per_rank = dp_split(sequence_lengths(seqs), self.cfg.ppo_minibatches, self.layout.dp)
        return self._pack_minibatches(seqs, per_token, per_rank[self.layout.dp_rank])

    def _pack_minibatches(self, seqs: list[dict], per_token: dict,
                          minibatches: list[list[int]]) -> list[list[MicroBatch]]:
        """Micro-batches of each minibatch (indices into `seqs`; this rank's share), the same
        number on every data-parallel rank."""
        lengths = sequence_lengths(seqs)
        plan = []
        for share in minibatches:
            groups = self._plan([lengths[i] for i in share], equalise_dp=True)
            plan.append([self._pack(seqs, [share[j] for j in g], per_token) for g in groups])
        return plan

    def train_step(self, seqs: list[dict], version: int = 0,
                   max_new_tokens: int | None = None) -> dict[str, float]:
        """One decoupled-PPO step (`ppo_minibatches` optimizer steps) on a whole batch: this
        rank's share of it (`shares.split_batch`), trained by `train_share`.

        Args:
            seqs: the whole batch, identical on every trainer rank, group-contiguous
                (`group_size` samples per prompt): dicts with `prompt_tokens`, `output_tokens`,
                `behav_logprobs` (float32, one per output token), `reward`, and for
                `prox="loglinear"` `versions` (the policy version of each output token).
            version: the version of the current weights (0 before the first step).
            max_new_tokens: the rollout's output limit (`overlong: shape` needs it).
        Returns:
            see `train_share`.
        """
        t0 = time.perf_counter()
        share = split_batch(seqs, self.cfg, self.group_size, self.layout.dp,
                            max_new_tokens)[self.layout.dp_rank]
        return self.train_share(share, version, t0=t0)

    def train_share(self, share: BatchShare, version: int = 0, t0: float | None = None,
                    should_stop=None) -> dict[str, float]:
        """One decoupled-PPO step on this data-parallel rank's share of a batch (every rank of
        the same data-parallel rank calls it with the same share; all ranks together).

        Args:
            share: this rank's `BatchShare` (`shares.split_batch` of the whole batch, on the
                trainer's rank 0): its sequences per minibatch, with their advantages, and the
                whole batch's statistics.
            version: the version of the current weights (0 before the first step).
            t0: `time.perf_counter()` when the step began (default: now).
            should_stop: None, or `should_stop(done, total, minibatch_s)` -> bool, called on
                every rank at each decision point: before π_prox (done = 0) and after each
                minibatch but the last (`minibatch_s`: seconds its `done` minibatches took). It
                must return the same on every rank (the trainer's is collective). With it, the
                step's start state is kept in host memory (`StepSnapshot`); when it returns True,
                that state is restored and `StepAbandoned` raised.
        Returns:
            loss (token mean over the batch), grad_norm (mean over minibatches), lr (last
            optimizer step), reward_mean (raw), adv_abs_mean, clip_frac, ratio_mean,
            imp_weight_mean, dropped_frac, approx_kl, n_tokens, n_seqs, n_micro_batches (this
            rank, all minibatches), skipped_steps (fp16 overflow), and seconds spent packing,
            recomputing π_prox, in forward/backward, in the optimizer, and in the whole step.
        """
        t0 = time.perf_counter() if t0 is None else t0
        if share.no_signal:
            return self._no_signal_step(share, t0)
        seqs = [s for minibatch in share.minibatches for s in minibatch]
        per_token = {
            "behav_logprobs": [s["behav_logprobs"] for s in seqs],
            "advantages": [np.full(len(s["output_tokens"]), s["advantage"]) for s in seqs],
            "loss_mask": [s.get("loss_mask", np.ones(len(s["output_tokens"]))) for s in seqs]}
        if self.prox == "loglinear":
            per_token["versions"] = [s["versions"] for s in seqs]
        ids, offset = [], 0
        for minibatch in share.minibatches:
            ids.append(list(range(offset, offset + len(minibatch))))
            offset += len(minibatch)
        plan = self._pack_minibatches(seqs, per_token, ids)
        t_pack = time.perf_counter() - t0
        snapshot = None
        if should_stop is not None:
            self._snapshot = self._snapshot or StepSnapshot()
            snapshot = self._snapshot.take(self)
            if should_stop(0, len(plan), 0.0):
                snapshot.restore(self)
                raise StepAbandoned(0, len(plan))

        # π_prox once, with the weights at the start of the step, before the first minibatch.
        t1 = time.perf_counter()
        all_mbs = [mb for minibatch in plan for mb in minibatch]
        if self.prox == "recompute" and (passed := self._prox_pass(plan)):
            for mb, lp in zip(passed, self._forward_logprobs(passed, to_all_stages=False)):
                mb.prox_logprobs = lp
        elif self.prox == "behaviour":
            for mb in all_mbs:
                mb.prox_logprobs = mb.behav_logprobs
        t_prox = time.perf_counter() - t1

        self.model.train()
        outputs, grad_norms, skipped, idle, t_fb, t_opt = [], [], 0, 0, 0.0, 0.0
        for k, micro_batches in enumerate(plan):
            if snapshot is not None and k and should_stop(k, len(plan), t_fb + t_opt):
                snapshot.restore(self)
                raise StepAbandoned(k, len(plan))
            t1 = time.perf_counter()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            out = self._run(micro_batches, partial(self._ppo_loss, version), forward_only=False)
            outputs += out
            t2 = time.perf_counter()
            self.lr_scheduler.step(1)
            # No token of this minibatch gives a gradient, on any rank: no optimizer step
            # (Adam's momentum and weight decay would move the weights at zero gradient).
            if self._reduce_sums(out, keys=("signal_tokens",))["signal_tokens"] == 0:
                idle += 1
            else:
                with CudaToCpuMode():
                    ok, grad_norm, _ = self.optimizer.step()
                skipped += not ok
                grad_norms.append(float(grad_norm) if grad_norm is not None else _NAN)
            t_fb, t_opt = t_fb + t2 - t1, t_opt + time.perf_counter() - t2

        sums = self._reduce_sums(outputs, n_tokens=sum(mb.n_trained for mb in all_mbs))
        denom = max(sums["n_tokens"], 1.0)
        return {
            "loss": sums["loss"] / denom,
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else _NAN,
            "lr": self.optimizer.param_groups[0]["lr"],
            "reward_mean": share.reward_mean,
            "adv_abs_mean": share.adv_abs_mean,
            "clip_frac": sums["clip_frac"] / denom,
            "ratio_mean": sums["ratio_mean"] / denom,
            # w over the kept tokens: NaN when none was kept
            "imp_weight_mean": sums["imp_weight_mean"] / sums["kept"] if sums["kept"] else _NAN,
            "dropped_frac": sums["dropped_frac"] / denom,
            "approx_kl": sums["approx_kl"] / denom,
            **{key: sums[key] / denom for key in ("seq_masked_frac", "tr_masked_frac", "kl_behav",
                                                  "kl_prox_behav")},
            # effective sample size of r = π_θ/π_behav over the step's forward passes, as a share
            # of the tokens (sequences: of each sequence's geometric-mean r); 1 = on-policy
            "ess": _ess(sums["r_mean"], sums["r_sq_mean"], sums["n_tokens"]),
            "seq_ess": _ess(sums["seq_r_mean"], sums["seq_r_sq_mean"], sums["n_seqs"]),
            "n_tokens": int(sums["n_tokens"]),
            "n_seqs": share.n_seqs,
            **share.stats,
            "no_signal_minibatches": idle,
            "no_signal_steps": int(idle == len(plan)),
            "n_micro_batches": len(all_mbs),
            "skipped_steps": skipped,
            "pack_seconds": t_pack,
            "prox_seconds": t_prox,
            "fwd_bwd_seconds": t_fb,
            "optim_seconds": t_opt,
            "seconds": time.perf_counter() - t0,
        }

    def _no_signal_step(self, share: BatchShare, t0: float) -> dict[str, float]:
        """A step whose batch has nothing to learn from (`BatchShare.no_signal`): no forward, no
        optimizer step (Adam's momentum would move the weights at zero gradient); the learning
        rate schedule goes on as if its minibatches had run. Its diagnostics were not measured:
        NaN (null in metrics.jsonl), not the values of a perfectly on-policy step."""
        for _ in range(self.cfg.ppo_minibatches):
            self.lr_scheduler.step(1)
        seconds = dict.fromkeys(("pack_seconds", "prox_seconds", "fwd_bwd_seconds", "optim_seconds"), 0.0)
        return {**dict.fromkeys(_DIAGNOSTICS, _NAN), **seconds,
                "lr": self.optimizer.param_groups[0]["lr"], "reward_mean": share.reward_mean,
                "adv_abs_mean": share.adv_abs_mean, "n_tokens": 0, "n_seqs": share.n_seqs,
                **share.stats, "no_signal_minibatches": self.cfg.ppo_minibatches,
                "no_signal_steps": 1, "n_micro_batches": 0, "skipped_steps": 0,
                "seconds": time.perf_counter() - t0}

    def _reduce_sums(self, outputs: list[dict], n_tokens: int = 0,
                     keys: tuple[str, ...] = _SUM_KEYS) -> dict[str, float]:
        """Sums of `keys` over `outputs` and `n_tokens`, over the whole batch: from the last
        pipeline stage (the only one with loss outputs; the other stages add zeros) and over
        data-parallel ranks; the same on every trainer rank. One vector, two all-reduces."""
        vec = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.device)
        if self.layout.last_stage:
            for j, key in enumerate(keys):
                vec[j] = sum(float(o[key]) for o in outputs)
            vec[-1] = n_tokens
        if self.pp > 1:
            dist.all_reduce(vec, group=self.layout.pp_group())
        if self.layout.dp > 1:
            dist.all_reduce(vec, group=self.layout.dp_group())
        return dict(zip((*keys, "n_tokens"), vec.tolist()))

    # ---------------------------------------------------------------- weights

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights on the first pipeline stage ({} on later ones), all in the
        parameter dtype (without TransformerEngine/Apex, Megatron keeps norm weights in fp32).

        Collective over TP and PP; see `megatron_model.hf_state_dict`.
        """
        state = megatron_model.hf_state_dict(self.model, self.hf_config)
        return {k: v.to(self.params_dtype) for k, v in state.items()}

    def iter_hf_weights(self):
        """This pipeline stage's full HF-named weights, one at a time, in the parameter dtype.

        Collective over this rank's TP group; see `megatron_model.iter_stage_hf`. The weight
        path runs it on data-parallel rank 0 only (the other replicas hold the same weights).
        """
        for name, tensor in megatron_model.iter_stage_hf(self.model, self.hf_config):
            yield name, tensor.to(self.params_dtype)

    @property
    def weight_stage(self) -> int | None:
        """The pipeline stage whose weights this rank gathers for the generators, or None."""
        return self.layout.weight_stage

    @property
    def is_weight_sender(self) -> bool:
        """This rank sends its stage's weights (dp = tp = 0); its TP peers gather along."""
        return self.layout.is_weight_sender

    def save_hf(self, out_dir: str) -> None:
        """Write a HF model directory loadable by transformers and vLLM.

        Collective (calls `hf_state_dict`); the rank with dp = tp = pp = 0 writes.
        config.json, tokenizer and other non-weight files are copied from `model_dir`.
        """
        state = self.hf_state_dict()
        if not self.layout.is_first:
            return
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(os.listdir(self.model_dir)):
            src = os.path.join(self.model_dir, name)
            if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(src, os.path.join(out_dir, name))
        cpu_state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(cpu_state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
