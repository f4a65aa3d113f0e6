"""A data-parallel share's packed micro-batches: which sequences go together (`plan_micro_batches`)
and each group as one padding-free row (`pack`). Pure: no Megatron state, no collectives (the
actor passes the data-parallel maximum in).

A row is its sequences concatenated, position ids restarting per sequence. With varlen attention
(the default) each sequence attends within itself through Megatron's THD `PackedSeqParams`
(`areal_hpc.train.attention`); with `mask` the row gets a dense block-diagonal causal `[S, S]`
mask. With sequence parallelism the row is padded to a multiple of tp by a separate dummy
sequence that nothing attends to and that predicts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from areal_hpc.algo.packing import balanced_allocate
from areal_hpc.train.attention import packed_seq_params


@dataclass
class MicroBatch:
    """One packed row. S = total tokens of its sequences, N = their output tokens.

    A micro-batch with no sequences (a rank with less data than the agreed micro-batch count)
    is one padding token with N = 0: it runs through the schedule and contributes nothing.
    """

    seq_ids: list[int]  # indices into the step's `seqs`
    out_lens: list[int]  # output tokens per sequence
    tokens: torch.Tensor  # [1, S] int64
    position_ids: torch.Tensor  # [1, S] int64, restarting per sequence
    attention_mask: torch.Tensor | None  # mask attention: [1, 1, S, S] bool, True = masked
    packed_seq_params: object | None  # varlen attention: Megatron PackedSeqParams (THD)
    out_pos: torch.Tensor  # [N] positions whose logits predict the output tokens
    targets: torch.Tensor  # [1, N] int64, the output tokens
    # training only, [N]
    behav_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    versions: torch.Tensor | None = None  # int64, loglinear π_prox only
    prox_logprobs: torch.Tensor | None = None  # last stage, minibatches 2..k (recompute) or π_behav
    # bool: True for a sampled token, False for an environment's observation token of a
    # multi-turn episode (trained on nothing: the loss, its token counts and diagnostics skip it)
    loss_mask: torch.Tensor | None = None
    mask_count: int | None = None       # the mask's 1s, counted on the host when packed

    @property
    def n_tokens(self) -> int:
        return int(self.out_pos.numel())

    @property
    def n_trained(self) -> int:
        """Output tokens the loss trains on (mask 1): every one without a loss mask. Counted
        when packed, so that reading it never waits on the device."""
        if self.loss_mask is None:
            return self.n_tokens
        if self.mask_count is None:
            self.mask_count = int(self.loss_mask.sum())
        return self.mask_count


def plan_micro_batches(lengths: list[int], budget: int, pp: int,
                       busiest: Callable[[int], int] | None = None) -> list[list[int]]:
    """Micro-batches (index lists into `lengths`): at most `budget` tokens each (a longer
    sequence is a ValueError), balanced, a multiple of `pp`; empty ones (fillers) when there
    are fewer sequences than micro-batches. `busiest(n)`: the largest count over the
    data-parallel ranks given this rank's n; this rank then cuts as many."""
    groups = balanced_allocate(lengths, budget, divisor=pp)
    if busiest is not None:
        k = busiest(len(groups))
        if k > len(groups):
            groups = balanced_allocate(lengths, budget, min_groups=k, divisor=pp)
    return groups


def pack(seqs: list[dict], mb_ids: list[int], per_token: dict | None = None, *,
         attention: str, row_multiple: int, device: torch.device | str) -> MicroBatch:
    """Concatenate `seqs[mb_ids]` into one row; `per_token` adds `[N]` training inputs
    (name -> one array per sequence of the step, each `[len(output_tokens)]`)."""
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
    if not mb_ids:  # a filler: one token, nothing to predict
        one = np.zeros(1, np.int64)
        tokens, positions, segments, out_pos = [one], [one], [one], [np.zeros(0, np.int64)]
    seq_lens = [len(x) for x in positions]
    pad = -sum(seq_lens) % row_multiple
    if pad:  # its own dummy sequence: nothing attends to it, it predicts nothing
        tokens.append(np.zeros(pad, np.int64))
        positions.append(np.arange(pad))
        segments.append(np.full(pad, len(seq_lens)))
        seq_lens.append(pad)
    dev = device
    mask = params = None
    if attention == "mask":
        seg = torch.from_numpy(np.concatenate(segments)).to(dev)
        s = seg.numel()
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1)
        mask = (causal | (seg[:, None] != seg[None, :]))[None, None]
    else:
        params = packed_seq_params(seq_lens, dev)
    out_pos_t = torch.from_numpy(np.concatenate(out_pos)).to(dev)
    tokens_t = torch.from_numpy(np.concatenate(tokens)).to(dev)[None]
    mb = MicroBatch(
        seq_ids=list(mb_ids),
        out_lens=out_lens,
        tokens=tokens_t,
        position_ids=torch.from_numpy(np.concatenate(positions)).to(dev)[None],
        attention_mask=mask,
        packed_seq_params=params,
        out_pos=out_pos_t,
        targets=tokens_t[:, out_pos_t + 1],
    )
    for name, per_seq in (per_token or {}).items():
        dtype = {"versions": np.int64, "loss_mask": np.bool_}.get(name, np.float32)
        parts = [np.asarray(per_seq[i], dtype=dtype) for i in mb_ids] or [np.zeros(0, dtype)]
        values = np.concatenate(parts)
        setattr(mb, name, torch.from_numpy(values).to(dev))
        if name == "loss_mask":
            mb.mask_count = int(np.count_nonzero(values))
    return mb
