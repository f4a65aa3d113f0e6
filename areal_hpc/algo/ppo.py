"""GRPO advantages and the decoupled PPO loss (AReaL, arXiv 2505.24298). Pure torch.

Three log-probabilities per generated token:
- `behav_logprobs`: log π_behav, returned by the inference engine that sampled the token (possibly
  several policy versions inside one trajectory);
- `prox_logprobs`: log π_prox, recomputed with the trainer's weights at the start of the step;
- `logprobs`: log π_θ, the policy being optimised.

    loss = Σ_t mask_t · w_t · max(-A_t u_t, -A_t clip(u_t, 1-ε, 1+ε)) / Σ_t mask_t
    u_t = π_θ / π_prox,   w_t = π_prox / π_behav  (0 where w_t > cap)

Tokens whose behaviour weight exceeds the cap are dropped, not clipped, and still count in the
denominator: this is AReaL's exact form (v0.3 `actor_loss_fn`, HEAD rejection sampling "mask").

The other off-policy corrections (`OffPolicy`: a trust region anchored on π_behav, two-sided
token masking, sequence-level geometric rejection, a KL(π_behav‖π_θ) penalty, naive PPO) change
which tokens keep their weight, and report the diagnostics that precede a collapse (effective
sample size, KL to the behaviour policy, masked fractions).

Advantages have no critic (γ = λ = 1, AReaL's math recipes): every output token of a sequence
carries that sequence's advantage, so they are computed per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from areal_hpc.config import OFF_POLICY_OBJECTIVES


# The dtype of a reward in the rollout log (rollouts.h5 `reward` f4). Zero variance is decided on
# it, so that the trainer and every reader of the log (the audit) decide it alike.
STORED_REWARD_DTYPE = np.float32


def equal_reward_groups(rewards, group_size: int, valid=None) -> np.ndarray:
    """`[num_groups]` bool: the group's rewards are all equal once rounded to the log's dtype
    (`STORED_REWARD_DTYPE`): such a group has no learning signal. `rewards` (tensor or array,
    `[num_seqs]`, group-contiguous) are the ones advantages are computed from; `valid` (bool,
    `[num_seqs]`, None: all) the ones that count (a group with none counts as not equal: it is
    left out for another reason). The one decision of zero variance: `grpo_advantages`, the
    trainer's guards and the audit all call it."""
    if isinstance(rewards, Tensor):
        rewards = rewards.detach().cpu().numpy()
    r = np.asarray(rewards).astype(STORED_REWARD_DTYPE)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    r = r.reshape(-1, group_size)
    if valid is None:
        return (r == r[:, :1]).all(axis=1)
    v = np.asarray(valid, dtype=bool).reshape(-1, group_size)
    lo = np.where(v, r, np.inf).min(axis=1)
    hi = np.where(v, r, -np.inf).max(axis=1)
    return v.any(axis=1) & (lo == hi)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, valid=None) -> Tensor:
    """Per-group z-score of sequence rewards.

    Args:
        rewards: `[num_seqs]`, laid out group-contiguous (`group_size` samples of one prompt, then
            the next prompt's).
        group_size: samples per prompt; `num_seqs % group_size == 0`.
        valid: `[num_seqs]` bool (None: all): the sequences a group's mean and std are taken
            over (a discarded episode is not the model's outcome); the others get 0.
    Returns:
        `[num_seqs]` float32: `(r - mean_group) / (std_group + eps)`, population std. A group whose
        rewards are all equal gets exactly 0 (it carries no learning signal).
    """
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.detach().float().view(-1, group_size)
    if valid is None:
        centred = r - r.mean(dim=1, keepdim=True)
        adv = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
        equal = torch.from_numpy(equal_reward_groups(rewards, group_size)).to(adv.device)
    else:
        v = torch.as_tensor(np.asarray(valid, dtype=bool)).to(r.device).view(-1, group_size)
        n = v.sum(dim=1, keepdim=True).clamp(min=1)
        mean = torch.where(v, r, 0.0).sum(dim=1, keepdim=True) / n
        centred = torch.where(v, r - mean, 0.0)
        adv = centred / ((centred.square().sum(dim=1, keepdim=True) / n).sqrt() + eps)
        equal = torch.from_numpy(equal_reward_groups(rewards, group_size, valid))
    # Equal rewards: centred is 0 up to rounding; make it exact.
    adv = torch.where(equal.to(adv.device).view(-1, 1), torch.zeros_like(adv), adv)
    return adv.view(-1)


def shape_rewards(rewards: Tensor, bias: float = 0.0, scaling: float = 1.0, clip: float = 20.0) -> Tensor:
    """`clip((r + bias) * scaling, -clip, clip)`, AReaL's reward_bias / reward_scaling / reward_clip."""
    return ((rewards.double() + bias) * scaling).clamp(-clip, clip)


def token_normalised(seq_values: Tensor, n_tokens: Tensor, eps: float = 1e-5) -> Tensor:
    """Z-score over all output tokens of the batch, for values that are constant per sequence.

    Token level, as AReaL's `masked_normalization` over the loss mask: a sequence weighs by its
    token count. Population variance, `(x - mean) / (std + eps)`, in float64.

    Args:
        seq_values: `[num_seqs]`, one value per sequence (all of its tokens share it).
        n_tokens: `[num_seqs]`, output tokens per sequence.
    """
    x = seq_values.double()
    w = n_tokens.double()
    total = w.sum().clamp(min=1.0)
    mean = (w * x).sum() / total
    var = (w * (x - mean).square()).sum() / total
    return (x - mean) / (var.sqrt() + eps)


def compute_advantages(
    rewards: Tensor,
    n_tokens: Tensor,
    group_size: int,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float = 20.0,
    reward_norm: str = "group",
    adv_norm: str = "none",
    valid=None,
) -> Tensor:
    """Per-sequence advantages of a whole batch, AReaL's order: shape, normalise per group,
    then (optionally) normalise over all tokens of the batch.

    Args:
        rewards: `[num_seqs]` scalar rewards, group-contiguous.
        n_tokens: `[num_seqs]` output tokens per sequence (weights of the token-level norm).
        reward_norm: "group" (GRPO z-score per prompt) or "none".
        adv_norm: "batch" (token-level z-score over the batch) or "none".
        valid: `[num_seqs]` bool (None: all), the sequences each group's statistics are over
            (`grpo_advantages`).
    Returns:
        `[num_seqs]` float32.
    """
    r = shape_rewards(rewards, reward_bias, reward_scaling, reward_clip)
    if reward_norm == "group":
        r = grpo_advantages(r, group_size, valid=valid)
    elif reward_norm != "none":
        raise ValueError(f"reward_norm must be group or none, got {reward_norm!r}")
    if adv_norm == "batch":
        r = token_normalised(r, n_tokens)
    elif adv_norm != "none":
        raise ValueError(f"adv_norm must be batch or none, got {adv_norm!r}")
    return r.float()


def loglinear_prox_logprobs(
    behav_logprobs: Tensor, logprobs: Tensor, versions: Tensor, current_version: int
) -> Tensor:
    """log π_prox without a forward pass: AReaL's "loglinear" approximation (A-3PO).

        α = clamp((v_prox - v_behav) / (v_θ - v_behav), 0, 1),  v_θ = current_version,
        v_prox = current_version - 1,
        log π_prox ≈ log π_behav + α (log π_θ - log π_behav)

    `current_version` is the version of the weights being trained (before this step's update).
    Tokens sampled by it or by the version before get α = 0 (π_prox = π_behav); staler tokens
    move towards π_θ. Tokens with no version (< 0) or none behind v_θ also get α = 0.

    Args (flat `[total_tokens]`): behaviour log-probs, current log-probs (detached here), and the
    policy version that sampled each token.
    """
    v = versions.to(torch.float64)
    behind = current_version - v
    alpha = torch.where((behind > 0) & (v >= 0), (behind - 1) / behind.clamp(min=1), 0.0)
    alpha = alpha.clamp(0.0, 1.0).to(behav_logprobs.dtype)
    behav = behav_logprobs.detach()
    return behav + alpha * (logprobs.detach() - behav)


# log r = log π_θ - log π_behav above which r is not exponentiated (the KL penalty and the
# diagnostics); the penalty goes on linearly from there.
LOG_R_MAX = 20.0
_SLOPE_AT_MAX = float(np.expm1(LOG_R_MAX))
_K3_AT_MAX = _SLOPE_AT_MAX - LOG_R_MAX


@dataclass(frozen=True)
class OffPolicy:
    """How stale data is corrected (`train.off_policy` and its bands); see `decoupled_ppo_loss`.

    objective:
        decoupled     AReaL's decoupled PPO (Hilton et al. 2022; Fu et al. 2025): clip against
                      π_prox, weight w = π_prox/π_behav, tokens with w > w_high dropped.
        trust_region  decoupled, plus a trust region anchored on the behaviour policy: a token
                      whose r = π_θ/π_behav is outside [1 - behav_clip, 1 + behav_clip] gets no
                      gradient where the advantage would push r further out (PPO's clip taken
                      against the sampling policy, as naive PPO does, on top of decoupled's).
        token_mask    decoupled with two-sided masking of the token weight: tokens with w outside
                      [w_low, w_high] dropped (masked importance sampling, as IcePop-style
                      train/inference-mismatch corrections do).
        seq_mask      decoupled with sequence-level geometric rejection: a whole sequence is
                      dropped when the geometric mean of its tokens' w is outside
                      [seq_low, seq_high] (geometric-mean sequence masking); kept tokens with
                      w > w_high dropped as in decoupled.
        naive         PPO-clip against the sampling policy, no π_prox (the caller passes
                      π_behav as π_prox: w = 1).
    kl_coef: β of an added penalty β·KL(π_behav‖π_θ), k3 estimator r - 1 - log r per token
        (Schulman's; unbiased on tokens sampled from π_behav), 0 = none.
    """
    objective: str = "decoupled"
    w_low: float | None = None          # token_mask's lower bound of w
    w_high: float | None = 5.0          # every objective's upper bound of w (None: no cap)
    seq_low: float = 0.5
    seq_high: float = 2.0
    behav_clip: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self):
        if self.objective not in OFF_POLICY_OBJECTIVES:
            raise ValueError(f"off-policy objective must be one of {', '.join(OFF_POLICY_OBJECTIVES)}, "
                             f"got {self.objective!r}")


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float = 0.2,
    behav_imp_weight_cap: float | None = None,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    off_policy: OffPolicy | None = None,
    seq_lens: Sequence[int] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO-clip loss and its off-policy variants (`OffPolicy`), token mean over
    `loss_mask`.

    All inputs are flat `[total_tokens]`; only `logprobs` carries a gradient. With
    `prox_logprobs == behav_logprobs` this is standard PPO-clip; on the first minibatch of a step
    `logprobs == prox_logprobs`, so u == 1 exactly and the loss is `-mean(A * w)`.

    `eps_clip_high` (DAPO clip-higher) makes the clip range [1 - eps_clip, 1 + eps_clip_high];
    `dual_clip` c > 1 bounds the loss of a negative-advantage token by -c·A (dual-clip PPO).
    `behav_imp_weight_cap`: tokens with w above it are dropped; None (the default) keeps all
    (without `off_policy`; with it, `off_policy.w_high` is the cap).
    `seq_lens`: output tokens of each sequence, in order (sum = total_tokens): the sequences of
    `seq_mask` and of the sequence-level diagnostics (None: one sequence).

    Returns:
        loss: scalar, `Σ mask·w·pg / count_nonzero(mask)` (dropped tokens stay in the denominator)
            plus `kl_coef` times the token mean of the KL estimate.
        stats: detached scalars; token means over the masked tokens: `clip_frac` (tokens where
            the clipped branch is taken), `ratio_mean` (u), `dropped_frac` (given no weight by
            the w bounds, the sequence mask or the trust region), `seq_masked_frac` (by the
            sequence mask), `tr_masked_frac` (by the trust region), `approx_kl` (mean of
            log π_behav - log π_θ, the k1 estimator of KL(π_behav ‖ π_θ)), `kl_behav` (its k3
            estimator, mean r - 1 - log r with r = π_θ/π_behav), `kl_prox_behav` (KL(π_prox ‖
            π_behav): mean w log w - w + 1), `r_mean`, `r_sq_mean` (of r: the token-level
            effective sample size is r_mean² / r_sq_mean); `imp_weight_mean` (w over kept
            tokens); per sequence: `n_seqs`, `seq_r_mean`, `seq_r_sq_mean` (of each sequence's
            geometric-mean r); `signal_tokens`, the count of tokens that give the loss a
            gradient (kept, with a non-zero advantage; with `kl_coef`, every masked token).
    Raises:
        ValueError: an input that is not flat `[total_tokens]` (e.g. a padded `[B, T]` batch),
            or of another length than `logprobs`.
    """
    op = off_policy or OffPolicy(w_high=behav_imp_weight_cap)
    for name, x in (("logprobs", logprobs), ("prox_logprobs", prox_logprobs),
                    ("behav_logprobs", behav_logprobs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        if x.dim() != 1 or x.shape != logprobs.shape:
            raise ValueError(f"decoupled_ppo_loss takes flat [total_tokens] tensors of one length "
                             f"(a packed batch); {name} has shape {list(x.shape)}"
                             + ("" if name == "logprobs" else f", logprobs {list(logprobs.shape)}"))
    mask = loss_mask.bool()
    n_tokens = mask.count_nonzero().clamp(min=1)
    prox = prox_logprobs.detach()
    behav = behav_logprobs.detach()
    adv = advantages.detach()
    lens = [int(logprobs.numel())] if seq_lens is None else [int(n) for n in seq_lens]
    if sum(lens) != logprobs.numel():
        raise ValueError(f"seq_lens add up to {sum(lens)}, not the {logprobs.numel()} tokens")
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=logprobs.device),
                                     torch.tensor(lens, dtype=torch.long, device=logprobs.device))

    # Padding positions are neutralised before exp(): an inf there would turn into NaN gradients.
    ratio = torch.exp(torch.where(mask, logprobs - prox, 0.0))
    high = eps_clip if eps_clip_high is None else eps_clip_high
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)

    log_w = torch.where(mask, prox - behav, 0.0)
    imp_weight = torch.exp(log_w)
    keep = mask
    if op.w_high is not None:
        keep = keep & (imp_weight <= op.w_high)
    if op.objective == "token_mask" and op.w_low is not None:
        keep = keep & (imp_weight >= op.w_low)
    per_seq_n = torch.zeros(len(lens), dtype=torch.float64, device=logprobs.device)
    per_seq_n.index_add_(0, seq_of, mask.double())
    has_tokens = per_seq_n > 0

    def seq_geo_mean(log_values: Tensor) -> Tensor:
        total = torch.zeros(len(lens), dtype=torch.float64, device=logprobs.device)
        total.index_add_(0, seq_of, torch.where(mask, log_values, 0.0).double())
        return torch.exp(total / per_seq_n.clamp(min=1))

    seq_masked = torch.zeros_like(mask)
    if op.objective == "seq_mask":
        rho = seq_geo_mean(log_w)
        rejected = (rho < op.seq_low) | (rho > op.seq_high)
        seq_masked = mask & rejected[seq_of]
        keep = keep & ~seq_masked
    log_r = torch.where(mask, logprobs - behav, 0.0)
    tr_masked = torch.zeros_like(mask)
    if op.objective == "trust_region":
        r_now = torch.exp(log_r.detach())
        tr_masked = mask & (((adv > 0) & (r_now > 1.0 + op.behav_clip))
                            | ((adv < 0) & (r_now < 1.0 - op.behav_clip)))
        keep = keep & ~tr_masked
    weight = torch.where(keep, imp_weight, 0.0)
    loss = (pg * weight).sum() / n_tokens
    # exp() of a clamped log-ratio: a token the policy has moved far from stays finite. The k3
    # term goes on linearly above the clamp with the slope it has there (e^20 - 1 > 0), so its
    # gradient always pushes log π_θ back towards log π_behav.
    far = log_r > LOG_R_MAX
    r = torch.exp(log_r.clamp(max=LOG_R_MAX))
    k3 = torch.where(far, _K3_AT_MAX + _SLOPE_AT_MAX * (log_r - LOG_R_MAX), r - 1.0 - log_r)
    k3 = torch.where(mask, k3, 0.0)
    if op.kl_coef:
        loss = loss + op.kl_coef * k3.sum() / n_tokens

    with torch.no_grad():
        r, k3 = r.detach(), k3.detach()
        seq_r = seq_geo_mean(log_r)[has_tokens]
        # tokens that give the loss a gradient: kept with a non-zero advantage (every token, too,
        # with the KL penalty on); 0 in a whole minibatch: no optimizer step (`Actor`)
        signal = keep & (adv != 0)
        if op.kl_coef:
            signal = signal | mask
        stats = {
            "signal_tokens": signal.sum().double(),
            "clip_frac": ((pg_clipped > pg_unclipped) & mask).sum() / n_tokens,
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / n_tokens,
            "imp_weight_mean": weight.sum() / keep.count_nonzero().clamp(min=1),
            "dropped_frac": (mask & ~keep).sum() / n_tokens,
            "seq_masked_frac": seq_masked.sum() / n_tokens,
            "tr_masked_frac": tr_masked.sum() / n_tokens,
            "approx_kl": torch.where(mask, behav - logprobs.detach(), 0.0).sum() / n_tokens,
            "kl_behav": k3.sum() / n_tokens,
            "kl_prox_behav": torch.where(mask, imp_weight * log_w - imp_weight + 1.0, 0.0).sum()
            / n_tokens,
            "r_mean": torch.where(mask, r, 0.0).sum() / n_tokens,
            "r_sq_mean": torch.where(mask, r.square(), 0.0).sum() / n_tokens,
            "n_seqs": torch.tensor(float(seq_r.numel()), dtype=torch.float64),
            "seq_r_mean": seq_r.mean() if seq_r.numel() else torch.tensor(0.0, dtype=torch.float64),
            "seq_r_sq_mean": seq_r.square().mean() if seq_r.numel()
            else torch.tensor(0.0, dtype=torch.float64),
        }
    return loss, stats
