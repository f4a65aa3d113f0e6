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

from dataclasses import dataclass, field

import numpy as np
import torch

from areal_hpc.algo.packing import balanced_allocate
from areal_hpc.algo.ppo import (STORED_REWARD_DTYPE, compute_advantages, equal_reward_groups,
                                shape_rewards, token_normalised)
from areal_hpc.config import TrainConfig

# The fields of a sequence that training reads (plus `versions` for prox: loglinear, and
# `loss_mask` where a sequence has one: a multi-turn episode's, 0 on its observation tokens).
TRAIN_KEYS = ("prompt_tokens", "output_tokens", "behav_logprobs")
MASK = "loss_mask"


def _sampled(s: dict, key: str):
    """A per-token field of sequence `s` at its sampled tokens (all of them without a mask)."""
    m = s.get(MASK)
    return s[key] if m is None else np.asarray(s[key])[np.asarray(m, dtype=bool)]


def trained_tokens(s: dict) -> int:
    """The output tokens of sequence `s` that the loss trains on: those its loss mask keeps
    (the sampled ones of an episode), all of them without one."""
    m = s.get(MASK)
    return len(s["output_tokens"]) if m is None else int(np.count_nonzero(m))


@dataclass
class BatchShare:
    """One data-parallel rank's part of a step's batch.

    minibatches: per minibatch (`ppo_minibatches` of them), this rank's sequences in the order
        they are packed: dicts with TRAIN_KEYS, `advantage` (the sequence's, float32) and for
        `prox: loglinear` `versions`. A list may be empty (fewer sequences than ranks).
    n_seqs, reward_mean, adv_abs_mean: of the whole batch (raw reward; |advantage| per sequence).
    stats: the batch's collapse diagnostics and what the guards left out (`guard`).
    no_signal: every advantage left is 0, or fewer sequences are left than minibatches: the
        step trains nothing and moves no weight (Adam's momentum would, at zero gradient).
    """
    minibatches: list[list[dict]]
    n_seqs: int
    reward_mean: float
    adv_abs_mean: float
    stats: dict = field(default_factory=dict)   # the batch's, from `guard`
    no_signal: bool = False     # nothing left to learn from: the step leaves the weights alone


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


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to `max_new_tokens - buffer` output tokens, then
    down linearly to -1 at `max_new_tokens` (a sample cut there gets -1)."""
    return np.clip((max_new_tokens - buffer - lengths) / buffer, -1.0, 0.0)


def discard_decisions(discard, group_size: int, on_error: str) -> tuple[np.ndarray, np.ndarray]:
    """(valid: `[num_seqs]` bool, the sequences that count as outcomes: in the loss and in their
    group's baseline; zero: the ones scored 0 instead) of a batch whose `discard` (`[num_seqs]`
    bool or None) marks the episodes their environment failed or discarded (env.on_error)."""
    d = np.asarray(discard, dtype=bool)
    if on_error == "score_zero":
        return np.ones(len(d), bool), d
    if on_error == "drop_group":
        return ~np.repeat(d.reshape(-1, group_size).any(axis=1), group_size), np.zeros(len(d), bool)
    if on_error != "drop_episode":
        raise ValueError(f"env.on_error must be drop_episode, drop_group or score_zero, got {on_error!r}")
    return ~d, np.zeros(len(d), bool)


def guard_decisions(rewards: np.ndarray, n_out: np.ndarray, cut: np.ndarray, cfg: TrainConfig,
                    group_size: int, max_new_tokens: int | None, discard=None,
                    on_error: str = "drop_episode"
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the collapse guards decide about a batch, from its columns as the rollout log holds
    them: the trainer (`guard`) and the audit both call this.

    Args:
        rewards: `[num_seqs]` raw rewards, group-contiguous; rounded here to the log's dtype
            (`STORED_REWARD_DTYPE`), so that what the trainer decides the log can show.
        n_out: output tokens per sequence; cut: finish_reason "length" per sequence.
        discard: `[num_seqs]` bool (None: none), the discarded episodes; on_error: what they
            do (`discard_decisions`).
    Returns:
        (keep: `[num_seqs]` bool, the sequences left in the loss; the rewards advantages are
        computed from, float64, after `overlong: shape`; zero_var: `[num_groups]` bool, groups
        whose rewards, as advantages see them, are all equal over their valid sequences
        (`equal_reward_groups` on them shaped, biased, scaled and clipped); valid: `[num_seqs]`
        bool, the sequences each group's statistics are over).
    """
    shaped = np.asarray(rewards, dtype=STORED_REWARD_DTYPE).astype(np.float64)
    valid, zero = discard_decisions(np.zeros(len(shaped), bool) if discard is None else discard,
                                    group_size, on_error)
    shaped[zero] = 0.0
    if cfg.overlong == "shape":
        if max_new_tokens is None:
            raise ValueError("overlong: shape needs the rollout's max_new_tokens")
        shaped = shaped + overlong_penalty(np.asarray(n_out), max_new_tokens, cfg.overlong_buffer)
    if len(shaped) % group_size:
        raise ValueError(f"{len(shaped)} sequences do not split into groups of {group_size}")
    final = shape_rewards(torch.from_numpy(shaped), cfg.reward_bias, cfg.reward_scaling,
                          cfg.reward_clip)
    zero_var = equal_reward_groups(final, group_size, valid)
    keep = valid.copy()
    if cfg.filter_zero_variance:
        keep &= ~np.repeat(zero_var, group_size)
    if cfg.overlong == "filter":
        keep &= ~np.asarray(cut, dtype=bool)
    return keep, shaped, zero_var, valid


def guard(seqs: list[dict], cfg: TrainConfig, group_size: int, max_new_tokens: int | None,
          on_error: str = "drop_episode") -> tuple[list[int], np.ndarray, np.ndarray, dict]:
    """The collapse guards of `train` on a whole batch, before its advantages
    (`guard_decisions`).

    Returns (indices of the sequences left in the loss, group-contiguous; every sequence's
    reward after `overlong: shape`; which sequences count in their group's statistics (not
    discarded, `discard_decisions`); the batch's statistics: `zero_var_groups` (groups whose
    rewards are all equal), `filtered_seqs` (left out by `filter_zero_variance` and
    `overlong: filter`), `truncated_frac` (share cut at max_new_tokens, finish_reason
    "length"), `entropy` (mean -log π_behav of the sampled tokens: an estimate of the sampling
    policy's per-token entropy)). A filtered group keeps its rows consumed: counted, not lost."""
    n_out = np.array([len(s["output_tokens"]) for s in seqs])
    cut = np.array([s.get("finish_reason") == "length" for s in seqs], dtype=bool)
    discard = np.array([bool(s.get("discard")) for s in seqs], dtype=bool)
    keep, shaped, zero_var, valid = guard_decisions(
        np.array([float(s["reward"]) for s in seqs]), n_out, cut, cfg, group_size, max_new_tokens,
        discard, on_error)
    n_tok = max(sum(trained_tokens(s) for s in seqs), 1)
    entropy = -sum(float(np.sum(_sampled(s, "behav_logprobs"), dtype=np.float64))
                   for s in seqs) / n_tok
    stats = {"zero_var_groups": int(zero_var.sum()), "filtered_seqs": int((~keep).sum()),
             "truncated_frac": float(cut.mean()) if len(seqs) else 0.0, "entropy": entropy}
    return [int(i) for i in np.flatnonzero(keep)], shaped, valid, stats


def split_batch(seqs: list[dict], cfg: TrainConfig, group_size: int, dp: int,
                max_new_tokens: int | None = None, on_error: str = "drop_episode") -> list[BatchShare]:
    """The `dp` shares of a whole batch (see the module docstring), after the collapse guards
    (`guard`).

    Args:
        seqs: the whole batch, group-contiguous (`group_size` samples per prompt): dicts with
            `prompt_tokens`, `output_tokens`, `behav_logprobs` (one per output token), `reward`,
            `finish_reason` (for the overlong guard; absent: not cut), and for
            `prox="loglinear"` `versions`; other fields are left behind.
        max_new_tokens: the rollout's output limit (`overlong: shape` needs it).
        on_error: env.on_error, what a discarded episode (`discard` set) does (`guard`).
    Raises:
        ValueError: fewer sequences than minibatches, or a per-token field whose length is not
            the output's.
    """
    if len(seqs) < cfg.ppo_minibatches:
        raise ValueError(f"{len(seqs)} sequences cannot fill {cfg.ppo_minibatches} minibatches")
    keys = TRAIN_KEYS + (("versions",) if cfg.prox == "loglinear" else ())
    for i, s in enumerate(seqs):
        for key in keys[2:] + ((MASK,) if s.get(MASK) is not None else ()):
            if len(s[key]) != len(s["output_tokens"]):
                raise ValueError(f"sequence {i}: {key} and output_tokens differ in length")
    kept, shaped, valid, stats = guard(seqs, cfg, group_size, max_new_tokens, on_error)
    reward_mean = float(np.mean([float(s["reward"]) for s in seqs]))
    # Advantages of what is left: group statistics over whole groups (a sequence cut by
    # `overlong: filter` counted in its group's), `adv_norm: batch` over the kept tokens only.
    n_out = torch.tensor([trained_tokens(s) for s in seqs])   # a token mean's weights
    args = (group_size, cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip, cfg.reward_norm)
    some = None if valid.all() else valid
    if len(kept) == len(seqs) or cfg.adv_norm == "none":
        adv_all = compute_advantages(torch.from_numpy(shaped), n_out, *args, cfg.adv_norm, some)
    else:
        adv_all = compute_advantages(torch.from_numpy(shaped), n_out, *args, "none", some)
        if kept:
            ids = torch.tensor(kept)
            adv_all[ids] = token_normalised(adv_all[ids], n_out[ids]).float()
    adv = adv_all.numpy()
    adv_abs_mean = float(np.abs(adv).mean())
    no_signal = len(kept) < cfg.ppo_minibatches or not np.any(adv[kept])
    stats["no_signal_steps"] = int(no_signal)

    def slim(i: int) -> dict:
        has = (MASK,) if seqs[i].get(MASK) is not None else ()
        return {**{k: seqs[i][k] for k in keys + has}, "advantage": adv[i]}

    if no_signal:
        return [BatchShare([[] for _ in range(cfg.ppo_minibatches)], len(seqs), reward_mean,
                           adv_abs_mean, stats, no_signal=True) for _ in range(dp)]
    lengths = sequence_lengths([seqs[i] for i in kept])
    return [BatchShare([[slim(kept[j]) for j in ids] for ids in per_rank], len(seqs), reward_mean,
                       adv_abs_mean, stats)
            for per_rank in dp_split(lengths, cfg.ppo_minibatches, dp)]
