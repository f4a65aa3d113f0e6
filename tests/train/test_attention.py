"""Packed (varlen) core attention and chunked log-probs against their dense references (CPU, fp32).

- `PackedAttention` vs Megatron's `DotProductAttention` with the block-diagonal mask: outputs and
  gradients for a pack of one sequence, of many, and with length-1 sequences, GQA.
- `chunked_token_logprobs` vs `log_softmax` of the full logits: values and gradients for chunk
  sizes from 1 to more than the tokens, with a temperature; the empty case.
"""
import pytest
import torch

from areal_hpc.train.attention import PackedAttention, packed_seq_params, varlen_kernel
from areal_hpc.train.logprobs import chunked_token_logprobs

HEADS, GROUPS, DIM = 4, 2, 8


@pytest.fixture(scope="module")
def cores(megatron_ws1):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0,
                            use_cpu_initialization=True)
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), PackedAttention(**kw)


def _block_mask(lens):
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    s = seg.numel()
    return (torch.ones(s, s, dtype=torch.bool).triu(1) | (seg[:, None] != seg[None, :]))[None, None]


@pytest.mark.parametrize("lens", [[13], [5, 1, 9, 1, 1, 7], [1], [1, 1, 1]], ids=["one", "many", "len1", "all_len1"])
def test_packed_attention_equals_mask(cores, lens):
    dense, packed = cores
    assert varlen_kernel(torch.device("cpu"), torch.float32) == "sdpa_per_sequence"
    torch.manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, 1, HEADS, DIM, requires_grad=True)
    k = torch.randn(t, 1, GROUPS, DIM, requires_grad=True)
    v = torch.randn(t, 1, GROUPS, DIM, requires_grad=True)
    ref = dense(q, k, v, _block_mask(lens))  # [t, 1, h*d]
    params = packed_seq_params(lens, "cpu")
    out = packed(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    got = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_attention_needs_thd(cores):
    with pytest.raises(ValueError, match="PackedSeqParams"):
        cores[1](torch.zeros(2, HEADS, DIM), torch.zeros(2, GROUPS, DIM), torch.zeros(2, GROUPS, DIM), None)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_logprobs_equal_log_softmax(chunk):
    torch.manual_seed(0)
    n, h, vocab, temp = 11, 16, 50, 0.7
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    ref = torch.log_softmax(hidden @ weight.t() / temp, -1).gather(1, targets[:, None])[:, 0]
    got = chunked_token_logprobs(hidden, weight, targets, temp, chunk)
    assert got.dtype == torch.float32 and got.shape == (n,)
    torch.testing.assert_close(got, ref.float(), rtol=0, atol=1e-5)  # |log p| ~ 20: fp32 ulp 2e-6
    g = torch.randn(n, dtype=torch.float64)
    want = torch.autograd.grad(ref, (hidden, weight), g)
    have = torch.autograd.grad(got, (hidden, weight), g.float())
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_chunked_logprobs_vocab_slice_and_empty():
    """A vocabulary slice (as on a TP rank) without a group: targets outside it count 0 logit;
    no tokens gives an empty result that still backpropagates."""
    torch.manual_seed(1)
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8)
    targets = torch.tensor([20, 21, 29, 5])
    got = chunked_token_logprobs(hidden, weight, targets, 1.0, 2, vocab_start=20)
    logits = hidden @ weight.t()
    lse = torch.logsumexp(logits, -1)
    want = torch.stack([logits[0, 0], logits[1, 1], logits[2, 9], torch.tensor(0.0)]) - lse
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    empty = chunked_token_logprobs(hidden[:0], weight, targets[:0])
    assert empty.shape == (0,)
    empty.sum().backward()
