"""Actor on a tiny random Qwen2, world size 1 (gloo): logprobs, PPO step, weight export."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_hpc.algo.ppo import decoupled_ppo_loss, grpo_advantages
from areal_hpc.topology import free_port

TEMPERATURE = 0.7
GROUP_SIZE = 4


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return str(path)


def make_actor(model_dir, **kw):
    from areal_hpc.train.actor import Actor

    args = dict(lr=1e-3, temperature=TEMPERATURE, max_tokens_per_mb=40, group_size=GROUP_SIZE)
    return Actor(model_dir, **{**args, **kw})


def make_seqs(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [
        dict(
            prompt_tokens=rng.integers(0, 128, rng.integers(1, 10)).astype(np.int32),
            output_tokens=rng.integers(0, 128, rng.integers(1, 15)).astype(np.int32),
        )
        for _ in range(n)
    ]


def hf_logprobs(model, seq, temperature=TEMPERATURE):
    """Reference: one unpacked sequence through transformers, log_softmax(logits / T)."""
    p = len(seq["prompt_tokens"])
    ids = torch.tensor(np.concatenate([seq["prompt_tokens"], seq["output_tokens"]]), dtype=torch.long)
    logits = model(ids[None]).logits[0].float() / temperature
    return torch.log_softmax(logits[p - 1 : -1], dim=-1).gather(-1, ids[p:, None])[:, 0]


def test_compute_logprobs_matches_hf(megatron_ws1, model_dir):
    actor = make_actor(model_dir)
    seqs = make_seqs()
    got = actor.compute_logprobs(seqs)
    hf = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for seq, lp in zip(seqs, got):
            assert lp.dtype == np.float32 and lp.shape == (len(seq["output_tokens"]),)
            ref = hf_logprobs(hf, seq).numpy()
            np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-4)


def test_packed_equals_unpacked(megatron_ws1, model_dir):
    actor = make_actor(model_dir, max_tokens_per_mb=10_000)
    seqs = make_seqs(seed=1)
    packed = actor.compute_logprobs(seqs)  # one row for all sequences
    actor.max_tokens_per_mb = 1  # every sequence alone
    alone = actor.compute_logprobs(seqs)
    for a, b in zip(packed, alone):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _batch(actor, seed, rewards, behav_shift=None):
    seqs = make_seqs(seed=seed)
    prox = actor.compute_logprobs(seqs)
    for i, seq in enumerate(seqs):
        seq["reward"] = rewards[i]
        seq["behav_logprobs"] = prox[i] if behav_shift is None else prox[i] + behav_shift[i]
    return seqs


def test_first_step_ratio_one_and_token_mean_gradient(megatron_ws1, model_dir):
    """First step: π_θ == π_prox exactly; loss and grad norm equal a whole-batch HF reference."""
    actor = make_actor(model_dir)
    rng = np.random.default_rng(2)
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # the second group carries no signal
    seqs = make_seqs(seed=3)
    shifts = [rng.normal(0, 0.3, len(s["output_tokens"])).astype(np.float32) for s in seqs]
    shifts[0][0] = -3.0  # w = e^3 > 5: this token is dropped (but counted)
    seqs = _batch(actor, 3, rewards, shifts)

    stats = actor.train_step(seqs)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    assert stats["n_micro_batches"] > 1
    assert stats["n_tokens"] == sum(len(s["output_tokens"]) for s in seqs)
    assert stats["dropped_frac"] == pytest.approx(1 / stats["n_tokens"])

    hf = Qwen2ForCausalLM.from_pretrained(model_dir)
    logp = torch.cat([hf_logprobs(hf, s) for s in seqs])
    adv = grpo_advantages(torch.tensor(rewards), GROUP_SIZE)
    token_adv = torch.cat([adv[i].expand(len(s["output_tokens"])) for i, s in enumerate(seqs)])
    behav = torch.from_numpy(np.concatenate([s["behav_logprobs"] for s in seqs]))
    loss, _ = decoupled_ppo_loss(logp, logp.detach(), behav, token_adv, torch.ones_like(logp, dtype=torch.bool))
    loss.backward()
    ref_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(ref_norm.item(), rel=1e-4)


def test_training_raises_logprob_of_rewarded_sequences(megatron_ws1, model_dir):
    actor = make_actor(model_dir)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    seqs = _batch(actor, 4, rewards)
    before = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    for _ in range(4):
        stats = actor.train_step(seqs)
        assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    after = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    delta = np.array(after) - np.array(before)
    good = np.array(rewards) > 0
    assert (delta[good] > 0).all(), delta
    assert (delta[~good] < 0).all(), delta


def test_trained_weights_load_into_transformers(megatron_ws1, model_dir, tmp_path):
    actor = make_actor(model_dir)
    seqs = _batch(actor, 5, [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0])
    actor.train_step(seqs)

    hf = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    hf.load_state_dict(actor.hf_state_dict(), strict=True)
    got = actor.compute_logprobs(seqs)
    with torch.no_grad():
        for seq, lp in zip(seqs, got):
            np.testing.assert_allclose(lp, hf_logprobs(hf, seq).numpy(), rtol=0, atol=1e-4)

    out = tmp_path / "policy"
    actor.save_hf(str(out))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]
    reloaded = Qwen2ForCausalLM.from_pretrained(out).eval()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, hf.state_dict()[name]), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are no-ops with a GPU")
def test_cpu_compat_mode_redirects_cuda():
    from areal_hpc.train import cpu_compat

    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    with cpu_compat.CudaToCpuMode():
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.type(torch.float64).dtype == torch.float64
    assert torch.zeros(1).type() == "torch.FloatTensor"


_TP2_WORKER = r"""
import pickle, sys
import numpy as np, torch, torch.distributed as dist
torch.set_num_threads(1)
from areal_hpc.train.megatron_model import init_megatron_parallel
from areal_hpc.train.actor import Actor
rank, port, model_dir, work = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
init_megatron_parallel(tp=2, pp=1, seed=0, backend="gloo")
with open(f"{work}/in.pkl", "rb") as f:
    seqs, kw = pickle.load(f)
actor = Actor(model_dir, tp=2, **kw)
out = {"initial": {k: v.clone() for k, v in actor.hf_state_dict().items()}}
out["logprobs"] = actor.compute_logprobs(seqs)
out["stats"] = actor.train_step(seqs)
out["trained"] = actor.hf_state_dict()
with open(f"{work}/out{rank}.pkl", "wb") as f:
    pickle.dump(out, f)
"""


def test_tensor_parallel_2_matches_tp1(megatron_ws1, model_dir, tmp_path):
    """TP=2 in two gloo processes: same logprobs, loss, grad norm and gathered weights as TP=1."""
    import pickle
    import subprocess
    import sys

    kw = dict(lr=1e-3, temperature=TEMPERATURE, max_tokens_per_mb=40, group_size=GROUP_SIZE)
    actor = make_actor(model_dir, **kw)
    seqs = _batch(actor, 6, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    with open(tmp_path / "in.pkl", "wb") as f:
        pickle.dump((seqs, kw), f)
    port = str(free_port())
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _TP2_WORKER, str(r), port, model_dir, str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    for p in procs:
        log = p.communicate(timeout=240)[0].decode()
        assert p.returncode == 0, log[-3000:]
    outs = [pickle.loads((tmp_path / f"out{r}.pkl").read_bytes()) for r in range(2)]

    ref_initial = Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()
    ref_logprobs = actor.compute_logprobs(seqs)
    ref_stats = actor.train_step(seqs)
    ref_trained = actor.hf_state_dict()
    for out in outs:  # both TP ranks hold the full gathered weights
        for name, tensor in out["initial"].items():
            assert torch.equal(tensor, ref_initial[name]), name
        for a, b in zip(out["logprobs"], ref_logprobs):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert out["stats"]["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-6)
        assert out["stats"]["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-4)
        assert set(out["trained"]) == set(ref_trained)
        for name, tensor in out["trained"].items():
            torch.testing.assert_close(tensor, ref_trained[name], rtol=0, atol=1e-4)
