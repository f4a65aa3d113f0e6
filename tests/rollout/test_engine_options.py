"""rollout.max_num_seqs / max_num_batched_tokens reach vLLM's EngineArgs (no engine started)."""
from pathlib import Path

import pytest

from areal_hpc.config import load
from areal_hpc.rollout import vllm_engine

ROOT = Path(__file__).resolve().parents[2]


class _Captured(Exception):
    pass


def _engine_args(monkeypatch, **kwargs):
    """The EngineArgs VLLMEngine builds, caught where LLMEngine would start."""
    from vllm.v1.engine.llm_engine import LLMEngine

    def capture(args, **_):
        raise _Captured(args)

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(capture))
    with pytest.raises(_Captured) as got:
        vllm_engine.VLLMEngine("models/none", dtype="float32", **kwargs)
    return got.value.args[0]


def test_recipe_limits_reach_the_engine_args(monkeypatch):
    r = load(ROOT / "configs/qwen2_5_32b_math.yaml").rollout
    opts = vllm_engine.engine_options(r)
    assert (opts["max_num_seqs"], opts["max_num_batched_tokens"]) == (r.max_num_seqs, r.max_num_batched_tokens)
    assert r.max_num_seqs >= 256 and r.max_num_batched_tokens >= 8192
    args = _engine_args(monkeypatch, **opts)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (r.max_num_seqs, r.max_num_batched_tokens)
    assert (args.max_model_len, args.gpu_memory_utilization, args.enforce_eager) == \
        (r.max_model_len, r.gpu_memory_utilization, r.enforce_eager)


def test_cpu_recipe_keeps_vllms_defaults(monkeypatch):
    r = load(ROOT / "configs/tiny_cpu.yaml").rollout
    opts = vllm_engine.engine_options(r)
    assert opts["max_num_seqs"] is None and opts["max_num_batched_tokens"] is None
    assert opts["kv_cache_gib"] == 1
    args = _engine_args(monkeypatch, **opts)
    assert args.max_num_seqs is None and args.max_num_batched_tokens is None   # vLLM fills them in
    assert args.kv_cache_memory_bytes == 2**30
    # an override on the command line reaches it too
    r = load(ROOT / "configs/tiny_cpu.yaml", ["rollout.max_num_seqs=64",
                                                "rollout.max_num_batched_tokens=4096"]).rollout
    args = _engine_args(monkeypatch, **vllm_engine.engine_options(r))
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (64, 4096)
