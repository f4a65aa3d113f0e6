#!/usr/bin/env python
"""Export the policy of a run's checkpoint as a Hugging Face directory (transformers and vLLM load it).

    python tools/export_hf.py runs/tiny --out exported/          # newest valid checkpoint
    python tools/export_hf.py runs/tiny/checkpoints/step_00000020 --out exported/

The checkpoint's own config gives the architecture and the tokenizer (its `model.path`); the
shards are loaded into a single-process Megatron model (dist-checkpointing reshards any TP x PP
layout) and written with the same HF names the generators receive.
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
    args = ap.parse_args(argv)

    from areal_hpc.config import ConfigError, load
    from areal_hpc.storage import checkpoint as ck
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    try:
        if ck.step_of(args.path) is not None:
            ckpt, _ = args.path, ck.validate(args.path)
        else:
            found = ck.find_latest(args.path)
            if found is None:
                print(f"error: no valid checkpoint in {args.path}", file=sys.stderr)
                return 2
            ckpt = found[0]
    except ck.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state = ck.read_state(ckpt / ck.STATE)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(state["config_yaml"])
        f.flush()
        try:
            cfg = load(f.name)
        except ConfigError as exc:
            print(f"error: {ckpt}: its config does not load: {exc}", file=sys.stderr)
            return 2
    if not (Path(cfg.model.path) / "config.json").is_file():
        print(f"error: the run's initial model {cfg.model.path} (architecture and tokenizer) is "
              f"not there", file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist
    from areal_hpc.topology import free_port
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.megatron_model import init_megatron_parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    init_megatron_parallel(tp=1, pp=1, seed=0, backend="gloo")
    actor = Actor(cfg.train, cfg.model.path, group_size=cfg.rollout.group_size,
                  temperature=cfg.rollout.temperature, dtype=cfg.model.dtype)
    ck.load_model(ckpt, actor.model)
    actor.save_hf(str(args.out))
    dist.destroy_process_group()
    print(f"exported step {state['step']} of {ckpt} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
