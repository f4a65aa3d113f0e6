"""Actor on a tiny random Qwen2, world size 1 (gloo): log-probs, PPO steps, packing, weights."""

import os

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from areal_hpc.algo.packing import balanced_allocate
from areal_hpc.algo.ppo import decoupled_ppo_loss, grpo_advantages
from areal_hpc.config import TrainConfig

TEMPERATURE = 0.7
GROUP_SIZE = 4
# Adam's first steps move each weight by about lr (1e-3) however small its gradient, so fp32
# rounding differences in near-zero gradients reach ~1e-5 in the weights: a tenth of a step.
WEIGHT_ATOL = 1e-4


def make_actor(model_dir, **cfg):
    """An Actor training decoupled PPO unless `off_policy` says otherwise: the hand-made
    references below are decoupled PPO's (the default, trust_region, adds a clip that these
    batches' shifted π_behav would trigger)."""
    from areal_hpc.train.actor import Actor

    return Actor(TrainConfig(**{"lr": 1e-3, "max_tokens_per_mb": 40, "off_policy": "decoupled",
                                **cfg}), model_dir,
                 group_size=GROUP_SIZE, temperature=TEMPERATURE)


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


def batch(actor, seed, rewards, behav_shift=None, version=0):
    """Sequences whose behaviour log-probs are the actor's current ones (+ `behav_shift`)."""
    seqs = make_seqs(seed=seed)
    current = actor.compute_logprobs(seqs)
    for i, seq in enumerate(seqs):
        seq["reward"] = rewards[i]
        seq["behav_logprobs"] = current[i] if behav_shift is None else current[i] + behav_shift[i]
        seq["versions"] = np.full(len(seq["output_tokens"]), version, dtype=np.int32)
    return seqs


def max_weight_diff(a, b):
    return max((a.hf_state_dict()[k] - v).abs().max().item() for k, v in b.hf_state_dict().items())


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
    """One packed row vs every sequence alone (plus an empty filler micro-batch): same
    log-probs, loss, grad norm and, after two steps, weights."""
    packed = make_actor(model_dir, max_tokens_per_mb=10_000)
    alone = make_actor(model_dir, max_tokens_per_mb=10_000)
    alone._plan = lambda lengths, equalise_dp: [[i] for i in range(len(lengths))] + [[]]
    seqs = batch(packed, 1, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    for a, b in zip(packed.compute_logprobs(seqs), alone.compute_logprobs(seqs)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for _ in range(2):
        sp, sa = packed.train_step(seqs), alone.train_step(seqs)
        assert (sp["n_micro_batches"], sa["n_micro_batches"]) == (1, 9)
        assert sp["loss"] == pytest.approx(sa["loss"], rel=1e-5, abs=1e-6)
        assert sp["grad_norm"] == pytest.approx(sa["grad_norm"], rel=1e-5)
    assert max_weight_diff(packed, alone) < WEIGHT_ATOL


def test_first_step_ratio_one_and_token_mean_gradient(megatron_ws1, model_dir):
    """First step: π_θ == π_prox exactly; loss and grad norm equal a whole-batch HF reference."""
    actor = make_actor(model_dir)
    rng = np.random.default_rng(2)
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # the second group carries no signal
    seqs = make_seqs(seed=3)
    shifts = [rng.normal(0, 0.3, len(s["output_tokens"])).astype(np.float32) for s in seqs]
    shifts[0][0] = -3.0  # w = e^3 > 5: this token is dropped (but counted)
    seqs = batch(actor, 3, rewards, shifts)

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
    loss, _ = decoupled_ppo_loss(logp, logp.detach(), behav, token_adv, torch.ones_like(logp, dtype=torch.bool),
                                 behav_imp_weight_cap=TrainConfig().behav_imp_weight_cap)   # the actor's
    loss.backward()
    ref_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(ref_norm.item(), rel=1e-4)


def test_prox_modes_agree_while_behaviour_is_current(megatron_ws1, model_dir):
    """π_behav = the current policy: recompute, loglinear and behaviour give the same first step.
    On the second step (tokens one version old) loglinear still has α = 0 and equals naive PPO,
    while recompute now uses the updated weights as π_prox."""
    actors = {p: make_actor(model_dir, prox=p) for p in ("recompute", "loglinear", "behaviour")}
    seqs = batch(actors["recompute"], 7, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    first = {p: a.train_step(seqs, version=0) for p, a in actors.items()}
    # one minibatch: recompute needs no pass of its own (test_first_minibatch_needs_no_prox_pass)
    assert first["recompute"]["prox_seconds"] < 1e-3 and first["loglinear"]["prox_seconds"] < 1e-3
    for p in ("loglinear", "behaviour"):
        assert first[p]["loss"] == first["recompute"]["loss"]
        assert first[p]["grad_norm"] == first["recompute"]["grad_norm"]
    second = {p: a.train_step(seqs, version=1) for p, a in actors.items()}
    assert second["loglinear"]["loss"] == second["behaviour"]["loss"]
    assert second["recompute"]["ratio_mean"] == 1.0 and second["behaviour"]["ratio_mean"] != 1.0
    assert second["recompute"]["imp_weight_mean"] != 1.0 and second["behaviour"]["imp_weight_mean"] == 1.0


@pytest.mark.parametrize("minibatches", [1, 2])
def test_first_minibatch_needs_no_prox_pass(megatron_ws1, model_dir, minibatches):
    """The first minibatch's training forward runs with π_prox's weights (the step's initial
    ones): its log-probs, detached, are the π_prox pass's, bit for bit. Two steps (the second on
    data one version old, π_behav shifted) equal an actor that passes over every minibatch,
    while the pass covers only the later minibatches (none with one)."""
    rng = np.random.default_rng(4)
    kw = dict(off_policy="trust_region", ppo_minibatches=minibatches)
    skip, ref = make_actor(model_dir, **kw), make_actor(model_dir, **kw)
    ref._prox_pass = lambda plan: [mb for minibatch in plan for mb in minibatch]   # every minibatch
    passed = {}
    for name, actor in (("skip", skip), ("ref", ref)):
        def counted(mbs, to_all_stages, _name=name, _fwd=actor._forward_logprobs):
            passed[_name] = passed.get(_name, 0) + len(mbs)
            return _fwd(mbs, to_all_stages=to_all_stages)
        actor._forward_logprobs = counted
    lens = [len(s["output_tokens"]) for s in make_seqs(seed=5)]
    seqs = batch(skip, 5, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
                 [rng.normal(0, 0.5, n).astype(np.float32) for n in lens])
    passed.clear()
    got = [skip.train_step(seqs, version=v) for v in (0, 1)]
    want = [ref.train_step(seqs, version=v) for v in (0, 1)]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "ratio_mean", "imp_weight_mean", "tr_masked_frac", "kl_behav"):
            assert g[key] == w[key], key
    assert max_weight_diff(skip, ref) == 0.0
    n_mbs = 2 * want[0]["n_micro_batches"]
    assert passed["ref"] == n_mbs and passed.get("skip", 0) < n_mbs
    if minibatches == 1:
        assert "skip" not in passed and got[0]["prox_seconds"] < 1e-3
    assert TrainConfig(ppo_minibatches=minibatches).prox_pass_share == (minibatches - 1) / minibatches
    assert TrainConfig(ppo_minibatches=4, off_policy="naive").prox_pass_share == 0
    assert TrainConfig(ppo_minibatches=4, prox="loglinear").prox_pass_share == 0


def test_minibatches_share_one_prox_and_step_each(megatron_ws1, model_dir):
    """ppo_minibatches=2 == two naive-PPO steps on the two minibatches, when π_behav is the
    step's initial policy: π_prox is computed once (with the initial weights), and each minibatch
    gets its own optimizer step."""
    kw = dict(reward_norm="none", total_steps=2)
    two = make_actor(model_dir, ppo_minibatches=2, **kw)
    ref = make_actor(model_dir, prox="behaviour", **kw)
    seqs = batch(two, 8, [1.0, -1.0, 0.5, 1.0, -0.5, 1.0, 0.0, -1.0])
    stats = two.train_step(seqs)
    lengths = [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs]
    ref_stats = [ref.train_step([seqs[i] for i in mb]) for mb in balanced_allocate(lengths, sum(lengths), 2)]
    n = [s["n_tokens"] for s in ref_stats]
    assert stats["loss"] == pytest.approx(sum(s["loss"] * k for s, k in zip(ref_stats, n)) / sum(n), rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(np.mean([s["grad_norm"] for s in ref_stats]), rel=1e-5)
    assert ref_stats[1]["ratio_mean"] != 1.0  # the second minibatch sees updated weights
    assert max_weight_diff(two, ref) < WEIGHT_ATOL


def test_objectives_coincide_on_policy(megatron_ws1, model_dir):
    """η = 0 (π_behav is the step's initial policy): naive PPO, decoupled and trust_region make
    the same update, bit for bit, with 4 minibatches (the later ones' ratios have moved, so the
    clips fire); trust_region's band gives no weight exactly to the tokens the clip stops. Their
    reported losses differ (a stopped token keeps its constant clipped term in PPO's loss)."""
    actors = {op: make_actor(model_dir, off_policy=op, ppo_minibatches=4)
              for op in ("naive", "decoupled", "trust_region")}
    seqs = batch(actors["naive"], 11, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    stats = {op: a.train_step(seqs) for op, a in actors.items()}
    assert stats["naive"]["clip_frac"] > 0
    assert stats["trust_region"]["tr_masked_frac"] == stats["trust_region"]["clip_frac"]
    for op in ("decoupled", "trust_region"):
        assert stats[op]["grad_norm"] == stats["naive"]["grad_norm"], op
        assert max_weight_diff(actors[op], actors["naive"]) == 0.0, op


def test_off_policy_objectives_train_and_report_their_diagnostics(megatron_ws1, model_dir):
    """Every `train.off_policy` through the actor on stale data (π_behav shifted from the
    policy): naive equals prox=behaviour exactly and skips the π_prox pass; the masks report
    what they dropped; ESS and the KLs are in the step's statistics."""
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    rng = np.random.default_rng(3)
    probe = make_actor(model_dir)
    seqs = batch(probe, 9, rewards)
    shift = [rng.normal(0, 0.7, len(s["output_tokens"])).astype(np.float32) for s in seqs]
    for s, d in zip(seqs, shift):
        s["behav_logprobs"] = s["behav_logprobs"] + d
    stats = {}
    for op in ("decoupled", "trust_region", "token_mask", "seq_mask", "naive"):
        stats[op] = make_actor(model_dir, off_policy=op, behav_kl_coef=0.01).train_step(seqs)
    ref = make_actor(model_dir, prox="behaviour", behav_kl_coef=0.01).train_step(seqs)
    assert stats["naive"]["loss"] == ref["loss"] and stats["naive"]["grad_norm"] == ref["grad_norm"]
    assert stats["naive"]["prox_seconds"] < 1e-3    # no π_prox pass (nor, at 1 minibatch, any)
    assert stats["token_mask"]["dropped_frac"] > stats["decoupled"]["dropped_frac"]
    assert stats["seq_mask"]["seq_masked_frac"] > 0 and stats["decoupled"]["seq_masked_frac"] == 0
    assert stats["trust_region"]["tr_masked_frac"] > 0
    for op, st in stats.items():
        assert 0 < st["ess"] < 1 and 0 < st["seq_ess"] < 1, op
        assert st["kl_behav"] > 0 and np.isfinite(st["loss"]), op
    assert stats["decoupled"]["kl_prox_behav"] > 0 and stats["naive"]["kl_prox_behav"] == 0


def test_a_step_without_learning_signal_leaves_the_weights(megatron_ws1, model_dir):
    """Equal rewards in every group: no forward, no optimizer step (Adam's momentum from an
    earlier step would still move the weights at zero gradient); the schedule goes on; the
    diagnostics it did not measure are NaN (null in metrics.jsonl), not an on-policy ESS of 1."""
    actor = make_actor(model_dir, lr_warmup_steps=4, total_steps=8)
    actor.train_step(batch(actor, 4, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]))
    before = {k: v.clone() for k, v in actor.hf_state_dict().items()}
    st = actor.train_step(batch(actor, 5, [1.0] * 4 + [0.0] * 4))
    assert st["no_signal_steps"] == 1 and st["no_signal_minibatches"] == 1
    assert st["skipped_steps"] == 0 and st["n_micro_batches"] == 0
    assert st["zero_var_groups"] == 2 and st["lr"] == pytest.approx(5e-4)
    for key in ("ess", "seq_ess", "kl_behav", "loss", "grad_norm", "clip_frac", "dropped_frac"):
        assert np.isnan(st[key]), key
    after = actor.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("objective,shift", [("decoupled", -3.0), ("seq_mask", -1.0)])
def test_a_minibatch_with_every_token_dropped_leaves_the_weights(megatron_ws1, model_dir,
                                                                   objective, shift):
    """The review's counter-example: after one normal step (Adam has momentum, and weight decay
    is on), a batch whose π_behav is below the policy on every token. decoupled, 3 nats: w = e³
    is above the cap (5), every token is dropped; seq_mask, 1 nat: w = e is under the cap but
    every sequence's geometric mean is outside [0.5, 2]. The rewards have signal, the loss has
    no gradient: neither minibatch makes an optimizer step, the weights stay bit for bit."""
    actor = make_actor(model_dir, off_policy=objective, ppo_minibatches=2, weight_decay=0.1)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    actor.train_step(batch(actor, 4, rewards))
    before = {k: v.clone() for k, v in actor.hf_state_dict().items()}
    seqs = batch(actor, 5, rewards)
    for s in seqs:
        s["behav_logprobs"] = s["behav_logprobs"] + np.float32(shift)
    st = actor.train_step(seqs)
    assert st["dropped_frac"] == 1.0 and st["adv_abs_mean"] > 0
    assert st["no_signal_minibatches"] == 2 and st["no_signal_steps"] == 1
    assert np.isnan(st["grad_norm"]) and np.isnan(st["imp_weight_mean"])   # nothing kept
    assert st["ess"] == pytest.approx(1.0) and st["kl_behav"] > 0.5    # measured: far, uniformly
    after = actor.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_minibatch_of_zero_advantages_makes_no_optimizer_step(megatron_ws1, model_dir):
    """Minibatches are split by length, not by group, so one can hold only sequences whose
    advantage is 0 (the default `filter_zero_variance: false`). That minibatch makes no optimizer
    step: the weights after the step are those of one step on the other minibatch alone."""
    from areal_hpc.train.shares import dp_split, sequence_lengths
    kw = dict(reward_norm="none", total_steps=2, weight_decay=0.1)
    two = make_actor(model_dir, ppo_minibatches=2, **kw)
    ref = make_actor(model_dir, **kw)
    seqs = batch(two, 8, [0.0] * 8)
    first, second = dp_split(sequence_lengths(seqs), 2, 1)[0]
    for k, i in enumerate(first):
        seqs[i]["reward"] = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5][k]
    st = two.train_step(seqs)
    assert st["no_signal_minibatches"] == 1 and st["no_signal_steps"] == 0
    ref_st = ref.train_step([seqs[i] for i in first])
    assert st["grad_norm"] == ref_st["grad_norm"]
    assert max_weight_diff(two, ref) == 0.0
    assert second, "the other minibatch holds sequences (of reward 0)"


def test_deterministic_mode_reaches_megatron_and_trains_alike(megatron_ws1, model_dir):
    """`deterministic: true` builds the model in Megatron's deterministic_mode (the embedding's
    backward without F.embedding's atomics); on CPU a step then trains as without it."""
    from areal_hpc.train.actor import Actor

    a = make_actor(model_dir)
    b = Actor(TrainConfig(lr=1e-3, max_tokens_per_mb=40, off_policy="decoupled"), model_dir,
              group_size=GROUP_SIZE,
              temperature=TEMPERATURE, deterministic=True)
    assert b.model.config.deterministic_mode and not a.model.config.deterministic_mode
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    a.train_step(batch(a, 4, rewards))
    b.train_step(batch(b, 4, rewards))
    assert max_weight_diff(a, b) < WEIGHT_ATOL


def test_training_raises_logprob_of_rewarded_sequences_with_lr_schedule(megatron_ws1, model_dir):
    actor = make_actor(model_dir, lr_warmup_steps=2, lr_decay_style="linear", total_steps=4, min_lr=1e-4)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    seqs = batch(actor, 4, rewards)
    before = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    lrs = []
    for _ in range(4):
        stats = actor.train_step(seqs)
        assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
        lrs.append(stats["lr"])
    # warm-up: lr * n / 2; then linear decay to min_lr at the last optimizer step
    np.testing.assert_allclose(lrs, [5e-4, 1e-3, 5.5e-4, 1e-4], rtol=1e-12)
    after = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    delta = np.array(after) - np.array(before)
    good = np.array(rewards) > 0
    assert (delta[good] > 0).all(), delta
    assert (delta[~good] < 0).all(), delta


def test_bad_inputs_are_named(megatron_ws1, model_dir):
    actor = make_actor(model_dir, prox="loglinear")
    seqs = batch(actor, 9, [1.0] * 8)
    del seqs[2]["versions"]
    with pytest.raises(KeyError, match="versions"):
        actor.train_step(seqs)
    seqs[2]["versions"] = np.zeros(1)
    seqs[2]["output_tokens"] = np.zeros(20, dtype=np.int32)
    with pytest.raises(ValueError, match="sequence 2: behav_logprobs and output_tokens differ"):
        actor.train_step(seqs)
    with pytest.raises(ValueError, match="sequence 0 has 44 tokens, more than the capacity of 40"):
        actor.compute_logprobs([dict(prompt_tokens=np.ones(4), output_tokens=np.ones(40))])


def test_trained_weights_load_into_transformers(megatron_ws1, model_dir, tmp_path):
    actor = make_actor(model_dir)
    seqs = batch(actor, 5, [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0])
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_trains_like_fp32(megatron_ws1, model_dir, dtype):
    """Half-precision parameters with fp32 main weights in Megatron's optimizer (fp16 with loss
    scaling): the first step's loss and grad norm match fp32, no step is skipped."""
    from areal_hpc.train.actor import Actor

    ref = make_actor(model_dir)
    seqs = batch(ref, 10, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    half = Actor(TrainConfig(lr=1e-3, max_tokens_per_mb=40), model_dir, group_size=GROUP_SIZE,
                 temperature=TEMPERATURE, dtype=dtype)
    got, want = half.train_step(seqs), ref.train_step(seqs)
    assert got["loss"] == pytest.approx(want["loss"], rel=0.02, abs=1e-3)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.02)
    assert got["skipped_steps"] == 0 and half.train_step(seqs)["skipped_steps"] == 0
    assert {t.dtype for t in half.hf_state_dict().values()} == {getattr(torch, dtype)}


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
