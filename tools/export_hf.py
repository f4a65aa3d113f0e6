#!/usr/bin/env python
"""Export the policy of a run's checkpoint as a Hugging Face directory (transformers and vLLM load it).

    python tools/export_hf.py runs/tiny --out exported/          # newest valid checkpoint
    python tools/export_hf.py runs/tiny/checkpoints/step_00000020 --out exported/
    python tools/export_hf.py runs/tiny --step 20 --out exported/
    python tools/export_hf.py runs/tiny --step 0 --out exported/  # the initial policy

The checkpoint's own config gives the architecture and the tokenizer (its `model.path`); the
shards are loaded into a single-process Megatron model (dist-checkpointing reshards any TP x PP
layout) and written with the same HF names the generators receive. Step 0, the policy the run
started from, has no checkpoint: it is the run's `model.path` (from the run's config.yaml), put
through the same model and writer, so every step exports alike. The weights are written as they
are gathered, in shards of at most --chunk-mb (train/hf_export.py), into `<out>.partial`, renamed
to --out when complete.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a run directory or one checkpoint folder")
    ap.add_argument("--out", type=Path, required=True, help="HF directory to write")
    ap.add_argument("--step", type=int, default=None,
                    help="the checkpoint of this step in the run directory (0: the initial policy)")
    ap.add_argument("--chunk-mb", type=int, default=None,
                    help="shard size, the most of the model held at once beyond its parameters "
                         "(default: the run's checkpoint.export_chunk_mb)")
    args = ap.parse_args(argv)

    from areal_hpc.config import ConfigError, load
    from areal_hpc.storage import checkpoint as ck
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    ckpt, step = None, args.step
    try:
        if step is not None and step < 0:
            print(f"error: --step must be >= 0, got {step}", file=sys.stderr)
            return 2
        if step == 0:
            config_yaml = args.path / "config.yaml"
            if not config_yaml.is_file():
                print(f"error: {args.path}: no config.yaml (the run's settings, written when it "
                      "starts): give the run directory", file=sys.stderr)
                return 2
            config_yaml, source = config_yaml.read_text(), f"{args.path} (its initial model)"
        else:
            if step is not None:
                ckpt, _ = ck.step_dir(args.path, step), ck.validate(ck.step_dir(args.path, step))
            elif ck.step_of(args.path) is not None:
                ckpt, _ = args.path, ck.validate(args.path)
            else:
                found = ck.find_latest(args.path)
                if found is None:
                    print(f"error: no valid checkpoint in {args.path} (--step 0 exports the "
                          "initial policy)", file=sys.stderr)
                    return 2
                ckpt = found[0]
            state = ck.read_state(ckpt / ck.STATE)
            config_yaml, step, source = state["config_yaml"], state["step"], str(ckpt)
    except ck.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(config_yaml)
        f.flush()
        try:
            cfg = load(f.name)
        except ConfigError as exc:
            print(f"error: {source}: its config does not load: {exc}", file=sys.stderr)
            return 2
    if not (Path(cfg.model.path) / "config.json").is_file():
        print(f"error: the run's initial model {cfg.model.path} (architecture and tokenizer) is "
              f"not there", file=sys.stderr)
        return 2

    import torch.distributed as dist
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.checkpoint import load_model
    from areal_hpc.train.hf_export import ExportError, export
    from areal_hpc.train.megatron_model import single_process
    single_process()
    actor = Actor(cfg.train, cfg.model.path, group_size=cfg.rollout.group_size,
                  temperature=cfg.rollout.temperature, dtype=cfg.model.dtype)
    if ckpt is not None:
        load_model(ckpt, actor.model)
    chunk_mb = args.chunk_mb or cfg.checkpoint.export_chunk_mb
    try:
        stats = export(actor, args.out, chunk_bytes=chunk_mb << 20, step=step)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    print(f"exported step {step} of {source} to {args.out}: {stats.files} file(s), "
          f"{stats.bytes / 2**20:.1f} MiB; at most {stats.peak_bytes / 2**20:.1f} MiB held at once "
          f"(chunk {chunk_mb} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
