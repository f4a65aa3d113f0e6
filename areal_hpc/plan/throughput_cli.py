"""`python -m areal_hpc.plan throughput`: the planner's command line (plan/throughput.py)."""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, RunConfig, load
from .calibration import assumed_rates, calibrate, load_lengths
from .throughput import Lengths, Rates, SimResult, device_units, predict, search

# ------------------------------------------------------------------------------ CLI

def add_parser(sub) -> None:
    tp = sub.add_parser("throughput", help="simulated steps/hour of a config: async vs sync, search")
    tp.add_argument("config")
    tp.add_argument("overrides", nargs="*", help="key=value")
    tp.add_argument("--from-run", default=None, help="calibrate the rates from a finished run directory")
    tp.add_argument("--gen-tok-s", type=float, default=None, help="one engine's decode tokens/s, full")
    tp.add_argument("--train-tok-s", type=float, default=None, help="the trainer's tokens/s")
    tp.add_argument("--update-s", type=float, default=None, help="seconds per weight update")
    tp.add_argument("--train-overhead-s", type=float, default=None, help="fixed seconds per step")
    tp.add_argument("--c-half", type=float, default=None, help="engine half-saturation concurrency")
    tp.add_argument("--lengths", default=None, help="RUN_DIR or rollouts.h5: output lengths")
    tp.add_argument("--median-len", type=float, default=None)
    tp.add_argument("--p99-len", type=float, default=None)
    tp.add_argument("--kv-tokens", type=float, default=None, help="KV tokens per engine")
    tp.add_argument("--steps", type=int, default=None, help="steps to simulate (default total_steps)")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--search", action="store_true", help="search device splits and η")
    tp.add_argument("--devices", type=int, default=None, help="devices (CPU: cores) to split")


def _positive(value, flag: str, zero_ok: bool = False) -> None:
    if value is not None and not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ConfigError(f"{flag}: must be {'>= 0' if zero_ok else 'positive'}, got {value:g}")


def rates_from_args(args, cfg: RunConfig) -> Rates:
    for flag in ("gen_tok_s", "train_tok_s", "median_len", "p99_len", "kv_tokens"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    for flag in ("update_s", "train_overhead_s", "c_half"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"), zero_ok=True)
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
    if args.devices is not None and args.devices < 2:
        raise ConfigError(f"--devices: need at least 2, got {args.devices}")
    base = calibrate(args.from_run) if args.from_run else None
    if args.lengths:
        if not Path(args.lengths).exists():
            raise ConfigError(f"--lengths: no run directory or rollout log at {args.lengths}")
        lengths = load_lengths(args.lengths)
    elif args.median_len or args.p99_len:
        if not (args.median_len and args.p99_len) or args.p99_len < args.median_len:
            raise ConfigError("--median-len/--p99-len: give both, with p99 >= median")
        lengths = Lengths(median=args.median_len, p99=args.p99_len, source="lognormal (flags)")
    elif base is not None:
        lengths = base.lengths
    else:
        raise ConfigError("no output lengths: pass --from-run, --lengths or --median-len/--p99-len")
    if base is None:
        need = [args.gen_tok_s, args.train_tok_s, args.update_s]
        if all(v is not None for v in need):
            base = Rates(*need, lengths, source="flags")
        else:
            *assumed, c_half = assumed_rates(cfg, lengths)
            vals = [v if v is not None else a for v, a in zip(need, assumed)]
            base = Rates(*vals, lengths, c_half=c_half, source="ASSUMED H100 roofline (+ flags)")
    r = replace(base, lengths=lengths)
    for name in ("gen_tok_s", "train_tok_s", "update_s", "train_overhead_s", "c_half"):
        if getattr(args, name) is not None:
            r = replace(r, **{name: getattr(args, name)})
            if base.source not in ("flags",) and "flags" not in r.source:
                r = replace(r, source=r.source + " + flags")
    r.check()
    return r


def _result_cells(res: SimResult) -> list[str]:
    return [f"{res.steps_per_hour:.1f}", f"{res.wall_s:.1f}", f"{100 * res.gen_busy_frac:.0f}%",
            f"{100 * res.trainer_idle_frac:.0f}%", f"{res.staleness_mean:.2f}",
            f"{res.staleness_p95:.0f}", f"{100 * res.dropped_share:.1f}%",
            f"{res.ideal_steps_per_hour:.1f}"]


_COLUMNS = ("steps/h", "wall s", "gen busy", "tr idle", "stale", "p95", "dropped", "ideal/h")


def throughput_command(args, console) -> int:
    """`python -m areal_hpc.plan throughput`: exit 0 with the tables, 2 with `error: ...`."""
    from rich.table import Table

    try:
        cfg = load(args.config, args.overrides)
        rates = rates_from_args(args, cfg)
        steps = args.steps or cfg.train.total_steps
        pred = predict(cfg, rates, steps, args.seed, kv_tokens=args.kv_tokens)
        rows = search(cfg, rates, args.devices, steps=min(steps, 8), seed=args.seed) if args.search else []
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gu, tu = device_units(cfg)
    s = pred.setup
    console.print(f"[bold]{cfg.name}[/]: {s.n_generators} generator engine(s) ({gu} device(s)), "
                  f"trainer {tu} device(s); B {s.batch_prompts} x n {s.group_size}, η "
                  f"{s.max_staleness}, {s.seq_limit} sequences per engine, {steps} steps")
    console.print(f"rates ({rates.source}): gen {rates.gen_tok_s:.1f} tok/s per engine, train "
                  f"{rates.train_tok_s:.1f} tok/s + {rates.train_overhead_s:.2f} s/step, update "
                  f"{rates.update_s:.2f} s, c_half {rates.c_half:g}")
    console.print(f"lengths: {rates.lengths.describe()}")
    tab = Table(title="predicted throughput (simulation)")
    tab.add_column("schedule")
    for c in _COLUMNS:
        tab.add_column(c, justify="right")
    tab.add_row(f"async (η {s.max_staleness})", *_result_cells(pred.async_))
    tab.add_row("sync colocated (η 0)", *_result_cells(pred.sync))
    console.print(tab)
    console.print(f"async/sync speedup: [bold]{pred.speedup:.2f}x[/]  (stale: mean staleness of "
                  "trained samples; ideal/h: the full-overlap bound)")
    if rows:
        st = Table(title=f"search: device split x η ({min(steps, 8)} steps each), by steps/hour")
        st.add_column("gen dev", justify="right")
        st.add_column("train dev", justify="right")
        st.add_column("schedule")
        for c in _COLUMNS:
            st.add_column(c, justify="right")
        for row in rows:
            sched = "sync" if row.schedule == "sync" else f"async η{row.eta}"
            st.add_row(str(row.gen_devices), str(row.train_devices), sched, *_result_cells(row.result))
        console.print(st)
    return 0
