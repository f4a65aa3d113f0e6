"""The policy as a Hugging Face directory, streamed: stage by stage, tensor by tensor, through host
memory in bounded chunks (the end of a run's `policy/`, tools/export_hf.py).

Collective over the trainer ranks. Each pipeline stage's data-parallel rank 0 runs the same
TP-gathering iterator as the weight update (`Actor.iter_hf_weights`: one Megatron parameter at a
time, gathered over the stage's TP group and split into its HF tensors); the stage's first TP rank
(the weight sender) moves each tensor to host memory into a bucket and writes the bucket as one
safetensors shard once it is full or the next tensor would push it past `chunk_bytes`. No rank
ever holds more than one chunk plus the tensors of one parameter, on the device or on the host,
whatever the model's size (a whole-model gather would need the model's full size, ~61 GiB in bf16 at 32B, on
the first stage that still holds its training state).

    <out>.partial/          written first: every stage's shards, then (trainer rank 0) the
                            shards renamed `model-0000i-of-0000n.safetensors` in stage order
                            (`model.safetensors` when there is one), the index
                            `model.safetensors.index.json` (its metadata names the step) and
                            the non-weight files of the initial model (config, tokenizer)
    <out>/                  the finished directory: `<out>.partial` renamed, so an export that
                            stopped part-way is never taken for a finished one (`is_complete`)

Every rank ends with the same outcome: the export done, or the same `ExportError`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..storage.checkpoint import write_atomic
from ..storage.run_dir import INDEX
from ..transport import mpi as coll
from .weight_publisher import join_gather

log = logging.getLogger(__name__)

# Files of a HF model directory that are weights (an export and Actor.save_hf write their own);
# all others (config.json, the tokenizer, ...) are copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
PARTIAL = ".partial"


class ExportError(RuntimeError):
    pass


@dataclass
class ExportStats:
    files: int = 0
    bytes: int = 0                  # every tensor written, all stages
    peak_bytes: int = 0             # the most any writer held at once: its bucket + the next tensor
    largest_tensor_bytes: int = 0
    chunk_bytes: int = 0
    seconds: float = 0.0

    def merge(self, other: "ExportStats") -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.peak_bytes = max(self.peak_bytes, other.peak_bytes)
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, other.largest_tensor_bytes)


class _Single:
    """The communicator of a single process (`coll` returns at once for a size of 1)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1


def _write_shard(path: Path, bucket: list) -> None:
    """One safetensors file; safetensors writes from the tensors' own memory (no host copy)."""
    from safetensors.torch import save_file
    save_file(dict(bucket), str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_stage_shards(tensors, tmp: Path, stage: int, chunk_bytes: int) -> tuple[list, ExportStats]:
    """Write the (HF name, tensor) pairs of one stage as shards of at most `chunk_bytes` (one
    tensor larger than that gets a shard of its own); returns [(file, [names], bytes)] and the
    stats. Reads `tensors` to its end even after a failed write: it is a collective over the TP
    group, and the stage's other TP ranks are still in it."""
    stats, files, error = ExportStats(chunk_bytes=chunk_bytes), [], None
    bucket, held = [], 0

    def flush():
        nonlocal bucket, held
        name = f"s{stage:03d}-{len(files):05d}.safetensors"
        _write_shard(tmp / name, bucket)
        files.append((name, [n for n, _ in bucket], held))
        stats.files += 1
        bucket, held = [], 0

    for name, tensor in tensors:
        if error is not None:
            continue
        try:
            nbytes = tensor.numel() * tensor.element_size()
            # held < chunk here (a full bucket is written at once): at most a chunk + one tensor
            stats.peak_bytes = max(stats.peak_bytes, held + nbytes)
            stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, nbytes)
            if bucket and held + nbytes > chunk_bytes:
                flush()
            bucket.append((name, tensor.detach().to("cpu").contiguous()))
            del tensor
            held += nbytes
            stats.bytes += nbytes
            if held >= chunk_bytes:
                flush()
        except Exception as exc:        # noqa: BLE001 - reported to every rank by `export`
            error = exc
    if error is None and bucket:
        try:
            flush()
        except Exception as exc:        # noqa: BLE001
            error = exc
    if error is not None:
        raise error
    return files, stats


def _prepare(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _finish(tmp: Path, out: Path, model_dir: str, stages: list[list], step: int | None) -> None:
    """Trainer rank 0, once every stage wrote its shards: names, index, config, then the rename."""
    shards = [f for files in stages for f in files]
    n = len(shards)
    weight_map, total = {}, 0
    for i, (name, names, nbytes) in enumerate(shards):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        weight_map.update((k, final) for k in names)
        total += nbytes
    for name in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, name)
        if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(src, tmp / name)
    index = {"metadata": {"total_size": total, "format": "pt", "step": step},
             "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(tmp / INDEX, json.dumps(index, indent=1))
    if out.exists():
        if any(out.iterdir()) and not (out / "config.json").is_file():
            raise ExportError(f"{out} exists and is not a model directory: not replacing it")
        old = out.with_name(out.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def export(actor, out_dir: str | os.PathLike, *, chunk_bytes: int, step: int | None = None,
           comm=None, timeout_s: float | None = None) -> ExportStats:
    """Write `actor`'s weights as a HF directory at `out_dir` (collective over the trainer ranks
    of `comm`, the MPI trainer communicator; None for a single process).

    Each stage's weight sender writes its stage's shards (at most `chunk_bytes` held at once,
    plus one parameter's tensors); its TP peers join the gather; other data-parallel replicas
    only wait. Returns the stats (all stages') on every rank; raises the same `ExportError` on
    every rank when any of them failed."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    comm = comm if comm is not None else _Single()
    root = comm.Get_rank() == 0
    out = Path(out_dir)
    tmp = out.with_name(out.name + PARTIAL)
    t0 = time.monotonic()
    what = f"HF export to {out}"
    problem = None
    if root:
        try:
            _prepare(tmp)
        except OSError as exc:
            problem = f"cannot create {tmp}: {exc}"
    problem = coll.bcast(comm, problem, root=0, timeout_s=timeout_s, what=f"{what}: its folder")
    if problem:
        raise ExportError(problem)

    mine = None
    try:
        stage = actor.weight_stage
        if actor.is_weight_sender:
            files, stats = write_stage_shards(actor.iter_hf_weights(), tmp, stage, chunk_bytes)
            mine = ("ok", stage, files, stats)
        elif stage is not None:         # a TP peer: take part in each parameter's gather,
            join_gather(actor.iter_hf_weights(), chunk_bytes)     # at most a chunk ahead
    except Exception as exc:            # noqa: BLE001 - every rank raises it below
        log.error("%s failed on this rank: %s: %s", what, type(exc).__name__, exc)
        mine = ("error", f"trainer rank {comm.Get_rank()}: {type(exc).__name__}: {exc}")
    got = coll.gather(comm, mine, root=0, timeout_s=timeout_s, what=f"{what}: each stage's shards")

    outcome = None
    if root:
        errors = [g[1] for g in got if g is not None and g[0] == "error"]
        written = {g[1]: (g[2], g[3]) for g in got if g is not None and g[0] == "ok"}
        stats = ExportStats(chunk_bytes=chunk_bytes)
        if not errors:
            try:
                for s in sorted(written):
                    stats.merge(written[s][1])
                _finish(tmp, out, actor.model_dir, [written[s][0] for s in sorted(written)], step)
            except Exception as exc:    # noqa: BLE001
                errors.append(f"trainer rank 0: {type(exc).__name__}: {exc}")
        stats.seconds = time.monotonic() - t0
        outcome = ("; ".join(errors) if errors else None, stats)
    message, stats = coll.bcast(comm, outcome, root=0, timeout_s=timeout_s, what=f"{what}: outcome")
    if message:
        raise ExportError(f"{what} failed ({tmp} is left incomplete): {message}")
    if root:
        log.info("exported %s (step %s): %d file(s), %.1f MiB in %.1f s; the most a writer held "
                 "at once: %.1f MiB (chunk %.1f MiB)", out, step, stats.files, stats.bytes / 2**20,
                 stats.seconds, stats.peak_bytes / 2**20, chunk_bytes / 2**20)
    return stats
