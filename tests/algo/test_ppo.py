"""Exact, hand-computed values for the GRPO advantages and the decoupled PPO loss."""

import math

import pytest
import torch

from areal_hpc.algo.ppo import (
    compute_advantages,
    OffPolicy,
    decoupled_ppo_loss,
    equal_reward_groups,
    grpo_advantages,
    loglinear_prox_logprobs,
    shape_rewards,
    token_normalised,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_grpo_advantages_group_zscore():
    # group 1: [1, 0] -> mean 0.5, std 0.5 -> [+1, -1]; group 2: [3, 1] -> same shape.
    adv = grpo_advantages(t(1.0, 0.0, 3.0, 1.0), group_size=2, eps=0.0)
    assert torch.equal(adv, t(1.0, -1.0, 1.0, -1.0))


def test_grpo_advantages_population_std_and_eps():
    # [0, 0, 0, 1]: mean 0.25, population std sqrt(3)/4.
    adv = grpo_advantages(t(0.0, 0.0, 0.0, 1.0), group_size=4, eps=1e-6)
    std = math.sqrt(3) / 4
    expected = t(-0.25, -0.25, -0.25, 0.75) / (std + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_grpo_advantages_equal_rewards_give_exact_zero():
    adv = grpo_advantages(t(0.1, 0.1, 0.1, 5.0, 5.0, 5.0, 1.0, 0.0, 1.0), group_size=3)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert adv[6] > 0 > adv[7]


def test_grpo_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError):
        grpo_advantages(t(1.0, 0.0, 1.0), group_size=2)


def test_ratio_one_gives_minus_mean_weighted_advantage():
    # First minibatch: logp == prox exactly. w = exp(prox - behav) = [1, e^0.5, e^-1].
    prox = t(-1.0, -2.0, -0.5)
    behav = t(-1.0, -2.5, 0.5)
    adv = t(2.0, -1.0, 3.0)
    mask = torch.tensor([True, True, True])
    logp = prox.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=None)
    w = torch.exp(prox - behav)
    assert torch.equal(loss.detach(), -(adv * w).sum() / 3)
    assert stats["ratio_mean"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0
    assert stats["dropped_frac"].item() == 0.0
    torch.testing.assert_close(stats["imp_weight_mean"], w.mean())
    torch.testing.assert_close(stats["approx_kl"], (behav - prox).mean())
    # d loss / d logp_t = -A_t w_t u_t / N with u = 1.
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * w / 3)


def test_standard_ppo_clip_when_prox_equals_behav():
    # u = [1.5, 0.5, 1.1, 0.7], eps 0.2.
    prox = torch.zeros(4)
    logp = torch.log(t(1.5, 0.5, 1.1, 0.7))
    adv = t(1.0, 1.0, -1.0, -1.0)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    # A>0, u=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A>0, u=0.5: max(-0.5, -0.8) = -0.5
    # A<0, u=1.1: max(1.1, 1.1) = 1.1                 A<0, u=0.7: max(0.7, 0.8) = 0.8 (clipped)
    torch.testing.assert_close(loss, t(-1.2 - 0.5 + 1.1 + 0.8).sum() / 4)
    assert stats["clip_frac"].item() == 0.5
    torch.testing.assert_close(stats["ratio_mean"], t(1.5 + 0.5 + 1.1 + 0.7).sum() / 4)


def test_clipped_tokens_have_no_gradient():
    prox = torch.zeros(2)
    logp = torch.log(t(1.5, 0.9)).requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logp, prox, prox, t(1.0, 1.0), torch.ones(2, dtype=torch.bool))
    loss.backward()
    assert logp.grad[0].item() == 0.0
    torch.testing.assert_close(logp.grad[1], torch.tensor(-0.9 / 2))


def test_cap_drops_tokens_but_keeps_them_in_the_denominator():
    prox = t(0.0, 0.0, 0.0, 0.0)
    behav = t(0.0, -math.log(5.0), -2.0, 0.0)  # w = [1, 5, e^2 ~ 7.39, 1]
    adv = t(1.0, 1.0, 1.0, 1.0)
    mask = torch.tensor([True, True, True, False])
    loss, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, behav_imp_weight_cap=5.0)
    # w == cap is kept (inclusive), e^2 is dropped; padding is excluded; denominator 3.
    w5 = math.exp(math.log(5.0))
    torch.testing.assert_close(loss, torch.tensor(-(1.0 + w5) / 3))
    torch.testing.assert_close(stats["dropped_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(stats["imp_weight_mean"], torch.tensor((1.0 + w5) / 2))
    # Without a cap the third token counts with its weight.
    loss_nocap, _ = decoupled_ppo_loss(prox, prox, behav, adv, mask, behav_imp_weight_cap=None)
    torch.testing.assert_close(loss_nocap, torch.tensor(-(1.0 + w5 + math.exp(2.0)) / 3))


def test_padding_is_ignored_even_when_non_finite():
    prox = t(-1.0, 0.0)
    logp = t(-1.0, 50.0).requires_grad_(True)  # padding position would give exp(50)*...
    behav = t(-1.0, -1e4)
    mask = torch.tensor([True, False])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, t(2.0, 1e9), mask, behav_imp_weight_cap=None)
    assert loss.item() == -2.0
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0


def test_eps_clip_high_widens_only_the_upper_side():
    # u = [1.5, 0.5], A = +1, eps 0.2, eps_high 0.4: upper bound 1.4, lower 0.8.
    prox = torch.zeros(2)
    logp = torch.log(t(1.5, 0.5))
    adv = t(1.0, -1.0)
    mask = torch.ones(2, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.4)
    # A>0, u=1.5: max(-1.5, -1.4) = -1.4      A<0, u=0.5: max(0.5, 0.8) = 0.8
    torch.testing.assert_close(loss, t(-1.4 + 0.8).sum() / 2)
    assert stats["clip_frac"].item() == 1.0


def test_dual_clip_bounds_negative_advantage_tokens():
    # A = -2, u = 5: PPO-clip gives max(10, 2.4) = 10; dual clip c = 3 bounds it at -c·A = 6.
    # A = +1 tokens are untouched by the dual clip.
    prox = torch.zeros(2)
    logp = torch.log(t(5.0, 5.0))
    adv = t(-2.0, 1.0)
    mask = torch.ones(2, dtype=torch.bool)
    loss, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, t(6.0 - 1.2).sum() / 2)
    with pytest.raises(ValueError, match="dual_clip"):
        decoupled_ppo_loss(logp, prox, prox, adv, mask, dual_clip=1.0)


def test_all_masked_input_gives_zero_loss_and_finite_grad():
    logp = torch.tensor([-1.0, float("-inf")], requires_grad=True)
    zeros = torch.zeros(2)
    mask = torch.zeros(2, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, zeros, zeros, t(1.0, -1.0), mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logp.grad).all()
    assert stats["clip_frac"].item() == 0.0


def test_shape_rewards_bias_scale_clip():
    # AReaL's GRPO recipe: bias -0.5, scaling 10 maps {0, 1} to {-5, +5}; clip at 4 bounds it.
    r = t(0.0, 1.0, 0.5)
    assert torch.equal(shape_rewards(r, -0.5, 10.0, 20.0), torch.tensor([-5.0, 5.0, 0.0], dtype=torch.float64))
    assert torch.equal(shape_rewards(r, -0.5, 10.0, 4.0), torch.tensor([-4.0, 4.0, 0.0], dtype=torch.float64))


def test_token_normalised_weighs_sequences_by_tokens():
    # Values 1 (3 tokens) and -1 (1 token): token mean 0.5, token variance 0.75.
    out = token_normalised(t(1.0, -1.0), torch.tensor([3, 1]), eps=0.0)
    std = math.sqrt(0.75)
    torch.testing.assert_close(out, torch.tensor([0.5 / std, -1.5 / std], dtype=torch.float64))
    # The same as a z-score over the expanded tokens.
    tokens = t(1.0, 1.0, 1.0, -1.0).double()
    ref = (tokens - tokens.mean()) / tokens.std(unbiased=False)
    torch.testing.assert_close(out.repeat_interleave(torch.tensor([3, 1])), ref)


def test_compute_advantages_order_and_switches():
    rewards = t(1.0, 0.0, 1.0, 1.0)
    n_tokens = torch.tensor([1, 1, 1, 3])
    # group z-score ([+1, -1], then an all-equal group -> 0); bias and scale do not change it.
    adv = compute_advantages(rewards, n_tokens, 2, reward_bias=-0.5, reward_scaling=10.0)
    torch.testing.assert_close(adv, t(1.0, -1.0, 0.0, 0.0), rtol=0, atol=1e-5)
    # no group norm: the shaped rewards themselves
    adv = compute_advantages(rewards, n_tokens, 2, reward_bias=-0.5, reward_scaling=10.0, reward_norm="none")
    assert torch.equal(adv, t(5.0, -5.0, 5.0, 5.0))
    # then a token-level z-score: tokens are [5, -5, 5, 5, 5, 5] -> mean 10/3
    adv = compute_advantages(rewards, n_tokens, 2, reward_bias=-0.5, reward_scaling=10.0,
                             reward_norm="none", adv_norm="batch")
    tokens = torch.tensor([5.0, -5.0, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    z = ((tokens - tokens.mean()) / (tokens.std(unbiased=False) + 1e-5)).float()
    torch.testing.assert_close(adv, z[:4])
    with pytest.raises(ValueError, match="reward_norm"):
        compute_advantages(rewards, n_tokens, 2, reward_norm="batch")
    with pytest.raises(ValueError, match="adv_norm"):
        compute_advantages(rewards, n_tokens, 2, adv_norm="group")


def test_loglinear_prox_alpha_by_version():
    # current version 5: v_behav 5 or 4 -> α 0; 3 -> 1/2; 1 -> 3/4; -1 (no version) -> 0;
    # 6 (ahead of the trainer: cannot happen, but must not blow up) -> 0.
    behav = t(-1.0, -1.0, -1.0, -1.0, -1.0, -1.0)
    logp = t(-2.0, -2.0, -2.0, -2.0, -2.0, -2.0).requires_grad_(True)
    versions = torch.tensor([5, 4, 3, 1, -1, 6])
    prox = loglinear_prox_logprobs(behav, logp, versions, current_version=5)
    torch.testing.assert_close(prox, t(-1.0, -1.0, -1.5, -1.75, -1.0, -1.0))
    assert not prox.requires_grad  # π_prox is a constant of the loss


# ---------------------------------------------------------------- off-policy objectives


def _first_minibatch(prox, behav):
    """π_θ = π_prox (the first minibatch of a step), with a gradient."""
    return prox.clone().requires_grad_(True), prox, behav


def test_token_mask_drops_weights_outside_the_band_on_both_sides():
    w = t(0.4, 1.0, 3.0, 6.0)
    prox = t(-1.0, -1.0, -1.0, -1.0)
    logp, prox, behav = _first_minibatch(prox, prox - torch.log(w))
    adv = t(1.0, 2.0, -1.0, 4.0)
    mask = torch.ones(4, dtype=torch.bool)
    op = OffPolicy("token_mask", w_low=0.5, w_high=5.0)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op)
    # kept: w = 1 (A = 2) and w = 3 (A = -1); the other two give nothing but count.
    torch.testing.assert_close(loss.detach(), torch.tensor(-(2.0 * 1.0 - 1.0 * 3.0) / 4))
    torch.testing.assert_close(stats["dropped_frac"], torch.tensor(0.5))
    loss.backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[3].item() == 0.0
    torch.testing.assert_close(logp.grad[1:3], t(-2.0 * 1.0 / 4, 1.0 * 3.0 / 4))
    # decoupled with the same cap keeps the low-weight token
    loss_d, _ = decoupled_ppo_loss(logp.detach(), prox, behav, adv, mask,
                                   off_policy=OffPolicy("decoupled", w_low=0.5, w_high=5.0))
    torch.testing.assert_close(loss_d, torch.tensor(-(0.4 + 2.0 - 3.0) / 4))


def test_seq_mask_rejects_a_whole_sequence_by_its_geometric_mean_weight():
    # sequence 0: w = [3, 3] (geometric mean 3 > 2: rejected); sequence 1: w = [2, 0.5] (mean 1).
    w = t(3.0, 3.0, 2.0, 0.5)
    prox = t(-0.5, -1.0, -1.5, -2.0)
    logp, prox, behav = _first_minibatch(prox, prox - torch.log(w))
    adv = t(1.0, 1.0, -1.0, -1.0)
    mask = torch.ones(4, dtype=torch.bool)
    op = OffPolicy("seq_mask", seq_low=0.5, seq_high=2.0)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op, seq_lens=[2, 2])
    torch.testing.assert_close(loss.detach(), torch.tensor((2.0 + 0.5) / 4))
    torch.testing.assert_close(stats["seq_masked_frac"], torch.tensor(0.5))
    torch.testing.assert_close(stats["dropped_frac"], torch.tensor(0.5))
    # the sequence-level diagnostics: geometric-mean r = π_θ/π_behav per sequence (= w here)
    assert stats["n_seqs"].item() == 2
    torch.testing.assert_close(stats["seq_r_mean"], torch.tensor((3.0 + 1.0) / 2, dtype=torch.float64))
    torch.testing.assert_close(stats["seq_r_sq_mean"], torch.tensor((9.0 + 1.0) / 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="seq_lens"):
        decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op, seq_lens=[2, 1])


def test_trust_region_stops_tokens_the_advantage_pushes_out_of_the_behaviour_band():
    # π_θ = π_prox and r = π_θ/π_behav = w = [1.5, 1.5, 0.5, 0.5]: tokens 0 (A > 0, r > 1.2) and 3
    # (A < 0, r < 0.8) would move further out; tokens 1 and 2 would move back in.
    r = t(1.5, 1.5, 0.5, 0.5)
    prox = t(-1.0, -1.0, -2.0, -2.0)
    logp, prox, behav = _first_minibatch(prox, prox - torch.log(r))
    adv = t(2.0, -1.0, 1.0, -3.0)
    mask = torch.ones(4, dtype=torch.bool)
    dec, _ = decoupled_ppo_loss(logp.detach(), prox, behav, adv, mask,
                                off_policy=OffPolicy("decoupled", w_high=None))
    torch.testing.assert_close(dec, torch.tensor(-(3.0 - 1.5 + 0.5 - 1.5) / 4))
    op = OffPolicy("trust_region", w_high=None, behav_clip=0.2)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op)
    torch.testing.assert_close(loss.detach(), torch.tensor(-(-1.5 + 0.5) / 4))
    torch.testing.assert_close(stats["tr_masked_frac"], torch.tensor(0.5))
    loss.backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[3].item() == 0.0
    assert logp.grad[1].item() != 0.0 and logp.grad[2].item() != 0.0


def test_trust_region_masks_on_r_not_on_w():
    """π_θ ≠ π_prox ≠ π_behav, so r = π_θ/π_behav and w = π_prox/π_behav differ, and the band
    [0.8, 1.2] puts them on opposite sides: token 0 has r = 1.1 (inside) but w = 1.5 (outside),
    token 1 has r = 1.3 (outside) but w = 1.0 (inside); both advantages positive. The trust
    region stops token 1 (r), not token 0 (w)."""
    behav = t(-1.0, -1.0)
    prox = behav + torch.log(t(1.5, 1.0))
    logp = (behav + torch.log(t(1.1, 1.3))).requires_grad_(True)
    adv = t(1.0, 1.0)
    mask = torch.ones(2, dtype=torch.bool)
    op = OffPolicy("trust_region", w_high=None, behav_clip=0.2)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op)
    torch.testing.assert_close(stats["tr_masked_frac"], torch.tensor(0.5))
    loss.backward()
    # token 0: u = 1.1/1.5 < 1 - ε, A > 0: the unclipped branch, gradient -A·u·w / 2
    torch.testing.assert_close(logp.grad[0], torch.tensor(-1.1 / 1.5 * 1.5 / 2))
    assert logp.grad[1].item() == 0.0
    assert stats["signal_tokens"].item() == 1


def test_kl_penalty_gradient_keeps_its_sign_above_the_clamp():
    """β·KL(π_behav‖π_θ): for log r = log π_θ - log π_behav > 0 the gradient pushes log π_θ
    down (a positive gradient of the loss), at every log r, also past the clamp of r at
    log r = 20, and stays finite; the penalty is continuous there."""
    log_r = t(1.0, 19.0, 19.999, 20.001, 21.0, 25.0, 60.0)
    behav = torch.zeros_like(log_r)
    logp = log_r.clone().requires_grad_(True)
    op = OffPolicy("decoupled", w_high=None, kl_coef=0.1)
    mask = torch.ones_like(log_r, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, logp.detach(), behav, torch.zeros_like(log_r), mask,
                                     off_policy=op)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad > 0).all(), logp.grad
    assert (logp.grad[1:] >= logp.grad[:-1] * (1 - 1e-6)).all()      # never smaller further out
    per_token = []
    for x in (20.0 - 1e-5, 20.0 + 1e-5):
        one = t(x).requires_grad_(True)
        val, _ = decoupled_ppo_loss(one, one.detach(), t(0.0), t(0.0), torch.ones(1, dtype=torch.bool),
                                    off_policy=op)
        per_token.append(val.item())
    assert per_token[1] == pytest.approx(per_token[0], rel=1e-3)


def test_the_loss_refuses_a_padded_batch_in_one_line():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"flat \[total_tokens\].*logprobs has shape \[2, 3\]"):
        decoupled_ppo_loss(x, x, x, x, torch.ones(2, 3, dtype=torch.bool))
    flat = torch.zeros(6)
    with pytest.raises(ValueError, match=r"advantages has shape \[2, 3\], logprobs \[6\]"):
        decoupled_ppo_loss(flat, flat, flat, x, torch.ones(6, dtype=torch.bool))


def test_zero_variance_is_decided_on_the_stored_float32():
    """0.1 + 0.2 and 0.3 differ in float64 but are the same float32, the dtype the rollout log
    stores: one decision for the trainer and the audit, and the advantages agree with it."""
    rewards = torch.tensor([0.1 + 0.2, 0.3, 1.0, 0.0], dtype=torch.float64)
    assert equal_reward_groups(rewards, 2).tolist() == [True, False]
    assert equal_reward_groups(rewards.numpy().astype("float32"), 2).tolist() == [True, False]
    assert grpo_advantages(rewards, 2)[:2].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        equal_reward_groups(rewards, 3)


def test_kl_penalty_to_the_behaviour_policy_k3():
    prox = t(-1.0, -2.0)
    behav = t(-1.5, -1.0)
    logp = prox.clone().requires_grad_(True)
    adv = t(0.0, 0.0)                       # no policy-gradient term: the penalty alone
    mask = torch.ones(2, dtype=torch.bool)
    op = OffPolicy("decoupled", w_high=None, kl_coef=0.1)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, off_policy=op)
    log_r = prox - behav                    # [0.5, -1.0]
    k3 = torch.exp(log_r) - 1 - log_r
    torch.testing.assert_close(loss.detach(), 0.1 * k3.mean())
    torch.testing.assert_close(stats["kl_behav"], k3.mean())
    loss.backward()                         # d/dlogp (r - 1 - log r) = r - 1
    torch.testing.assert_close(logp.grad, 0.1 * (torch.exp(log_r) - 1) / 2)


def test_diagnostics_token_ess_and_kl_prox_behav():
    w = t(0.5, 1.0, 2.0)
    prox = t(-1.0, -1.0, -1.0)
    logp, prox, behav = _first_minibatch(prox, prox - torch.log(w))
    _, stats = decoupled_ppo_loss(logp, prox, behav, t(1.0, 1.0, 1.0), torch.ones(3, dtype=torch.bool),
                                  off_policy=OffPolicy(w_high=None))
    torch.testing.assert_close(stats["r_mean"], w.mean())
    torch.testing.assert_close(stats["r_sq_mean"], w.square().mean())
    torch.testing.assert_close(stats["kl_prox_behav"], (w * torch.log(w) - w + 1).mean())
    ess = stats["r_mean"] ** 2 / stats["r_sq_mean"]
    torch.testing.assert_close(ess, torch.tensor((3.5 / 3) ** 2 / (5.25 / 3)))


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="token_mask"):
        OffPolicy("ppo2")
