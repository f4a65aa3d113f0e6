"""How `PackedAttention` calls `torch.nn.attention.varlen.varlen_attn` across torch releases (CPU).

The real `varlen_attn` runs on CUDA only (`aten::_flash_attention_forward` has no CPU kernel), so
these tests put fakes with each release's signature in its place: torch 2.12+ (`scale`,
`window_size`, `enable_gqa`), 2.11 (`scale`, `window_size`, no `enable_gqa`), 2.10 (`is_causal`,
no `scale`), and one taking neither causal keyword. Each fake computes causal attention per
sequence with plain tensor ops and refuses what the real function refuses (unequal heads without
`enable_gqa`). Outputs and gradients are compared with `_sdpa_per_sequence` (SDPA's own GQA), in
fp32 and bf16. What they cannot cover: the FlashAttention kernel itself (tools/gpu_check.py's
check 2 compares it with the mask path on a GPU).
"""
import inspect
import math

import pytest
import torch

from areal_hpc.train import attention
from areal_hpc.train.attention import (
    PackedAttention,
    _flash_varlen,
    _sdpa_per_sequence,
    packed_seq_params,
    varlen_call_plan,
    varlen_kernel,
    varlen_keywords,
)

HEADS, GROUPS, DIM = 4, 2, 8
LENS = [5, 1, 9, 3]


def _causal_pack(q, k, v, cu, scale):
    """Causal attention per sequence, heads equal, by explicit softmax (the fakes' kernel)."""
    assert q.shape[1] == k.shape[1] == v.shape[1], "the fake kernel needs equal heads"
    out = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[s:e].transpose(0, 1).float() for x in (q, k, v))  # [h, L, d]
        scores = qi @ ki.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(out)


def _check_heads(query, key, enable_gqa=False):
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError("Expect query and key/value to have the same number of heads")


class Calls:
    """The keyword arguments each fake received, and its query tensor."""

    def __init__(self):
        self.kwargs, self.query = [], []


def fake_v212(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.kwargs.append(dict(scale=scale, window_size=window_size, enable_gqa=enable_gqa))
        calls.query.append(query)
        _check_heads(query, key, enable_gqa)
        assert window_size == (-1, 0)
        if enable_gqa:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        return _causal_pack(query, key, value, cu_seq_q, scale if scale is not None else query.shape[-1] ** -0.5)
    return varlen_attn


def fake_v211(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
                    page_table=None, seqused_k=None):
        calls.kwargs.append(dict(scale=scale, window_size=window_size))
        calls.query.append(query)
        _check_heads(query, key)
        assert window_size == (-1, 0)
        return _causal_pack(query, key, value, cu_seq_q, scale if scale is not None else query.shape[-1] ** -0.5)
    return varlen_attn


def fake_v210(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.kwargs.append(dict(is_causal=is_causal))
        calls.query.append(query)
        _check_heads(query, key)
        assert is_causal
        return _causal_pack(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)
    return varlen_attn


def fake_no_causal(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError("must not be called")
    return varlen_attn


FAKES = {"2.12+": fake_v212, "2.11": fake_v211, "2.10": fake_v210}


def _inputs(dtype, groups=GROUPS, seed=0):
    torch.manual_seed(seed)
    t = sum(LENS)
    q = torch.randn(t, HEADS, DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(t, groups, DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(t, groups, DIM, dtype=dtype, requires_grad=True)
    return q, k, v, packed_seq_params(LENS, "cpu").cu_seqlens_q


@pytest.mark.parametrize("release", list(FAKES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [GROUPS, HEADS, 1], ids=["gqa", "mha", "mqa"])
def test_flash_varlen_matches_sdpa(release, dtype, groups):
    calls = Calls()
    fn = FAKES[release](calls)
    q, k, v, cu = _inputs(dtype, groups)
    scale = DIM ** -0.5
    out = _flash_varlen(q, k, v, cu, max(LENS), scale, fn=fn)
    ref = _sdpa_per_sequence(q, k, v, cu, scale, 0.0)
    assert out.shape == ref.shape == q.shape and out.dtype == dtype
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **(tol if dtype == torch.float32 else dict(rtol=0, atol=5e-2)))
    (kw,) = calls.kwargs
    gqa = groups != HEADS
    if release == "2.12+":
        assert kw == dict(scale=scale, window_size=(-1, 0), enable_gqa=gqa)
    elif release == "2.11":
        assert kw == dict(scale=scale, window_size=(-1, 0))
    else:
        assert kw == dict(is_causal=True)
        assert calls.query[0] is q  # the default scale is the kernel's own: q is passed unchanged


def test_repeat_interleave_is_sdpa_grouping():
    """The 2.11 branch (k/v repeated) gives what the 2.12 branch (enable_gqa) gives, bit for bit
    in fp32, with distinct kv heads (a wrong grouping would mix them)."""
    q, k, v, cu = _inputs(torch.float32)
    a = _flash_varlen(q, k, v, cu, max(LENS), 0.3, fn=fake_v211(Calls()))
    b = _flash_varlen(q, k, v, cu, max(LENS), 0.3, fn=fake_v212(Calls()))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and query head i reads kv head i // (HEADS // GROUPS): heads 0, 1 see kv head 0 only
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, 1] += 1.0
    v2[:, 1] += 1.0
    c = _flash_varlen(q, k2, v2, cu, max(LENS), 0.3, fn=fake_v211(Calls()))
    torch.testing.assert_close(c[:, :2], a[:, :2], rtol=0, atol=0)
    assert not torch.allclose(c[:, 2:], a[:, 2:])


def test_scale_folded_into_query_without_scale_keyword():
    calls = Calls()
    q, k, v, cu = _inputs(torch.float32, HEADS)
    out = _flash_varlen(q, k, v, cu, max(LENS), 0.2, fn=fake_v210(calls))
    torch.testing.assert_close(out, _sdpa_per_sequence(q, k, v, cu, 0.2, 0.0), rtol=0, atol=1e-5)
    torch.testing.assert_close(calls.query[0], q * (0.2 * math.sqrt(DIM)))


def test_kernel_choice_follows_signature(monkeypatch):
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    for name, make in FAKES.items():
        monkeypatch.setattr(attention, "_varlen_attn", make(Calls()))
        assert varlen_kernel(cuda, torch.bfloat16) == "flash_varlen", name
        assert varlen_kernel(cuda, torch.float32) == "sdpa_per_sequence", name
        assert varlen_kernel(torch.device("cpu"), torch.bfloat16) == "sdpa_per_sequence", name
    assert "enable_gqa=True" in varlen_call_plan(fake_v212(Calls()))
    assert "repeat_interleave" in varlen_call_plan(fake_v211(Calls()))
    assert "is_causal=True" in varlen_call_plan(fake_v210(Calls()))
    bad = fake_no_causal(Calls())
    monkeypatch.setattr(attention, "_varlen_attn", bad)
    assert varlen_kernel(cuda, torch.bfloat16) == "sdpa_per_sequence"
    assert "not used" in varlen_call_plan(bad)
    with pytest.raises(TypeError, match="neither window_size nor is_causal"):
        _flash_varlen(*_inputs(torch.float32)[:3], torch.tensor([0, 18], dtype=torch.int32), 18, 0.1, fn=bad)
    monkeypatch.setattr(attention, "_varlen_attn", None)
    assert varlen_kernel(cuda, torch.bfloat16) == "sdpa_per_sequence"


def test_signature_read_once():
    varlen_keywords.cache_clear()
    fn = fake_v211(Calls())
    seen = []
    real = inspect.signature

    def counting(f, *a, **kw):
        seen.append(f)
        return real(f, *a, **kw)

    inspect.signature = counting
    try:
        q, k, v, cu = _inputs(torch.float32)
        for _ in range(3):
            _flash_varlen(q, k, v, cu, max(LENS), 0.3, fn=fn)
    finally:
        inspect.signature = real
    assert seen == [fn]


def test_installed_torch_signature():
    """The torch in this environment: what the GPU path would pass it."""
    if attention._varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    kw = varlen_keywords(attention._varlen_attn)
    assert {"window_size", "scale"} <= kw or "is_causal" in kw
    plan = varlen_call_plan()
    assert ("enable_gqa=True" in plan) == ("enable_gqa" in kw)


@pytest.mark.parametrize("release", list(FAKES))
def test_packed_attention_uses_varlen_path(megatron_ws1, monkeypatch, release):
    """`PackedAttention.forward` through the varlen branch (kernel choice forced on CPU, bf16)
    equals its SDPA branch."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0,
                            use_cpu_initialization=True)
    core = PackedAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                           attention_type="self")
    q, k, v, _ = _inputs(torch.bfloat16)
    params = packed_seq_params(LENS, "cpu")
    ref = core(q, k, v, None, packed_seq_params=params)
    calls = Calls()
    monkeypatch.setattr(attention, "_varlen_attn", FAKES[release](calls))
    monkeypatch.setattr(attention, "varlen_kernel", lambda device, dtype: "flash_varlen")
    out = core(q, k, v, None, packed_seq_params=params)
    assert len(calls.kwargs) == 1
    assert out.shape == ref.shape == (sum(LENS), 1, HEADS * DIM)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-2)
