"""The policy on the trainer ranks: Megatron GPTModel + DDP + Megatron optimizer.

One `train_step` is one decoupled-PPO update (AReaL, one minibatch per step):
GRPO advantages -> π_prox by recompute -> forward/backward over packed micro-batches ->
one optimizer step. Loss aggregation is a token mean over the whole batch (across micro-batches
and data-parallel ranks): each micro-batch returns its loss *sum* and token count, and Megatron
(`calculate_per_token_loss`) divides the accumulated gradient by the global token count.

Micro-batches are padding-free: their sequences are concatenated into one row with a
block-diagonal causal mask (THD packing needs TransformerEngine; the mask is exact, see
shared/notes/megatron-on-cpu.md Q5). RoPE is relative, so positions need no reset.

Requires `megatron_model.init_megatron_parallel` first; every trainer rank constructs an Actor and
calls its methods together (they are collective over Megatron's groups).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from safetensors.torch import save_file

from areal_hpc.algo.packing import pack_sequences
from areal_hpc.algo.ppo import decoupled_ppo_loss, grpo_advantages
from areal_hpc.train import megatron_model
from areal_hpc.train.cpu_compat import CudaToCpuMode

# Files of a HF model directory that are weights (rewritten by save_hf); all others are copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclass
class _MicroBatch:
    """One packed row. S = total tokens of its sequences, N = their output tokens."""

    seq_ids: list[int]  # indices into the step's `seqs`
    out_lens: list[int]  # output tokens per sequence
    tokens: torch.Tensor  # [1, S] int64
    position_ids: torch.Tensor  # [1, S] int64, restarting per sequence
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True = masked
    out_pos: torch.Tensor  # [N] positions whose logits predict the output tokens
    targets: torch.Tensor  # [1, N] int64, the output tokens
    # training only, [N] float32
    prox_logprobs: torch.Tensor | None = None
    behav_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.out_pos.numel())


class Actor:
    """The trained policy on one trainer rank (TP shard of it; pp == 1 for now).

    Args (plain values, from the run config):
        model_dir: HF directory (config.json + *.safetensors) of the initial policy.
        tp, pp: Megatron parallel sizes, as given to `init_megatron_parallel`.
        lr, weight_decay, betas, eps, clip_grad: Adam(W) via Megatron's optimizer, constant lr.
        temperature: sampling temperature; logits are divided by it so that recomputed
            log-probs match the inference engine's.
        eps_clip, behav_imp_weight_cap: decoupled PPO (see `algo.ppo.decoupled_ppo_loss`).
        max_tokens_per_mb: token budget of one packed micro-batch (prompt + output tokens).
        group_size: samples per prompt, for GRPO advantages.
        device: "cpu" or a CUDA device of this rank.
        bf16: bf16 parameters with fp32 main params/grads in the optimizer (GPU only).
        seed: Megatron's RNG seed, used if the Actor has to initialise Megatron's parallel state
            itself (torch.distributed must already be initialised over the trainer ranks).
    """

    def __init__(
        self,
        model_dir: str,
        tp: int = 1,
        pp: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        temperature: float = 1.0,
        eps_clip: float = 0.2,
        behav_imp_weight_cap: float | None = 5.0,
        eps_clip_high: float | None = None,
        dual_clip: float | None = None,
        max_tokens_per_mb: int = 8192,
        group_size: int = 1,
        device: str | torch.device = "cpu",
        bf16: bool = False,
        seed: int = 0,
    ):
        if pp > 1:
            # Missing for PP: broadcast of logprobs/stats from the last stage, and a test.
            raise NotImplementedError("Actor supports pp == 1 for now")
        self.model_dir = model_dir
        self.temperature = temperature
        self.eps_clip = eps_clip
        self.behav_imp_weight_cap = behav_imp_weight_cap
        self.eps_clip_high, self.dual_clip = eps_clip_high, dual_clip
        self.max_tokens_per_mb = max_tokens_per_mb
        self.group_size = group_size
        self.device = torch.device(device)
        self.hf_config = megatron_model.read_hf_config(model_dir)
        if not parallel_state.model_parallel_is_initialized():
            megatron_model.init_megatron_parallel(tp, pp, seed)

        model = megatron_model.build_gpt_model(
            self.hf_config,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            tp=tp,
            pp=pp,
            device=self.device,
            calculate_per_token_loss=True,
        )
        megatron_model.load_hf_checkpoint(model, model_dir, self.hf_config)
        self.model = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=model,
        )
        config = model.config
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            clip_grad=clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        with CudaToCpuMode():
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    # ---------------------------------------------------------------- batches

    def _micro_batches(self, seqs: list[dict], extras: dict[str, list[np.ndarray]] | None = None):
        lengths = [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs]
        for mb_ids in pack_sequences(lengths, self.max_tokens_per_mb):
            yield self._pack(seqs, mb_ids, extras)

    def _pack(self, seqs: list[dict], mb_ids: list[int], extras) -> _MicroBatch:
        tokens, positions, segments, out_pos, out_lens = [], [], [], [], []
        offset = 0
        for k, i in enumerate(mb_ids):
            prompt = np.asarray(seqs[i]["prompt_tokens"], dtype=np.int64)
            output = np.asarray(seqs[i]["output_tokens"], dtype=np.int64)
            if len(prompt) == 0:
                raise ValueError(f"sequence {i} has an empty prompt")
            n = len(prompt) + len(output)
            tokens += [prompt, output]
            positions.append(np.arange(n))
            segments.append(np.full(n, k))
            # logits at position p predict token p + 1
            out_pos.append(offset + len(prompt) - 1 + np.arange(len(output)))
            out_lens.append(len(output))
            offset += n
        dev = self.device
        seg = torch.from_numpy(np.concatenate(segments)).to(dev)
        s = seg.numel()
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1)
        mask = causal | (seg[:, None] != seg[None, :])
        out_pos_t = torch.from_numpy(np.concatenate(out_pos)).to(dev)
        tokens_t = torch.from_numpy(np.concatenate(tokens)).to(dev)[None]
        mb = _MicroBatch(
            seq_ids=mb_ids,
            out_lens=out_lens,
            tokens=tokens_t,
            position_ids=torch.from_numpy(np.concatenate(positions)).to(dev)[None],
            attention_mask=mask[None, None],
            out_pos=out_pos_t,
            targets=tokens_t[:, out_pos_t + 1],
        )
        if extras is not None:
            for name, per_seq in extras.items():
                flat = np.concatenate([np.asarray(per_seq[i], dtype=np.float32) for i in mb_ids])
                setattr(mb, name, torch.from_numpy(flat).to(dev))
        return mb

    # ---------------------------------------------------------------- forward

    def _token_logprobs(self, logits: torch.Tensor, mb: _MicroBatch) -> torch.Tensor:
        """`[N]` log π(a_t|s_t) at temperature T from this TP rank's vocab slice of the logits."""
        picked = logits[:, mb.out_pos].float() / self.temperature  # [1, N, V/tp], a new tensor:
        # vocab_parallel_cross_entropy works in place on its input.
        return -vocab_parallel_cross_entropy(picked, mb.targets)[0]

    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.tokens, mb.position_ids, mb.attention_mask)  # [1, S, V/tp]
        return logits, partial(loss_fn, mb)

    def _run(self, micro_batches: list[_MicroBatch], loss_fn, forward_only: bool) -> list[dict]:
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

    def _logprob_loss(self, mb: _MicroBatch, logits: torch.Tensor):
        logprobs = self._token_logprobs(logits, mb)
        zero = torch.zeros((), device=self.device)
        return zero, self._n_tokens(mb.n_tokens), {"logprobs": logprobs.detach().clone()}

    @torch.no_grad()
    def compute_logprobs(self, seqs: list[dict]) -> list[np.ndarray]:
        """log π(a_t|s_t) of every output token with the current weights, at `temperature`.

        Args:
            seqs: dicts with `prompt_tokens` and `output_tokens` (int arrays; prompt non-empty).
        Returns:
            one float32 array `[len(output_tokens)]` per sequence, in input order.
        """
        if not seqs:
            return []
        micro_batches = list(self._micro_batches(seqs))
        outputs = self._run(micro_batches, self._logprob_loss, forward_only=True)
        result: list[np.ndarray | None] = [None] * len(seqs)
        for mb, out in zip(micro_batches, outputs, strict=True):
            per_seq = torch.split(out["logprobs"].float().cpu(), mb.out_lens)
            for i, lp in zip(mb.seq_ids, per_seq):
                result[i] = lp.numpy()
        return result

    # ---------------------------------------------------------------- train

    def _ppo_loss(self, mb: _MicroBatch, logits: torch.Tensor):
        logprobs = self._token_logprobs(logits, mb)
        mask = torch.ones_like(logprobs, dtype=torch.bool)
        loss, stats = decoupled_ppo_loss(
            logprobs,
            mb.prox_logprobs,
            mb.behav_logprobs,
            mb.advantages,
            mask,
            eps_clip=self.eps_clip,
            behav_imp_weight_cap=self.behav_imp_weight_cap,
            eps_clip_high=self.eps_clip_high,
            dual_clip=self.dual_clip,
        )
        n = mb.n_tokens
        # decoupled_ppo_loss averages over this micro-batch; Megatron wants the sum and divides
        # the accumulated gradient by the batch's total token count.
        loss_sum = loss * n
        kept = n * (1.0 - stats["dropped_frac"])
        sums = {
            "loss": loss_sum.detach().clone(),  # .clone(): the schedule may rescale in place
            "clip_frac": stats["clip_frac"] * n,
            "ratio_mean": stats["ratio_mean"] * n,
            "dropped_frac": stats["dropped_frac"] * n,
            "approx_kl": stats["approx_kl"] * n,
            "imp_weight_mean": stats["imp_weight_mean"] * kept,
            "kept": kept,
        }
        return loss_sum, self._n_tokens(n), sums

    def train_step(self, seqs: list[dict]) -> dict[str, float]:
        """One decoupled-PPO optimizer step on a batch of trajectories.

        Args:
            seqs: group-contiguous (`group_size` samples per prompt) dicts with `prompt_tokens`,
                `output_tokens`, `behav_logprobs` (float32, one per output token) and `reward`.
        Returns:
            loss (token mean), grad_norm, reward_mean, clip_frac, ratio_mean, imp_weight_mean,
            dropped_frac, approx_kl, n_tokens, n_seqs (summed over data-parallel ranks),
            n_micro_batches (this rank), prox_seconds (recompute) and seconds (whole step).
        """
        t0 = time.perf_counter()
        rewards = torch.tensor([float(s["reward"]) for s in seqs], dtype=torch.float32)
        seq_adv = grpo_advantages(rewards, self.group_size).numpy()
        prox = self.compute_logprobs(seqs)
        t_prox = time.perf_counter() - t0

        extras = {
            "prox_logprobs": prox,
            "behav_logprobs": [s["behav_logprobs"] for s in seqs],
            "advantages": [np.full(len(s["output_tokens"]), a) for s, a in zip(seqs, seq_adv)],
        }
        for i, s in enumerate(seqs):
            if len(s["behav_logprobs"]) != len(s["output_tokens"]):
                raise ValueError(f"sequence {i}: behav_logprobs and output_tokens differ in length")
        micro_batches = list(self._micro_batches(seqs, extras))

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro_batches, self._ppo_loss, forward_only=False)
        with CudaToCpuMode():
            _, grad_norm, _ = self.optimizer.step()

        sums = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        sums["n_tokens"] = sum(mb.n_tokens for mb in micro_batches)
        sums["reward"] = float(rewards.sum())
        sums["n_seqs"] = len(seqs)
        sums = self._sum_over_data_parallel(sums)
        denom = max(sums["n_tokens"], 1.0)
        return {
            "loss": sums["loss"] / denom,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "reward_mean": sums["reward"] / sums["n_seqs"],
            "clip_frac": sums["clip_frac"] / denom,
            "ratio_mean": sums["ratio_mean"] / denom,
            "imp_weight_mean": sums["imp_weight_mean"] / max(sums["kept"], 1.0),
            "dropped_frac": sums["dropped_frac"] / denom,
            "approx_kl": sums["approx_kl"] / denom,
            "n_tokens": int(sums["n_tokens"]),
            "n_seqs": int(sums["n_seqs"]),
            "n_micro_batches": len(micro_batches),
            "prox_seconds": t_prox,
            "seconds": time.perf_counter() - t0,
        }

    def _sum_over_data_parallel(self, sums: dict[str, float]) -> dict[str, float]:
        """Batch statistics over all data-parallel ranks (each trains on its own sequences)."""
        if parallel_state.get_data_parallel_world_size() == 1:
            return sums
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(vec, group=parallel_state.get_data_parallel_group())
        return dict(zip(keys, vec.tolist()))

    # ---------------------------------------------------------------- weights

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (collective over TP; the whole model on every rank for pp == 1)."""
        return megatron_model.hf_state_dict(self.model, self.hf_config)

    def save_hf(self, out_dir: str) -> None:
        """Write a HF model directory loadable by transformers and vLLM.

        Collective (calls `hf_state_dict`); the first rank of each data-parallel/TP group writes.
        config.json, tokenizer and other non-weight files are copied from `model_dir`.
        """
        state = self.hf_state_dict()
        if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_tensor_model_parallel_rank() != 0:
            return
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(os.listdir(self.model_dir)):
            src = os.path.join(self.model_dir, name)
            if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(src, os.path.join(out_dir, name))
        cpu_state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(cpu_state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
