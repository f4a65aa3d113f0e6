"""The disk transport: a version's buckets as safetensors files that generators load."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from .plan import Plan


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def write_stage(
    root: str | os.PathLike, version: int, plan: Plan, stage: int, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Path:
    """Write stage `stage`'s buckets of `plan` as safetensors files under `version_dir`.

    One file per bucket (`s{stage:03d}-b{index:05d}.safetensors`), each written under a
    temporary name and renamed, so a reader never sees a partial file and a writer holds at
    most one bucket. The caller publishes the directory only after every stage returned.
    """
    from safetensors.torch import save_file

    out = version_dir(root, version)
    out.mkdir(parents=True, exist_ok=True)
    source = iter(tensors)
    held: dict[str, torch.Tensor] = {}
    for index, (owner, bucket) in enumerate(plan):
        if owner != stage:
            continue
        chunk = {}
        for name, _, _ in bucket:
            while name not in held:
                got, tensor = next(source)
                held[got] = tensor
            chunk[name] = held.pop(name).detach().to("cpu").contiguous()
        path = out / f"s{stage:03d}-b{index:05d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(chunk, str(tmp), metadata={"format": "pt", "version": str(version)})
        os.replace(tmp, path)
    for _ in source:
        pass
    return out


def prune_versions(root: str | os.PathLike, keep: int) -> None:
    """Delete every version directory under `root` except `keep` (the one generators run)."""
    keep_dir = version_dir(root, keep)
    for d in Path(root).glob("v*"):
        if d.is_dir() and d != keep_dir:
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ handshake
