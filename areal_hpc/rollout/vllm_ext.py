"""Receiver half of the weight update, run inside vLLM's worker processes.

Passed to vLLM as `worker_extension_cls="areal_hpc.rollout.vllm_ext.WeightSyncExtension"`;
vLLM mixes these methods into its Worker, so `self` is the worker (`self.device`,
`self.rank`, `self.reload_weights`). They are reached from the engine process with
`collective_rpc("<method>", args=...)`, which runs them on every worker of the engine.

Weights go through `Worker.reload_weights(weights_iterator=...)`, vLLM's layerwise in-place
reload: it restores the checkpoint-format parameters, runs `model.load_weights` and then
`process_weights_after_loading` (repacking), keeping the kernel tensors' storage. Calling
`model.load_weights` directly fails after the first load (docs/cpu_notes.md#vllm-weight-reload).
The caller must reset vLLM's prefix cache after every load (stale KV blocks otherwise).

Tied embeddings (`tie_word_embeddings`, Qwen2.5-0.5B/1.5B): HF checkpoints and the trainer's
tensors have no `lm_head.weight`; vLLM's head holds the embedding's parameter, and its weight
loader skips the alias. Sharing the storage is not enough on a reload: the layerwise reload
reprocesses only the layers it loaded, and on CPU the head's GEMM (a oneDNN handler made in
`process_weights_after_loading`) holds its own packed copy of the weight, so the head kept
computing logits with the embedding of the first load (vLLM warned "ParallelLMHead: Failed to
load weights" at every update). After each reload the tied head is therefore processed again
from the new embedding (`_reload`), and that warning, expected for it, is dropped.

This module must stay importable in a fresh spawned process: no MPI, no project globals.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from areal_hpc.transport.weights import (
    Bucket,
    WeightGroupAddress,
    bucket_dtype,
    bucket_numel,
    close_weight_group,
    dtype_from_str,
    finish,
    init_weight_group,
    spec_numel,
)



class _DropExpectedReloadWarnings(logging.Filter):
    """vLLM warns on every reload about each layer that loaded nothing. Expected, so noise at
    every weight update: RotaryEmbedding (its cos/sin cache is computed, never in a checkpoint)
    and a tied LM head (`_reload` reprocesses it); `layers` holds their class names."""

    SUFFIX = ": Failed to load weights"

    def __init__(self) -> None:
        super().__init__()
        self.layers = {"RotaryEmbedding"}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith(self.SUFFIX) and message.removesuffix(self.SUFFIX) in self.layers)


_EXPECTED_RELOAD_WARNINGS = _DropExpectedReloadWarnings()
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_EXPECTED_RELOAD_WARNINGS)


def tied_weights(model: torch.nn.Module) -> dict[str, list[str]]:
    """`{name: [tied names]}`: for each parameter of `model` that several modules hold (a tied
    LM head holds the input embedding's), the name under its first module and the names under
    the others, e.g. {"model.embed_tokens.weight": ["lm_head.weight"]}. Module names are the
    checkpoint names for the models this project serves (Qwen2: no name mapping)."""
    first: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in first:
                tied.setdefault(first[id(param)], []).append(name)
            else:
                first[id(param)] = name
    return tied


def _tied_layers(worker) -> list[torch.nn.Module]:
    """The layers of `worker`'s model that hold another layer's weight (a tied LM head) and
    must be processed again after a reload: those of unquantized embedding layers, whose
    processing is only the CPU GEMM packing and can be repeated. Found once, before the first
    reload (while a reload runs, vLLM swaps every layer's parameters for placeholders). A worker
    without a model runner (the tests' stand-ins) has none."""
    layers = getattr(worker, "_tied_layers", None)
    if layers is None:
        layers = []
        runner = getattr(worker, "model_runner", None)
        if runner is not None:
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

            model = runner.get_model()
            for aliases in tied_weights(model).values():
                for alias in aliases:
                    layer = model.get_submodule(alias.rpartition(".")[0])
                    if isinstance(getattr(layer, "quant_method", None), UnquantizedEmbeddingMethod):
                        layers.append(layer)
                        _EXPECTED_RELOAD_WARNINGS.layers.add(type(layer).__name__)
        worker._tied_layers = layers
    return layers


def _reload(worker, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """`worker.reload_weights(weights_iterator=tensors)`, then the tied layers' processing
    again, from the weights just loaded into the storage they share (module doc). A reload
    that raises part-way (a broadcast that timed out, a shard that would not open) is undone
    where it can be (`abandon_reload`) before the error goes on."""
    tied = _tied_layers(worker)
    try:
        worker.reload_weights(weights_iterator=tensors)
    except BaseException:
        runner = getattr(worker, "model_runner", None)
        if runner is not None:
            logging.getLogger(__name__).warning(
                "weight reload failed part-way: %d layer(s) that had not received all their "
                "weights put back; the model is not used until a load succeeds",
                abandon_reload(runner.get_model()))
        raise
    if tied:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(worker.vllm_config):
            for layer in tied:
                layer.quant_method.process_weights_after_loading(layer)


def abandon_reload(model: torch.nn.Module) -> int:
    """Undo what a layerwise reload that raised part-way left behind, so that the next reload
    starts clean. vLLM's reload first swaps every layer's tensors for placeholders on the meta
    device and wraps its weight loaders; a layer is put back only once all its weights came.
    The layers still waiting keep the placeholders (a forward pass through one fails: on CPU
    "_C::onednn_mm ... Meta tensors", and vLLM's engine dies), their wrapped loaders and the
    weights they buffered, which the next reload would count again (a layer then processed
    before its last weight came). Each such layer gets its own tensors back (the placeholders
    and their wrapped loaders dropped) and its state cleared. The model then holds the new
    version in the layers that were completed and the old one elsewhere: nothing may be
    generated with it until a load succeeds (`VLLMEngine` holds its requests). Returns the
    layers put back. Reads vLLM 0.32's reload state (its `reload.layerwise` module)."""
    from vllm.model_executor.model_loader.reload import layerwise

    restored = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            continue
        layerwise._place_kernel_tensors(layer, info)   # the placeholders, wrapped, dropped
        info.reset()
        restored += 1
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored


def reported(worker, method: str, *args):
    """`worker.<method>(*args)` for `VLLMEngine`'s RPCs, a failure returned as a value
    ({"areal_worker_error": text}) instead of raised. vLLM's multiprocess executor stops reading
    the workers' replies at the first failed one, so with TP > 1 the other workers' replies to
    a failed call stay queued and are taken as the replies to the next call (a weight group
    joined, but reported failed). A recovered failure (a broadcast a dead peer broke) must
    leave the engine usable: every worker replies, and the engine raises for them."""
    try:
        return getattr(worker, method)(*args)
    except Exception as exc:        # noqa: BLE001 - returned to the engine, which raises it
        return {"areal_worker_error": f"worker {getattr(worker, 'rank', '?')}: "
                                      f"{type(exc).__name__}: {exc}"}


class WeightSyncExtension:
    def reported(self, method: str, *args):
        """`reported(self, method, *args)`: how `VLLMEngine` calls the methods below (by name,
        as vLLM's RPC takes a method without pickling code)."""
        return reported(self, method, *args)

    def init_weight_group(self, address: WeightGroupAddress | dict, rank: int) -> int:
        """Join the weight group; blocks until the trainer's stage senders and all receivers join.

        `rank` is the weight-group rank of this engine's first worker; with vLLM TP/PP > 1 the
        engine's worker i joins as `rank + i`, so an engine spans ranks [rank, rank + tp*pp).
        The address's `join_timeout_s` bounds the join, its `timeout_s` every later receive.
        With batch invariance on (`deterministic: true` on CUDA) this worker has pinned NCCL
        settings for its own communicators; the weight group, shared with the trainer, is made
        without them (`areal_hpc.transport.weights.broadcast.unpinned_nccl_env`).
        Called again with a later `address.generation` (the group re-formed after a member's
        failure), the group this worker was in is torn down first.
        Returns the rank this worker joined as.
        """
        if isinstance(address, dict):   # through vLLM's RPC (msgspec sends a dataclass as a dict)
            address = WeightGroupAddress(**address)
        my_rank = rank + self.rank
        close_weight_group(getattr(self, "_weight_group", None))
        self._weight_group = None
        self._weight_group = init_weight_group(address, my_rank)
        self._weight_timeout_s = address.timeout_s     # each bucket's bound on the host (`finish`)
        return my_rank

    @property
    def weight_group(self):
        """This worker's weight group (after `init_weight_group`): for a function a tool runs in
        the worker through `VLLMEngine.collective_rpc`."""
        return self._weight_group

    def recv_weights(self, plan: Sequence[tuple[int, Bucket]], load: bool = True) -> int:
        """Receive one flat broadcast per bucket of `plan` from its root; reload the model.

        `load=False`: receive every bucket and drop it (this engine already runs the version
        sent, which went out again for a member that rejoined the group): the model is not
        touched.

        `plan` is `plan_stages(...)` as computed by the trainer: [(root, bucket), ...]. Every
        worker receives every full tensor; vLLM's weight loaders cut out this worker's TP shard.
        The receive of bucket k+1 is posted before bucket k's tensors go to vLLM, so loading
        overlaps the wire (this matches `broadcast_stage`, which keeps two buckets in flight).
        Returns the number of tensors.
        """
        group = self._weight_group
        device = self.device
        posted: collections.deque = collections.deque()  # (flat, Work) of receives not yet waited
        next_post = 0  # index in `plan` of the next bucket to post
        count = 0  # tensors handed to vLLM
        wire_error: list[BaseException] = []

        def post() -> None:
            nonlocal next_post
            root, bucket = plan[next_post]
            # A fresh buffer per bucket, never a reused one: the layerwise reload keeps
            # references to the yielded views until each layer is complete.
            flat = torch.empty(
                bucket_numel(bucket), dtype=dtype_from_str(bucket_dtype(bucket)), device=device
            )
            try:
                posted.append((flat, group.broadcast(flat, root=root)))
            except BaseException as exc:
                wire_error.append(exc)
                raise
            next_post += 1

        timeout_s = getattr(self, "_weight_timeout_s", None)

        def wait() -> torch.Tensor:
            # On the host, within the group's bound: on NCCL a bucket not yet complete would
            # otherwise go to vLLM's loader, and a dead peer hold the device (`finish`).
            k = next_post - len(posted)
            flat, work = posted.popleft()
            try:
                finish(work, timeout_s, group, f"weight bucket {k} of {len(plan)}")
            except BaseException as exc:
                wire_error.append(exc)
                raise
            return flat

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for _, bucket in plan:
                while next_post < len(plan) and len(posted) < 2:
                    post()
                flat = wait()
                offset = 0
                for name, shape, _ in bucket:
                    n = spec_numel(shape)
                    count += 1
                    yield name, flat[offset : offset + n].view(tuple(shape))
                    offset += n

        def drain() -> None:
            """Take what is left of the broadcast off the wire, so that the senders and the
            other receivers finish the collective instead of waiting out their timeout."""
            while posted or next_post < len(plan):
                if not posted:
                    post()
                wait()

        if not load:
            drain()
            return 0
        try:
            _reload(self, tensors())
        except BaseException:
            # A local failure (unknown name, bad shape): drain before raising. A failure of the
            # wire itself (timeout, peer gone) is raised at once: draining would only wait out
            # the timeout again per bucket.
            if not wire_error:
                drain()
            raise
        if posted or next_post < len(plan):  # vLLM returned without reading every tensor
            drain()
            raise RuntimeError(f"vLLM's reload read {count} tensors and stopped before the end of the plan")
        return count

    def recv_flat(self, numel: int, dtype_str: str, root: int = 0) -> int:
        """Receive one raw broadcast of `numel` elements and drop it: the baseline that
        tools/bench_weights.py sets the weight update against (same bytes, one buffer, no load)."""
        flat = torch.empty(numel, dtype=dtype_from_str(dtype_str), device=self.device)
        finish(self._weight_group.broadcast(flat, root=root), getattr(self, "_weight_timeout_s", None),
               self._weight_group, "a raw broadcast")
        return numel

    def load_weights_from_file(self, path: str) -> int:
        """Reload from safetensors: one file, or a directory of `*.safetensors` shards (HF export).

        Tensors are read lazily, one at a time (memory-mapped on the host); vLLM's weight
        loaders copy (and shard, for TP) them onto the worker's device. Returns the tensor count.
        """
        from safetensors import safe_open

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        count = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for name in st.keys():
                        count += 1
                        yield name, st.get_tensor(name)

        _reload(self, tensors())
        return count
