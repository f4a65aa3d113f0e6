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

import collections
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
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float | None = None,
        join_timeout_s: float | None = None,
    ) -> int:
        """Join the weight group; blocks until the trainer's stage senders and all receivers join.

        `rank` is the weight-group rank of this engine's first worker; with vLLM TP/PP > 1 the
        engine's worker i joins as `rank + i`, so an engine spans ranks [rank, rank + tp*pp).
        `join_timeout_s` bounds the join, `timeout_s` every later receive. Returns the rank this
        worker joined as.
        """
        from areal_hpc.transport.weights import init_weight_group

        my_rank = rank + self.rank
        self._weight_group = init_weight_group(
            master_address, master_port, my_rank, world_size, backend, timeout_s, join_timeout_s
        )
        return my_rank

    def recv_weights(self, plan: Sequence[tuple[int, Bucket]]) -> int:
        """Receive one flat broadcast per bucket of `plan` from its root; reload the model.

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

        def wait() -> torch.Tensor:
            flat, work = posted.popleft()
            try:
                work.wait()
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

        try:
            self.reload_weights(weights_iterator=tensors())
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
        self._weight_group.broadcast(flat, root=root).wait()
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

        self.reload_weights(weights_iterator=tensors())
        return count
