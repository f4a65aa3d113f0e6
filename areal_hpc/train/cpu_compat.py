"""Run megatron-core 0.16+ on CPU (gloo) by shimming the few `torch.cuda.*` calls it makes.

Megatron assumes a GPU in a handful of places: scratch buffers and DDP buffers are allocated on
`torch.cuda.current_device()`, the RNG tracker saves and restores CUDA generator states, and the
optimizer stack and pipeline schedules create tensors with `device="cuda"` or assert
`grad.type() == "torch.cuda.FloatTensor"`. The patches below are each commented with what they
unblock (verified on megatron-core 0.16.1 with gloo).

Two pieces:
- `apply()`: process-wide monkeypatches of `torch.cuda` and Megatron's RNG helpers. Idempotent.
- `CudaToCpuMode`: a `TorchFunctionMode` that rewrites `device="cuda"` to CPU, makes
  `Tensor.cuda()` the identity and makes `Tensor.type()` report `torch.cuda.*`. It is a context
  manager, entered only around Megatron's optimizer step and pipeline schedules.

Both are no-ops when `torch.cuda.is_available()`: on a GPU node nothing is patched.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def needed() -> bool:
    """True when Megatron has no GPU to run on (CPU wheel, or a CUDA wheel without a driver)."""
    return not torch.cuda.is_available()


class _DummyStream:
    """Enough of `torch.cuda.Stream` for Megatron's DDP grad-sync bookkeeping."""

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        pass


def apply() -> None:
    """Patch `torch.cuda` and Megatron's CUDA RNG helpers for CPU; a no-op with a GPU."""
    global _applied
    if _applied or not needed():
        return
    _applied = True

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _DummyStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _DummyStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None

    # The RNG tracker stores one generator state per name and swaps them around dropout and
    # init. On CPU the CPU generator plays the CUDA generator's part. Without this,
    # `_set_cuda_rng_state` on a CPU build silently queues the call and never runs it.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Redirect Megatron's explicit CUDA tensor creation to CPU while active.

    Used as `with CudaToCpuMode(): optimizer.step()` and around `forward_backward_func(...)`.
    With a GPU present, entering it does nothing (no mode is pushed, no per-op overhead).
    """

    def __enter__(self):
        self._pushed = needed()
        return super().__enter__() if self._pushed else self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self._pushed:
            return super().__exit__(exc_type, exc_val, exc_tb)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        # `grad.type() == "torch.cuda.FloatTensor"` asserts in clip_grads and the optimizers.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if isinstance(result, str) and not result.startswith("torch.cuda."):
                result = result.replace("torch.", "torch.cuda.", 1)
        return result
