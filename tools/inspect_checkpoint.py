#!/usr/bin/env python
"""What a checkpoint holds: validity (manifest, sizes, CRC-32), step, files, the run state.

    python tools/inspect_checkpoint.py runs/tiny                       # every checkpoint of a run
    python tools/inspect_checkpoint.py runs/tiny/checkpoints/step_00000010 [--no-crc]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_hpc.storage import checkpoint as ck  # noqa: E402


def describe(path: Path, check_crc: bool) -> bool:
    try:
        manifest = ck.validate(path, check_crc)
    except ck.CheckpointError as exc:
        print(f"{path.name}: NOT USABLE: {exc}")
        return False
    state = ck.read_state(path / ck.STATE)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest["created"]))
    print(f"{path.name}: valid ({'CRC-32 checked' if check_crc else 'sizes checked'}), step "
          f"{manifest['step']}, written {when}, {len(manifest['files'])} files, "
          f"{manifest['bytes'] / 1e6:.1f} MB")
    print(f"  trainer ranks (RNG states): {len(state['rng'])}; LR scheduler: "
          f"{'saved' if state['scheduler'] else 'none'}")
    c = state["controller"]
    if c is not None:
        groups = len(c.buffer_group_ends)
        print(f"  controller: version {c.version}, data cursor {c.cursor_consumed}, "
              f"accepted {c.accepted}, rejected {c.rejected}, dropped stale "
              f"{c.dropped_stale}, rollout-log rows {c.rollout_rows}")
        partial = c.partial_prompt_ids
        cont = (f" ({len(partial)} to continue from {int(sum(c.partial_rows))} partial rows)"
                if len(partial) else "")
        print(f"  buffered groups {groups} ({len(c.buffer_rows)} trajectories), prompts in "
              f"flight {len(c.inflight_prompt_ids)}{cont}")
    shards = sorted(f for f in manifest["files"] if f.startswith(ck.SHARDS + "/"))
    if state.get("optimizer_state") is None:
        what = "optimizer: not recorded (older checkpoint)"
    elif state["optimizer_state"]:
        what = f"optimizer: {state['optimizer_format']}"
    else:
        what = "optimizer: none yet (saved before the first optimizer step; resumes with a fresh one)"
    print(f"  model + optimizer shards: {len(shards)} files under {ck.SHARDS}/; {what}")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a run directory or one checkpoint folder")
    ap.add_argument("--no-crc", action="store_true", help="check sizes only (fast on big ones)")
    args = ap.parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    folders = [args.path] if ck.MANIFEST in {p.name for p in args.path.iterdir()} or \
        ck.step_of(args.path) is not None else ck.list_checkpoints(args.path)
    if not folders:
        print(f"error: no checkpoints in {args.path}", file=sys.stderr)
        return 2
    ok = [describe(p, not args.no_crc) for p in folders]
    return 0 if any(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
