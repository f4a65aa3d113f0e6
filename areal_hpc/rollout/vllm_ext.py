"""Receiver half of the weight update, run inside vLLM's worker processes.

Passed to vLLM as `worker_extension_cls="areal_hpc.rollout.vllm_ext.WeightSyncExtension"`;
vLLM mixes these methods into its Worker, so `self` is the worker (`self.device`,
`self.rank`, `self.reload_weights`). They are reached from the engine process with
`collective_rpc("<method>", args=...)`, which runs them on every worker of the engine.

Weights go through `Worker.reload_weights(weights_iterator=...)`, vLLM's layerwise in-place
reload: it restores the checkpoint-format parameters, runs `model.load_weights` and then
`process_weights_after_loading` (repacking), keeping the kernel tensors' storage. Calling
`model.load_weights` directly fails after the first load (notes/vllm-on-cpu.md §3).
The caller must reset vLLM's prefix cache after every load (stale KV blocks otherwise).

This module must stay importable in a fresh spawned process: no MPI, no project globals.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from areal_hpc.transport.weights import (
    Bucket,
    bucket_dtype,
    bucket_numel,
    dtype_from_str,
    spec_numel,
)



class _DropRotaryReloadWarning(logging.Filter):
    """vLLM warns on every reload that RotaryEmbedding loaded nothing: its cos/sin cache is
    computed, never in a checkpoint, so the warning is noise at every weight update."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropRotaryReloadWarning())


class WeightSyncExtension:
    def init_weight_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, backend: str
    ) -> int:
        """Join the weight group; blocks until the trainer (rank 0) and all receivers join.

        `rank` is the weight-group rank of this engine's first worker; with vLLM TP/PP > 1 the
        engine's worker i joins as `rank + i`, so an engine spans ranks [rank, rank + tp*pp).
        Returns the rank this worker joined as.
        """
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        my_rank = rank + self.rank
        self._weight_group = stateless_init_torch_distributed_process_group(
            master_address, master_port, my_rank, world_size, backend
        )
        return my_rank

    def recv_weights(self, meta: Sequence[Bucket]) -> int:
        """Receive one flat broadcast per bucket from rank 0 and reload the model from them.

        `meta` is `plan_buckets(...)` as computed by the trainer. Returns the number of tensors.
        """
        group = self._weight_group
        device = self.device
        received = 0  # buckets taken off the wire
        count = 0  # tensors handed to vLLM

        def recv(bucket: Bucket) -> torch.Tensor:
            nonlocal received
            # A fresh buffer per bucket, never a reused one: the layerwise reload keeps
            # references to the yielded views until each layer is complete.
            flat = torch.empty(
                bucket_numel(bucket), dtype=dtype_from_str(bucket_dtype(bucket)), device=device
            )
            group.broadcast(flat, root=0).wait()
            received += 1
            return flat

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for bucket in meta:
                flat = recv(bucket)
                offset = 0
                for name, shape, _ in bucket:
                    n = spec_numel(shape)
                    count += 1
                    yield name, flat[offset : offset + n].view(tuple(shape))
                    offset += n

        try:
            self.reload_weights(weights_iterator=tensors())
        except BaseException:
            # Take the rest of the broadcast off the wire before raising, so that the trainer
            # and the other receivers finish the collective instead of hanging in it.
            for bucket in meta[received:]:
                recv(bucket)
            raise
        return count

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

        self.reload_weights(weights_iterator=tensors())
        return count
