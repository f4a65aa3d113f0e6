"""The Actor trains a multi-turn episode's sampled tokens only: an observation token (loss mask
0) gives no gradient and counts in no denominator; a mask of ones trains as no mask does."""
import numpy as np
import pytest
import torch

from tests.train.test_actor import make_actor, make_seqs

OBS = 4         # observation tokens at the end of sequence 0 (nothing after them attends to them)


def grads(actor) -> dict[str, torch.Tensor]:
    """The step's gradient (Megatron's DDP buffer: one minibatch, so the whole step's)."""
    return {name: p.main_grad.detach().clone() for name, p in actor.model.named_parameters()}


def episode_batch(actor, obs_ids, middle: bool = False, obs_logprob: float = 0.0):
    """Eight sequences (two groups), behaviour log-probs the actor's own, shifted so that the
    loss has a gradient; sequence 0 is an episode ending in OBS observation tokens `obs_ids`
    (mask 0, version -1, log-prob `obs_logprob`), and with `middle` sequence 1 has OBS
    observation tokens between two sampled turns."""
    seqs = make_seqs(seed=11)
    seqs[0]["output_tokens"] = np.concatenate([seqs[0]["output_tokens"], obs_ids]).astype(np.int32)
    current = actor.compute_logprobs(seqs)
    rng = np.random.default_rng(5)
    for i, s in enumerate(seqs):
        n = len(s["output_tokens"])
        s["reward"] = float(i % 3 == 0)
        s["behav_logprobs"] = (current[i] + rng.normal(0, 0.2, n)).astype(np.float32)
        s["versions"] = np.zeros(n, np.int32)
    mask = np.ones(len(seqs[0]["output_tokens"]), np.uint8)
    mask[-OBS:] = 0
    seqs[0]["loss_mask"] = mask
    if middle:
        mid = np.ones(len(seqs[1]["output_tokens"]), np.uint8)
        mid[1:1 + OBS] = 0
        seqs[1]["loss_mask"] = mid
    for s in seqs[:2 if middle else 1]:
        s["behav_logprobs"][s["loss_mask"] == 0] = obs_logprob
        s["versions"][s["loss_mask"] == 0] = -1
    return seqs


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_an_observation_token_gives_exactly_no_gradient(megatron_ws1, model_dir):
    """Other observation ids (the targets a masked position would predict) and other behaviour
    log-probabilities at masked positions: the gradient and the step's statistics are bit for
    bit the same. Unmasked, the same tokens do change the gradient (the test has power)."""
    runs = []
    for obs_ids, obs_logprob in (([1, 2, 3, 4], 0.0), ([100, 7, 55, 9], -30.0)):
        actor = make_actor(model_dir, max_tokens_per_mb=10_000)
        seqs = episode_batch(actor, np.asarray(obs_ids), middle=True, obs_logprob=obs_logprob)
        stats = actor.train_step(seqs)
        runs.append((grads(actor), stats, seqs))
    (g1, s1, seqs), (g2, s2, _) = runs
    _same(g1, g2)
    for key in ("loss", "grad_norm", "clip_frac", "ratio_mean", "approx_kl", "kl_behav",
                "dropped_frac", "ess", "n_tokens", "entropy"):
        assert s1[key] == s2[key] or (np.isnan(s1[key]) and np.isnan(s2[key])), key
    sampled = sum(int(np.count_nonzero(s.get("loss_mask", np.ones(len(s["output_tokens"])))))
                  for s in seqs)
    assert s1["n_tokens"] == sampled == sum(len(s["output_tokens"]) for s in seqs) - 2 * OBS

    actor = make_actor(model_dir, max_tokens_per_mb=10_000)
    unmasked = episode_batch(actor, np.asarray([100, 7, 55, 9]), middle=True, obs_logprob=-30.0)
    for s in unmasked[:2]:
        del s["loss_mask"]
        s["versions"][:] = 0
    s3 = actor.train_step(unmasked)
    assert s3["n_tokens"] == sampled + 2 * OBS
    assert any(not torch.equal(g1[k], v) for k, v in grads(actor).items())


def test_a_masked_tail_trains_as_the_sequence_without_it(megatron_ws1, model_dir):
    """Sequence 0 with its observation tail masked, and sequence 0 cut before the tail: the same
    loss, gradient norm and token count (up to rounding: the packed rows differ in length)."""
    with_tail = make_actor(model_dir, max_tokens_per_mb=10_000)
    seqs = episode_batch(with_tail, np.asarray([9, 8, 7, 6]))
    cut = [dict(s) for s in seqs]
    cut[0] = {**seqs[0], "output_tokens": seqs[0]["output_tokens"][:-OBS],
              "behav_logprobs": seqs[0]["behav_logprobs"][:-OBS],
              "versions": seqs[0]["versions"][:-OBS]}
    del cut[0]["loss_mask"]
    a = with_tail.train_step(seqs)
    without = make_actor(model_dir, max_tokens_per_mb=10_000)
    b = without.train_step(cut)
    assert a["n_tokens"] == b["n_tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["adv_abs_mean"] == b["adv_abs_mean"] and a["entropy"] == pytest.approx(b["entropy"])


def test_a_mask_of_ones_trains_exactly_as_no_mask(megatron_ws1, model_dir):
    """Single-turn samples (no loss_mask) and the same samples with a mask of ones: bit for bit
    the same gradient, statistics and weights after the step."""
    runs = []
    for with_mask in (False, True):
        actor = make_actor(model_dir, max_tokens_per_mb=40, ppo_minibatches=1)
        seqs = episode_batch(actor, np.asarray([1, 2, 3, 4]))
        seqs[0]["versions"][:] = 0
        seqs[0]["behav_logprobs"][-OBS:] = -1.0
        for s in seqs:
            s.pop("loss_mask", None)
            if with_mask:
                s["loss_mask"] = np.ones(len(s["output_tokens"]), np.uint8)
        stats = actor.train_step(seqs)
        runs.append((grads(actor), stats, actor.hf_state_dict()))
    (g1, s1, w1), (g2, s2, w2) = runs
    _same(g1, g2)
    _same(w1, w2)
    for key, value in s1.items():
        if not key.endswith("seconds"):
            assert value == s2[key] or (np.isnan(value) and np.isnan(s2[key])), key


def test_sequences_without_an_output_token_add_nothing_to_the_step(megatron_ws1, model_dir):
    """Sequences with no output token (an episode that ended before the model's first turn; a
    whole group of them never reaches a step: tests/rollout/test_controller_one_process.py)
    add nothing: the same loss, gradient norm and token count as the batch without them (up to
    rounding: the packed rows differ)."""
    from tests.train.test_actor import GROUP_SIZE

    with_failed = make_actor(model_dir, max_tokens_per_mb=10_000)
    seqs = episode_batch(with_failed, np.asarray([9, 8, 7, 6]))
    failed = [{"prompt_tokens": seqs[0]["prompt_tokens"], "output_tokens": np.zeros(0, np.int32),
               "behav_logprobs": np.zeros(0, np.float32), "versions": np.zeros(0, np.int32),
               "loss_mask": np.zeros(0, np.uint8), "reward": 0.0} for _ in range(GROUP_SIZE)]
    a = with_failed.train_step([dict(s) for s in seqs] + failed)
    without = make_actor(model_dir, max_tokens_per_mb=10_000)
    b = without.train_step([dict(s) for s in seqs])
    assert a["n_tokens"] == b["n_tokens"] > 0
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["entropy"] == pytest.approx(b["entropy"])
