"""A step's batch split into data-parallel shares, once, on trainer rank 0.

Everything of a decoupled-PPO step that needs the whole batch happens here: the checks, the
advantages (reward shaping, GRPO group norm, `adv_norm: batch` over all tokens of the batch), the
batch-wide statistics (sequences, mean reward, mean |advantage|), the split into
`train.ppo_minibatches` minibatches and the split of each minibatch into `dp` shares (both
`balanced_allocate` on sequence lengths). Each data-parallel rank then needs only its
`BatchShare`: `Actor.train_share` packs and trains it, and the token-count denominators of the loss
are all-reduced there as before. The trainer sends each rank only its share
(`transport.mpi.GroupScatter`); `Actor.train_step` on a whole batch takes its own share from
`split_batch` too, so both paths train on the same sequences in the same order, bit for bit.

Pure Python, numpy and torch (no Megatron, no process groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areal_hpc.algo.packing import balanced_allocate
from areal_hpc.algo.ppo import compute_advantages
from areal_hpc.config import TrainConfig

# The fields of a sequence that training reads (plus `versions` for prox: loglinear).
TRAIN_KEYS = ("prompt_tokens", "output_tokens", "behav_logprobs")


@dataclass
class BatchShare:
    """One data-parallel rank's part of a step's batch.

    minibatches: per minibatch (`ppo_minibatches` of them), this rank's sequences in the order
        they are packed: dicts with TRAIN_KEYS, `advantage` (the sequence's, float32) and for
        `prox: loglinear` `versions`. A list may be empty (fewer sequences than ranks).
    n_seqs, reward_mean, adv_abs_mean: of the whole batch (raw reward; |advantage| per sequence).
    """
    minibatches: list[list[dict]]
    n_seqs: int
    reward_mean: float
    adv_abs_mean: float


def sequence_lengths(seqs: list[dict]) -> list[int]:
    """Prompt + output tokens of each sequence."""
    return [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs]


def dp_split(lengths: list[int], ppo_minibatches: int, dp: int) -> list[list[list[int]]]:
    """Indices into the batch, `[dp rank][minibatch]`: `ppo_minibatches` balanced minibatches
    (no token budget), each split into `dp` balanced shares. Depends on the lengths only, so that
    the minibatches do not depend on `dp`."""
    out: list[list[list[int]]] = [[] for _ in range(dp)]
    for mb_ids in balanced_allocate(lengths, sum(lengths), min_groups=ppo_minibatches):
        mb_lens = [lengths[i] for i in mb_ids]
        shares = balanced_allocate(mb_lens, max(sum(mb_lens), 1), min_groups=dp)
        for rank in range(dp):
            out[rank].append([mb_ids[j] for j in shares[rank]])
    return out


def split_batch(seqs: list[dict], cfg: TrainConfig, group_size: int, dp: int) -> list[BatchShare]:
    """The `dp` shares of a whole batch (see the module docstring).

    Args:
        seqs: the whole batch, group-contiguous (`group_size` samples per prompt): dicts with
            `prompt_tokens`, `output_tokens`, `behav_logprobs` (one per output token), `reward`,
            and for `prox="loglinear"` `versions`; other fields are left behind.
    Raises:
        ValueError: fewer sequences than minibatches, or a per-token field whose length is not
            the output's.
    """
    if len(seqs) < cfg.ppo_minibatches:
        raise ValueError(f"{len(seqs)} sequences cannot fill {cfg.ppo_minibatches} minibatches")
    keys = TRAIN_KEYS + (("versions",) if cfg.prox == "loglinear" else ())
    for i, s in enumerate(seqs):
        for key in keys[2:]:
            if len(s[key]) != len(s["output_tokens"]):
                raise ValueError(f"sequence {i}: {key} and output_tokens differ in length")
    n_out = torch.tensor([len(s["output_tokens"]) for s in seqs])
    rewards = torch.tensor([float(s["reward"]) for s in seqs], dtype=torch.float64)
    adv = compute_advantages(
        rewards, n_out, group_size, cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip,
        cfg.reward_norm, cfg.adv_norm,
    ).numpy()
    reward_mean, adv_abs_mean = float(rewards.mean()), float(np.abs(adv).mean())

    def slim(i: int) -> dict:
        return {**{k: seqs[i][k] for k in keys}, "advantage": adv[i]}

    return [BatchShare([[slim(i) for i in ids] for ids in per_rank], len(seqs), reward_mean,
                       adv_abs_mean)
            for per_rank in dp_split(sequence_lengths(seqs), cfg.ppo_minibatches, dp)]
