"""The memory model's terms that matter at 32B: the step's packed batch, NCCL/NVLS buffers, the
TP peers of the weight gather (areal_hpc.plan.memory): exact numbers by hand."""
import json
from pathlib import Path

import pytest

from areal_hpc import plan
from areal_hpc.config import load
from areal_hpc.plan import memory

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
LAYER_MM = 128 * 64 + 128 + 64 * 64 + 3 * 128 * 64       # qkv + bias, o, fc1, fc2: 36992


def small_config(tmp_path, *extra):
    """A config of SMALL: B 8 x n 4 sequences of 256 tokens, 128 of them output."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMALL))
    return load(None, [f"model.path={d}", "data.train_path=x.jsonl", "train.max_tokens_per_mb=512",
                       "rollout.max_model_len=256", "rollout.max_new_tokens=128", "train.batch_prompts=8",
                       "rollout.group_size=4", *extra])


def test_step_batch_is_the_ranks_share_of_the_packed_step(tmp_path):
    # 32 sequences of 256 tokens (128 output): ids + positions 16 B a token; out positions,
    # targets, behaviour log-probs, advantages 24 B an output token, + π_prox 4 B on the last stage
    # for 3 of 4 minibatches (the first one's come from its training forward,
    # TrainConfig.prox_pass_share); with one minibatch, none
    mb4 = "train.ppo_minibatches=4"
    st = plan.estimate(small_config(tmp_path, mb4)).trainer[0]
    assert st.term("step batch (packed)").bytes == 32 * (16 * 256 + 27 * 128) == 241_664
    one = plan.estimate(small_config(tmp_path)).trainer[0]
    assert one.term("step batch (packed)").bytes == 32 * (16 * 256 + 24 * 128)
    two = plan.estimate(small_config(tmp_path, mb4, "topology.pp=2", "topology.n_trainers=4")).trainer  # dp 2
    assert [s.term("step batch (packed)").bytes for s in two] == [16 * (16 * 256 + 24 * 128),
                                                                  16 * (16 * 256 + 27 * 128)]
    ll = plan.estimate(small_config(tmp_path, "train.prox=loglinear")).trainer[0]           # + versions
    assert ll.term("step batch (packed)").bytes == 32 * (16 * 256 + 32 * 128)


def test_nccl_communicators_and_their_allowance():
    r32 = load(ROOT / "configs/qwen2_5_32b_math.yaml")
    assert memory.nccl_communicators(r32, "trainer") == [
        ("trainer world", 32), ("TP", 2), ("PP", 8), ("DP", 2), ("TP x PP", 16), ("weight group", 8 + 12 * 8)]
    # 0.6 GiB each, + 0.25 GiB of NVLS for those of more than 2 ranks (4 of 6)
    assert memory.nccl_bytes(r32, "trainer") == pytest.approx((6 * 0.6 + 4 * 0.25) * GiB)
    st = plan.estimate(r32).trainer[0]
    assert st.term("NCCL + NVLS buffers").bytes == pytest.approx(4.6 * GiB)
    assert st.term("CUDA context").bytes == 0.75 * GiB
    # A100: no NVLS; a generator: vLLM's TP group (torch and PyNccl) and the weight group
    a100 = load(ROOT / "configs/qwen2_5_32b_math.yaml", ["topology.gpu=a100"])
    assert memory.nccl_bytes(a100, "trainer") == pytest.approx(3.6 * GiB)
    assert memory.nccl_communicators(r32, "generator") == [
        ("vLLM TP (torch)", 8), ("vLLM TP (PyNccl)", 8), ("weight group", 104)]
    assert plan.estimate(r32).generator.term("NCCL + NVLS buffers").bytes == pytest.approx(3 * 0.85 * GiB)
    # gloo (CPU): no NCCL at all
    assert memory.nccl_bytes(load(ROOT / "configs/tiny_cpu.yaml"), "trainer") == 0.0


def test_tp_peers_run_ahead_by_at_most_a_bucket_and_a_tensor(tmp_path):
    # tp 2: weight_publisher.join_gather waits for the device every weights.bucket_mb, so a peer
    # holds at most a bucket plus the largest gathered tensor (fc1: 2 x 128 x 64, full size, bf16)
    cfg = small_config(tmp_path, "topology.tp=2", "topology.n_trainers=2", "model.dtype=bfloat16")
    st = plan.estimate(cfg).trainer[0]
    term = st.term("weight gather, TP peers")
    assert term.bytes == cfg.weights.bucket_mb * 2**20 + (2 * 128 * 64) * 2 and not term.concurrent
    assert plan.estimate(small_config(tmp_path)).trainer[0].term("weight gather, TP peers").bytes == 0.0
    no_sync = plan.trainer_estimates(cfg, plan.read_arch(cfg), weight_sync=False)[0]
    assert no_sync.term("weight gather, TP peers").bytes == 0.0
