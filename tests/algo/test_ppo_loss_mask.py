"""The decoupled PPO loss over a multi-turn episode's tokens: an observation token (mask 0) is
in no sum, no count and no diagnostic, whatever its log-probabilities hold."""
import torch

from areal_hpc.algo.ppo import OffPolicy, decoupled_ppo_loss


def _loss(logprobs, prox, behav, adv, mask, lens, op):
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(lp, prox, behav, adv, mask, off_policy=op, seq_lens=lens,
                                     dual_clip=3.0)
    loss.backward()
    return loss.detach(), stats, lp.grad


def test_masked_tokens_add_nothing_to_loss_gradient_counts_or_diagnostics():
    g = torch.Generator().manual_seed(0)
    lens = [5, 7]
    n = sum(lens)
    logprobs = -torch.rand(n, generator=g, dtype=torch.float64)
    prox = logprobs + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0] * 5 + [-0.5] * 7, dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[2, 3, 8, 9, 10]] = False              # two observations, in the middle of turns
    keep = mask.nonzero()[:, 0]
    kept_lens = [int(mask[:5].sum()), int(mask[5:].sum())]
    # garbage where the mask is 0: what an observation token holds must not matter
    wild = lambda x: torch.where(mask, x, torch.tensor(-1e4, dtype=torch.float64))
    for op in (OffPolicy("decoupled", kl_coef=0.1), OffPolicy("seq_mask"),
               OffPolicy("trust_region"), OffPolicy("token_mask", w_low=0.5)):
        loss, stats, grad = _loss(logprobs, prox, behav, adv, mask, lens, op)
        loss_w, stats_w, grad_w = _loss(logprobs, wild(prox), wild(behav), adv, mask, lens, op)
        ref, ref_stats, ref_grad = _loss(logprobs[keep], prox[keep], behav[keep], adv[keep],
                                         mask[keep], kept_lens, op)
        assert torch.equal(grad[~mask], torch.zeros(5, dtype=torch.float64))
        assert torch.equal(loss, loss_w) and torch.equal(grad, grad_w)
        assert torch.allclose(loss, ref, rtol=1e-12) and torch.allclose(grad[keep], ref_grad, rtol=1e-12)
        for key, value in ref_stats.items():
            assert torch.allclose(stats[key].double(), value.double(), rtol=1e-12), (op, key)
            assert torch.equal(stats[key], stats_w[key]), (op, key)
