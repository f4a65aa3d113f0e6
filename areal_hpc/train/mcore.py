"""Megatron-core imported with its fused functions' `torch.compile` deferred to their first call.

Megatron decorates its fused element-wise functions (bias + GeLU/SwiGLU, rotary, cross-entropy
pieces) with `torch.compile` when their modules are imported (megatron/core/jit.py's
`jit_fuser`), and each decoration imports TorchInductor: ~1.5 s of CPU on every trainer rank at
every start, for functions a run may never call (this project's CPU runs call none). While the
modules below are imported, `torch.compile` returns a wrapper that compiles the function on its
first call with the same options and calls the compiled function from then on: what
`torch.compile` does itself (it compiles on the first call), so nothing changes on a GPU.
`jit_fuser` keeps the deferring `compile` it took at import, so modules Megatron imports later
defer too. Every module of this project that imports Megatron imports this one first.
"""
from __future__ import annotations

import functools

import torch


def deferred(real):
    """`torch.compile` (`real`) with the compilation moved to the first call."""
    def compile(model=None, **options):
        if model is None:               # @torch.compile(...) with options
            return lambda fn: compile(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)
        return call
    return compile


_real = torch.compile
torch.compile = deferred(_real)
try:
    import megatron.core  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.transformer.transformer_block  # noqa: F401
finally:
    torch.compile = _real
