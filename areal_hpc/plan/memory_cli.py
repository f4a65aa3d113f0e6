"""`python -m areal_hpc.plan memory`: the per-GPU estimate as a table (plan/memory.py), then the
host memory per node (plan/host_memory.py)."""
from __future__ import annotations

import re
import sys

from ..config import ConfigError, load
from .host_memory import host_estimate, render_host
from .memory import GiB, Plan, estimate, fmt_num


# ------------------------------------------------------------------------------ output

def render(plan: Plan, console) -> None:
    from rich.table import Table

    cfg, a, mem = plan.cfg, plan.arch, plan.gpu_mem_gib
    t = cfg.topology
    console.print(f"[bold]{cfg.name}[/]: {a.source} — {a.total_params / 1e9:.2f} B params, "
                  f"{a.layers} layers, "
                  f"h {a.hidden}, ffn {a.ffn}, heads {a.heads}/{a.kv_heads} kv, vocab {a.vocab}"
                  f"{' (tied)' if a.tied else ''}; {cfg.model.dtype} on {t.device}")
    worst = plan.worst_stage()
    tab = Table(title=f"trainer rank (tp {t.tp} x pp {t.pp} x dp {t.n_trainers // (t.tp * t.pp)}), GiB",
                caption="(alt): peaks at different times, only the largest counts")
    tab.add_column("term")
    for st in plan.trainer:
        mark = " *" if st is worst and len(plan.trainer) > 1 else ""
        tab.add_column(st.label.replace("trainer ", "") + mark, justify="right")
    for i, term in enumerate(plan.trainer[0].terms):
        name = term.name if term.concurrent else f"{term.name} (alt)"
        tab.add_row(name, *(f"{st.terms[i].bytes / GiB:.2f}" for st in plan.trainer))
    tab.add_row("[bold]total[/]", *(f"[bold]{st.total / GiB:.2f}[/]" for st in plan.trainer))
    if mem:
        tab.add_row("GPU memory", *(fmt_num(mem) for _ in plan.trainer))
        tab.add_row("headroom", *(_headroom(st.total, mem) for st in plan.trainer))
    console.print(tab)
    for note in worst.notes:
        console.print(f"  {worst.label}: {note}")

    g = plan.generator
    gt = Table(title=f"generator rank (vLLM worker, engine_tp {cfg.rollout.engine_tp}), GiB")
    gt.add_column("term")
    gt.add_column("GiB", justify="right")
    for term in g.terms:
        gt.add_row(term.name, f"{term.bytes / GiB:.2f}")
    gt.add_row("[bold]total[/]", f"[bold]{g.total / GiB:.2f}[/]")
    if mem:
        gt.add_row("GPU memory", fmt_num(mem))
        gt.add_row("headroom", _headroom(g.total, mem))
    console.print(gt)
    for note in g.notes:
        console.print(f"  generator: {note}")


def _headroom(total: float, mem_gib: float) -> str:
    left = mem_gib - total / GiB
    return f"[green]{left:.2f}[/]" if left >= 0 else f"[red]{left:.2f}[/]"


def parse_mem(text: str) -> float:
    """'80GiB', '80', '141 GiB', '80GB' (10^9 bytes) -> GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g)?\s*", text.lower())
    if not m:
        raise ConfigError(f"--gpu-mem: expected a size like 80GiB, got {text!r}")
    value = float(m.group(1))
    return value * 1e9 / GiB if m.group(2) == "gb" else value


def add_memory_parser(sub) -> None:
    mp = sub.add_parser("memory", help="per-GPU memory estimate of a config; exit 2 if it cannot fit")
    mp.add_argument("config")
    mp.add_argument("overrides", nargs="*", help="key=value")
    mp.add_argument("--gpu-mem", default=None, help="GPU memory (default topology.gpu_mem_gib)")


def memory_command(args, console) -> int:
    """`python -m areal_hpc.plan memory`: the table, exit 0 when it fits, else 2."""
    try:
        cfg = load(args.config, args.overrides)
        gpu = parse_mem(args.gpu_mem) if args.gpu_mem is not None else None
        plan = estimate(cfg, gpu)
        host = host_estimate(cfg)       # plan/host_memory.py: RAM per node, #SBATCH --mem
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    render(plan, console)
    render_host(host, console)
    err = plan.error() or host.error()
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if plan.gpu_mem_gib:
        console.print(f"[green]fits[/] in {fmt_num(plan.gpu_mem_gib)} GiB per GPU")
    else:
        console.print("no GPU memory to compare with (device cpu; pass --gpu-mem)")
    if host.host_mem_gib:
        console.print(f"[green]fits[/] in {fmt_num(host.host_mem_gib)} GiB of host memory per node")
    return 0
