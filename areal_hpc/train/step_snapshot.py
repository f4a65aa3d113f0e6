"""A training step's starting state on one trainer rank, kept in host memory, so that a step
stopped midway (checkpoint.mid_step_stop; `Actor.train_share`) is undone bit-exactly. `take`
and `restore` are given the `Actor` (train/actor.py)."""
from __future__ import annotations

import copy

import torch


def _attrs(obj) -> dict:
    """The plain attributes of `obj` (numbers, strings, tensors cloned): the mutable state of an
    LR scheduler or a grad scaler."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(obj).items()
            if torch.is_tensor(v) or isinstance(v, (int, float, str, bool, type(None)))}


class StepSnapshot:
    """What a training step changes on this rank, kept in host memory at the step's start so that
    a step stopped midway (checkpoint.mid_step_stop) is undone bit-exactly: the model's
    parameters (this rank's TP/PP shard), the optimizer's main parameters where they are not the
    model's (fp32 copies of half-precision weights, the distributed optimizer's shards) and its
    state (Adam moments, step counters, param-group values), the grad scaler, the LR scheduler,
    and the torch RNG states (the step draws no random numbers: dropout is off; kept anyway).

    One code path on CPU and GPU: each tensor is copied into a host buffer allocated at the first
    snapshot and reused at every step; on GPU the buffers are pinned (a D2H copy at PCIe speed,
    ~1 s for a 32B rank's shard) and restoring copies back (H2D). The host memory it holds is the
    rank's model shard plus its optimizer shard (for bf16 Adam: 2 + 12 bytes per parameter of
    the shard)."""

    def __init__(self):
        self._host: dict[tuple, torch.Tensor] = {}      # reused from step to step
        self._live: list[tuple[tuple, torch.Tensor]] = []

    def _keep(self, key: tuple, t: torch.Tensor) -> None:
        buf = self._host.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._host[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                                pin_memory=t.is_cuda)
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        self._live.append((key, t))

    @staticmethod
    def _optimizers(actor) -> list:
        opt = actor.optimizer
        return list(getattr(opt, "chained_optimizers", None) or [opt])

    def take(self, actor) -> StepSnapshot:
        self._live = []
        params = [p for p in actor.model.parameters()]
        for i, p in enumerate(params):
            self._keep(("model", i), p.data)
        # storage that a model parameter's copy already restores (the fp32 optimizer's params
        # are the model's; the distributed optimizer's fp32 shards are views into them)
        model_storage = {p.data.untyped_storage().data_ptr() for p in params}
        self._groups, self._state_keys, self._scalers = [], [], []
        for j, opt in enumerate(self._optimizers(actor)):
            inner = opt.optimizer
            keys = {}
            for gi, group in enumerate(inner.param_groups):
                self._groups.append((group, copy.deepcopy(
                    {k: v for k, v in group.items() if k != "params"})))
                for pi, p in enumerate(group["params"]):
                    if p.data.untyped_storage().data_ptr() not in model_storage:
                        self._keep(("main", j, gi, pi), p.data)
                    state = inner.state[p] if p in inner.state else None
                    keys[p] = None if state is None else {}
                    for k, v in (state or {}).items():
                        if torch.is_tensor(v):
                            self._keep(("state", j, gi, pi, k), v)
                            keys[p][k] = v
                        else:
                            keys[p][k] = copy.deepcopy(v)
            self._state_keys.append((inner, keys))
            scaler = getattr(opt, "grad_scaler", None)
            if scaler is not None:
                self._scalers.append((scaler, _attrs(scaler)))
        self._scheduler = _attrs(actor.lr_scheduler)
        self._rng = (torch.get_rng_state(),
                     torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
        if actor.device.type == "cuda":
            torch.cuda.synchronize()            # the D2H copies are complete
        return self

    def restore(self, actor) -> None:
        """Put everything `take` kept back (the same tensors, in place)."""
        for key, t in self._live:
            t.copy_(self._host[key], non_blocking=t.is_cuda)
        for inner, keys in self._state_keys:
            for p, saved in keys.items():
                if saved is None:               # no state yet at the step's start (lazy init)
                    inner.state.pop(p, None)
                else:
                    inner.state[p] = {k: (v if torch.is_tensor(v) else copy.deepcopy(v))
                                      for k, v in saved.items()}
        for group, saved in self._groups:
            group.update(copy.deepcopy(saved))
        for scaler, saved in self._scalers:
            for k, v in saved.items():
                setattr(scaler, k, v.clone() if torch.is_tensor(v) else v)
        for k, v in self._scheduler.items():
            setattr(actor.lr_scheduler, k, v)
        torch.set_rng_state(self._rng[0])
        if self._rng[1] is not None:
            torch.cuda.set_rng_state_all(self._rng[1])
        actor.model.zero_grad_buffer()          # the stopped minibatch's gradients
        actor.optimizer.zero_grad()
        if actor.device.type == "cuda":
            torch.cuda.synchronize()
