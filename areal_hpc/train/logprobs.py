"""Token log-probs from the last hidden states, in chunks: no `[tokens, vocab]` tensor exists.

`log π(a_t | s_t) = (h_t · w_{a_t}) / T - logsumexp_v((h_t · w_v) / T)` with `w` this TP rank's
vocabulary slice of the output layer. The forward pass computes, chunk by chunk of tokens,
the logits `[chunk, V/tp]` in the parameter dtype, their float32 log-sum-exp (max and sum
all-reduced over the TP group) and the target's logit, and keeps only the inputs and one
float32 per token. The backward pass recomputes each chunk's logits and softmax and accumulates
`dh = (onehot - p) g / T · w` and `dw = ((onehot - p) g / T)ᵀ · h` (float32, one `[V/tp, H]`
buffer). Peak extra memory is about `chunk × V/tp × (4 + 2)` bytes (the float32 logits, reused
in place for the softmax and its gradient, and one copy in the parameter dtype) plus that
buffer, whatever the number of tokens. The gradient with respect to `h` is this rank's
partial sum over its vocabulary slice; the caller's TP region (Megatron's
`copy_to_tensor_model_parallel_region` / sequence-parallel gather) all-reduces it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, vocab_start: int,
                group):
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        picked = torch.empty(n, dtype=torch.float32, device=hidden.device)
        tp = dist.get_world_size(group) if group is not None else 1
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits = (hidden[s:e] @ weight.t()).float().div_(temperature)  # [c, V/tp]
            local = targets[s:e] - vocab_start
            inside = (local >= 0) & (local < vocab_local)
            tgt = logits.gather(1, local.clamp(0, vocab_local - 1)[:, None])[:, 0] * inside
            m = logits.max(dim=1).values
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sumexp = (logits.sub_(m[:, None])).exp_().sum(dim=1)
            if tp > 1:
                both = torch.stack([sumexp, tgt])
                dist.all_reduce(both, group=group)
                sumexp, tgt = both[0], both[1]
            lse[s:e] = sumexp.log() + m
            picked[s:e] = tgt
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.vocab_start = temperature, chunk, vocab_start
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        t, chunk, vocab_start = ctx.temperature, ctx.chunk, ctx.vocab_start
        vocab_local = weight.shape[0]
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        g_all = grad_out.float() / t
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            logits = (hidden[s:e] @ weight.t()).float().div_(t)
            # d logprob / d logit_v = onehot_v - p_v ; times g / T for the temperature
            grad = logits.sub_(lse[s:e, None]).exp_().neg_()
            local = targets[s:e] - vocab_start
            inside = (local >= 0) & (local < vocab_local)
            rows = torch.nonzero(inside)[:, 0]
            grad[rows, local[rows]] += 1.0
            grad.mul_(g_all[s:e, None])  # float32 [c, V/tp], in the logits' buffer
            if grad_w is not None:  # accumulated in float32 over the chunks
                grad_w.addmm_(grad.t(), hidden[s:e].float())
            if grad_h is not None:
                grad_h[s:e] = grad.to(weight.dtype) @ weight
            del logits, grad
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int = 2048, vocab_start: int = 0,
                           group=None) -> torch.Tensor:
    """`[N]` float32 log-probs of `targets` `[N]` (global token ids) under
    `softmax(hidden @ weightᵀ / temperature)`, where `hidden` is `[N, H]` and `weight` is this
    rank's `[V/tp, H]` vocabulary slice starting at `vocab_start`; `group` the TP group (None or
    size 1: the whole vocabulary is here). Differentiable in `hidden` and `weight`."""
    if hidden.shape[0] == 0:
        return hidden[:, 0].float() * 0.0  # keeps the (empty) graph to the hidden states
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk),
                                  int(vocab_start), group)
