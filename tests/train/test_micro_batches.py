"""Micro-batch planning and packing (train/micro_batches.py), without Megatron: hand-checked rows."""
import numpy as np
import pytest

from areal_hpc.train.micro_batches import pack, plan_micro_batches


def _seq(prompt, output):
    return {"prompt_tokens": np.asarray(prompt), "output_tokens": np.asarray(output)}


SEQS = [_seq([1, 2, 3], [4, 5]), _seq([6], [7, 8, 9]), _seq([10, 11], [])]


def test_a_row_is_its_sequences_with_positions_restarting_and_outputs_predicted():
    mb = pack(SEQS, [0, 1, 2], {"advantages": [[0.5, 0.5], [1.0, 1.0, 1.0], []]},
              attention="varlen", row_multiple=1, device="cpu")
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    # the logits at position p predict token p + 1: outputs of seq 0 from positions 2, 3, of
    # seq 1 from 5, 6, 7; the empty output predicts nothing
    assert mb.out_pos.tolist() == [2, 3, 5, 6, 7] and mb.targets.tolist() == [[4, 5, 7, 8, 9]]
    assert mb.out_lens == [2, 3, 0] and mb.n_tokens == 5 and mb.seq_ids == [0, 1, 2]
    assert mb.advantages.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0] and mb.attention_mask is None
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 9, 11]


def test_mask_attention_is_block_diagonal_causal_and_padding_is_its_own_sequence():
    mb = pack(SEQS, [1, 0], attention="mask", row_multiple=4, device="cpu")
    assert mb.tokens.tolist() == [[6, 7, 8, 9, 1, 2, 3, 4, 5, 0, 0, 0]]      # 9 tokens + 3 pad
    mask = mb.attention_mask[0, 0]                     # True = masked
    allowed = (~mask).nonzero().tolist()
    assert all(j <= i for i, j in allowed)             # causal
    assert not any(i >= 4 > j or j >= 4 > i for i, j in allowed if i < 9 and j < 9)  # per sequence
    assert not any((i < 9) != (j < 9) for i, j in allowed)        # the padding attends alone
    assert mb.targets.tolist() == [[7, 8, 9, 4, 5]]


def test_an_empty_micro_batch_is_one_filler_token_that_predicts_nothing():
    mb = pack(SEQS, [], {"advantages": [[0.5, 0.5], [1.0] * 3, []]}, attention="varlen",
              row_multiple=1, device="cpu")
    assert mb.tokens.tolist() == [[0]] and mb.n_tokens == 0 and mb.advantages.numel() == 0


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="sequence 0 has an empty prompt"):
        pack([_seq([], [1])], [0], attention="varlen", row_multiple=1, device="cpu")


def test_plan_respects_the_budget_a_multiple_of_pp_and_the_busiest_rank():
    lengths = [50, 40, 30, 20, 10, 10]
    groups = plan_micro_batches(lengths, 60, pp=1)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 60 for g in groups) and len(groups) == 3
    assert len(plan_micro_batches(lengths, 60, pp=2)) == 4
    seen = []
    more = plan_micro_batches(lengths, 60, pp=1, busiest=lambda n: seen.append(n) or 5)
    assert seen == [3] and len(more) == 5
    assert len(plan_micro_batches(lengths, 60, pp=1, busiest=lambda n: n)) == 3
    with pytest.raises(ValueError):
        plan_micro_batches([70], 60, pp=1)
