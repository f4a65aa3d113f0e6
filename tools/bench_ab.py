"""Paired A/B benchmark of two commits: the same job, alternated, on this machine.

    python tools/bench_ab.py --base 1ebf72e --pairs 3 --steps 60 rollout.max_staleness=4 \
        --a-set train.off_policy=naive --b-set train.prox=behaviour   # naive PPO on both
    python tools/bench_ab.py --head WORKTREE_OR_REV --base REV ...   # A: a revision or a folder

A (--head, default HEAD) and B (--base) each get a git worktree (`git worktree add --detach`
under --work; a folder given instead is used as it is, e.g. an uncommitted fix), whose ignored
`models/` is a link to this checkout's. Each pair runs the tiny recipe (configs/tiny_cpu.yaml,
the overrides after the options) once from each tree, through the real launcher
(`run_job` of tools/bench_async_vs_sync.py, run from the tree with PYTHONPATH on it), in the
order A B, B A, A B, ... so that load drifting on a shared box hits both alike. Per run: the
job's wall seconds and CPU seconds (every process of it, reaped through mpiexec), the trainer's
wall (its clock from its first step), the generator's seconds per generated token while
generating (generators.json busy / tokens) and the engine's (engine_s / tokens), trained tokens/s
(`run_efficiency`). Per pair the ratios A/B and their median, as a markdown table; records to
--out (JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tools"))

import bench_async_vs_sync as job  # noqa: E402

from areal_hpc.analysis.efficiency import run_efficiency  # noqa: E402
from areal_hpc.storage.run_dir import RunDir  # noqa: E402

# metric -> (column title, True when larger is better)
METRICS = {
    "job_s": ("job wall s", False),
    "train_wall_s": ("train wall s", False),
    "gen_us_tok": ("gen µs/token (busy)", False),
    "engine_us_tok": ("engine µs/token", False),
    "trained_tok_s": ("trained tok/s", True),
    "cpu_s": ("job CPU s", False),
}


def worktree(rev: str, work: Path) -> tuple[Path, str]:
    """A detached worktree of `rev` under `work` (made once), or `rev` itself if it is a folder;
    (path, its commit)."""
    if Path(rev).is_dir():
        path = Path(rev).resolve()
    else:
        sha = subprocess.check_output(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
                                      cwd=ROOT, text=True).strip()
        path = work / sha[:12]
        if not path.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT,
                           check=True, capture_output=True)
    models = path / "models"
    if not models.exists() and (ROOT / "models").exists():
        models.symlink_to(ROOT / "models")
    sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=path, text=True).strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=path).returncode != 0
    return path, sha[:10] + ("+dirty" if dirty else "")


def run_one(tree: Path, overrides: list[str], out: Path, name: str, timeout: float) -> dict:
    """One job from `tree` (its package first on the path); its measures, or {"ok": False}."""
    rc, seconds, _, cpu = job.run_job(overrides, out, name, timeout, root=tree)
    if rc != 0:
        return {"ok": False, "rc": rc, "job_s": seconds, "cpu_s": cpu}
    mode = "sync" if "rollout.mode=sync" in overrides else "async"
    eff = run_efficiency(out / name, mode, target=1.0)
    gens = RunDir(out / name).read_generators()
    tokens = sum(g.tokens for g in gens)
    engine_s = sum(g.engine_s for g in gens)
    return {"ok": True, "job_s": seconds, "cpu_s": cpu, "train_wall_s": eff["wall_s"],
            "gen_us_tok": 1e6 * eff["gen_seconds"]["busy"] / tokens,
            "engine_us_tok": 1e6 * engine_s / tokens if engine_s else float("nan"),
            "trained_tok_s": eff["trained_tok_s"], "gen_tokens": tokens,
            "gen_seconds": eff["gen_seconds"], "steps": eff["steps"]}


def ratios(pairs: list[tuple[dict, dict]]) -> dict[str, list[float]]:
    """metric -> A/B per pair (pairs where both runs succeeded)."""
    ok = [(a, b) for a, b in pairs if a.get("ok") and b.get("ok")]
    return {m: [a[m] / b[m] for a, b in ok] for m in METRICS}


def table(pairs: list[tuple[dict, dict]], a_name: str, b_name: str) -> str:
    """Markdown: one row per run and metric values, then the per-pair ratios A/B and median."""
    cols = list(METRICS)
    head = "| pair | run | " + " | ".join(METRICS[c][0] for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for i, (a, b) in enumerate(pairs, 1):
        for label, r in ((f"A {a_name}", a), (f"B {b_name}", b)):
            vals = [f"{r[c]:.1f}" if r.get("ok") or c in ("job_s", "cpu_s") else "failed"
                    for c in cols]
            lines.append(f"| {i} | {label} | " + " | ".join(vals) + " |")
    rs = ratios(pairs)
    for i in range(len(rs[cols[0]])):
        lines.append(f"| {i + 1} | A/B | " + " | ".join(f"{rs[c][i]:.3f}" for c in cols) + " |")
    if rs[cols[0]]:
        lines.append("| median | A/B | " + " | ".join(
            f"**{statistics.median(rs[c]):.3f}**" for c in cols) + " |")
    better = ", ".join(f"{METRICS[c][0]}: {'above' if METRICS[c][1] else 'below'} 1"
                       for c in cols)
    return "\n".join(lines) + f"\n\nA better than B where the ratio is {better}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head", default="HEAD", help="A: a revision or a folder (default HEAD)")
    ap.add_argument("--base", required=True, help="B: a revision or a folder")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_ab"),
                    help="worktrees and run directories")
    ap.add_argument("--out", type=Path, default=None, help="records (JSON); default WORK/ab_*.json")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--a-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for A only (repeatable): a key the other commit lacks")
    ap.add_argument("--b-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for B only (repeatable)")
    ap.add_argument("overrides", nargs="*", help="key=value for both jobs")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    (a_tree, a_sha), (b_tree, b_sha) = worktree(args.head, args.work), worktree(args.base, args.work)
    overrides = [f"train.total_steps={args.steps}", *args.overrides]
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = args.out or args.work / f"ab_{stamp}.json"
    runs = args.work / f"runs_{stamp}"
    print(f"A = {a_sha} ({a_tree}) {args.a_set}, B = {b_sha} ({b_tree}) {args.b_set}; "
          f"{args.pairs} pair(s): {overrides}", flush=True)
    pairs = []
    for i in range(args.pairs):
        order = (("A", a_tree, args.a_set), ("B", b_tree, args.b_set))
        rec = {}
        for side, tree, own in (order if i % 2 == 0 else order[::-1]):
            rec[side] = run_one(tree, overrides + own, runs, f"p{i}_{side}", args.timeout)
            print(f"pair {i + 1} {side}: " + json.dumps(
                {k: round(v, 2) for k, v in rec[side].items() if isinstance(v, float)}), flush=True)
        pairs.append((rec["A"], rec["B"]))
        out.write_text(json.dumps({"A": a_sha, "B": b_sha, "overrides": overrides,
                                   "a_set": args.a_set, "b_set": args.b_set,
                                   "pairs": pairs}, indent=1))
    print(table(pairs, a_sha, b_sha))
    print(f"records: {out}")


if __name__ == "__main__":
    main()
