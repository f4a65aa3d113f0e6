"""Replay a run's training from its rollout log, without generators: the same batches, in the
same order, through the same trainer code, to debug a loss or reproduce a step.

    python -m areal_hpc.replay RUN_DIR [--steps N] [--out DIR] [--check] [--tol T]
    python tools/replay_run.py RUN_DIR ...                       # the same, from a checkout

What it does: reads the run's `config.yaml`, builds a single-process trainer the way
`tools/export_hf.py` does (a gloo process group of size 1, Megatron tp = pp = 1 seeded with
`train.seed` as the trainer's `Actor` seeds it, `Actor` from the run's `model.path`: the initial
policy, with the run's `train` section, group size, temperature and dtype), then for each step
s = 0..S-1 takes the trajectories the run consumed at step s from `rollouts.h5` and calls
`Actor.train_step(trajs, version=s)`, which trains the split of the batch `train/trainer.py`
trains (`train/shares.py:split_batch`; the version of the weights is the number of steps trained
before). It prints the replayed loss and grad_norm beside
the ones `metrics.jsonl` logged, and their differences.

The trajectories. Each is the dict the controller handed the trainer (prompt_tokens,
output_tokens, behav_logprobs, versions, reward, and the ids), rebuilt from its log row: the
token arrays are stored as the generator produced them (int32 tokens and versions, float32
behaviour log-probs), so they are bit-identical; the reward is stored as float32: a reward that is
not a float32 value (a user's reward function returning 0.1, say) is rounded by at most 6e-8
relatively, which moves the advantages by as much. The built-in math and code rewards (0 or 1)
are exact.

The batch order. The controller appends each group (one prompt's `group_size` samples, from one
message, in sample order) to the log the moment it arrives and to its `ReadyBuffer` in the same
order, so the log's row order is the arrival order. `ReadyBuffer.take(B)` stable-sorts the buffer
by each group's oldest token version and takes the first B; the remainder keeps that order and
new groups are appended behind it, so among groups of equal oldest version the buffer is always
in arrival order (dropping stale groups filters without reordering; a resume re-adds the
checkpoint's buffered groups in buffer order, all of them older rows than anything the resumed
job appends). Hence the batch of step s is: its groups (rows with consumed_step = s, cut into
groups as the audit does: consecutive rows of one prompt with sample_idx 0..n-1), sorted by
(oldest version of the group's tokens, first row), each group's rows in row order. The log holds
everything this needs, so the order is fully determined (`batch_order`; tests/train/test_replay.py
checks it against ReadyBuffer itself, resumes included).

Were the order unknown, the loss would still agree up to floating-point summation order with
train.ppo_minibatches = 1: the advantages are per group (GRPO, groups contiguous in any order of
groups) and the step's loss is a token mean over the whole batch, so a different order only
changes how sequences are packed into micro-batches. With several minibatches it would not:
`shares.dp_split` splits the batch with `balanced_allocate`, which breaks ties between equal
lengths by sequence index, so another order can put other sequences into each minibatch, each
minibatch is one optimizer step, and from the second minibatch on the loss is taken with other
weights (the whole step's logged loss and everything after differ by a real amount, not by
rounding; measured in `DEFAULT_TOL`'s comment).

Randomness. The trainer draws none while training: dropout is off everywhere
(`hf_convert.megatron_config_kwargs`), packing and minibatch splits are deterministic, and the
prompt shuffle is the controller's (its outcome is in the log). The only seeded draw is Megatron's
random initialisation, which the HF weights then overwrite; the replay seeds it the same way
anyway. The RNG states a checkpoint stores (`checkpoint.rng_state`) therefore do not matter. A
resumed run is replayed from step 0: the checkpoint it resumed from holds the weights and
optimizer state the earlier steps produced, which the replay recomputes.

Threads. On CPU the replay runs as many torch threads as the trainer rank did: its share of
`topology.trainer_cpus` when bound, else $OMP_NUM_THREADS, else 1 (the launchers' default,
`launch/env.py`); `--threads` overrides. Another count can change float summation order.

How close. Same code, same machine kind: the replay was observed to be bit-identical to the
run, every step's loss and grad_norm and the final weights (tests/train/test_replay.py asserts
so for its tiny CPU run; the tiny recipe's 40-step run replayed so too, with 1 thread as it ran
and with 2). Elsewhere (another CPU, GPU vs CPU, other kernels) the summation order differs and
the difference grows a little with every step (`DEFAULT_TOL` has the measurements). The loss
difference is measured relative to max(|logged loss|, logged adv_abs_mean): the loss is a
token mean of terms of size |advantage| that largely cancel (GRPO advantages sum to zero per
group), so rounding noise scales with the advantages, not with the (possibly near-zero) loss.
`--check` exits 1 when that exceeds the tolerance (`DEFAULT_TOL` by model dtype, or `--tol`) at
any step that metrics.jsonl logged, or when a replayed step took another number of tokens or
sequences than the logged one (a wrong batch).

Refused (one line on stderr, exit 2): no run directory or config.yaml, a config that does not
load, a trainer topology other than one rank (tp, pp or dp > 1: Megatron's reductions would be
re-associated and DP shares packed differently; not supported), a model directory that is gone,
a missing or damaged rollout log, a log with no consumed step (or a gap in its steps, or a step
whose rows are not whole groups of group_size), --steps beyond what the log holds, a CUDA replay
without CUDA.

--out DIR writes DIR/replay.jsonl (per step: the log rows of the batch in batch order, the
replayed train_step statistics, the logged loss and grad_norm, the differences) and DIR/policy,
the HF weights after the last replayed step (`Actor.save_hf`).

Note: config.yaml is the run's last attempt's; had it changed train settings between attempts,
the earlier steps are replayed with the later settings.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from .config import ConfigError, load
from .cpus import role_cpus
from .rollout.staleness import ReadyBuffer
from .storage import run_dir as run_files
from .storage.rollout_log import RolloutLogError, RolloutReader, group_starts

EXIT_OK, EXIT_DIFFERS, EXIT_REFUSED = 0, 1, 2
# --check's bound on |replayed - logged loss| / max(|logged loss|, adv_abs_mean), by model
# dtype. Measured on the tiny recipe's 40-step CPU run (B = 16, n = 8; runs/tinyv): replayed as
# is, all 40 steps bit-identical (1 and 2 threads alike); replayed with every batch's groups in
# reverse order (with ppo_minibatches = 1 that changes only the packing, i.e. the float
# summation order: what another CPU, GPU or kernel does), the loss drifts from 3e-9 at step 0 to
# at most 1.6e-6 (step 34), grad_norm to 6.8e-4 relative. A wrong batch is far off: the tiny test
# run (ppo_minibatches = 2) replayed in reverse order differs by 7.9e-3 at step 0, 3.9e-2 at
# most. float32's 1e-3 sits 600x above the drift and 8x below that. bfloat16, the same
# reversal (two bf16 replays): 1.1e-3 after 20 steps, still growing, hence 5e-2 (bf16 cannot
# tell a wrong minibatch split from rounding by the loss; the token counts still tell a wrong
# batch). float16 has 3 more mantissa bits than bf16 (not measured): 1e-2.
DEFAULT_TOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


class Refused(Exception):
    """The run cannot be replayed; the message is one line naming the file or key."""


# ------------------------------------------------------------------------------ the batches

def split_groups(rows: np.ndarray, prompt_id: np.ndarray, sample_idx: np.ndarray) -> list[list[int]]:
    """`rows` (ascending) cut into groups as the controller appended them
    (`rollout_log.group_starts`)."""
    rows = np.asarray(rows, dtype=np.int64)
    cuts = np.flatnonzero(group_starts(rows, prompt_id, sample_idx))[1:]
    return [g.tolist() for g in np.split(rows, cuts)] if len(rows) else []


def _take_in_batch_order(groups: list[list[int]], trajs: list[list[dict]]) -> list[list[int]]:
    """The groups of one step in the order `Controller.next_batch` put them into the batch: the
    controller's own `ReadyBuffer`, filled in arrival order (row order), then `take`n whole."""
    buffer = ReadyBuffer()
    for g, t in zip(groups, trajs):
        buffer.add(t, g)
    return [taken.rows for taken in buffer.take(len(groups))]


def batch_order(groups: list[list[int]], oldest: list[int]) -> list[list[int]]:
    """`_take_in_batch_order` for groups known only by their oldest token versions."""
    return _take_in_batch_order(groups, [[{"versions": [v]}] for v in oldest])


class Batches:
    """The consumed steps of a rollout log and, step by step, their batches."""

    def __init__(self, log_path: Path, group_size: int):
        self.path, self.n = log_path, group_size
        if not log_path.is_file():
            raise Refused(f"{log_path}: no rollout log (nothing to replay)")
        try:
            self.reader = RolloutReader(log_path)
            consumed = self.reader.column("consumed_step").astype(np.int64)
            self.prompt_id = self.reader.column("prompt_id").astype(np.int64)
            self.sample_idx = self.reader.column("sample_idx").astype(np.int64)
        except (RolloutLogError, OSError) as exc:
            self.close()
            raise Refused(_line(exc)) from None
        steps = consumed[consumed >= 0]
        if not len(steps):
            self.close()
            raise Refused(f"{log_path}: no trajectory was consumed by a training step "
                          f"({len(consumed)} rows, none trained): nothing to replay")
        self.n_steps = int(steps.max()) + 1
        order = np.argsort(consumed, kind="stable")
        bounds = np.searchsorted(consumed[order], np.arange(self.n_steps + 1))
        self.rows = [np.sort(order[bounds[s]:bounds[s + 1]]) for s in range(self.n_steps)]
        missing = [s for s in range(self.n_steps) if not len(self.rows[s])]
        if missing:
            self.close()
            raise Refused(f"{log_path}: damaged rollout log (steps 0-{self.n_steps - 1} are "
                          f"marked consumed, but no row holds step {missing[0]})")
        for s in range(self.n_steps):
            for g in split_groups(self.rows[s], self.prompt_id, self.sample_idx):
                if len(g) != group_size or self.sample_idx[g[0]] != 0:
                    self.close()
                    raise Refused(f"{log_path}: step {s}: rows {g[0]}-{g[-1]} are not a whole group "
                                  f"of rollout.group_size = {group_size} samples (prompt "
                                  f"{self.prompt_id[g[0]]}); the batch cannot be rebuilt")

    def batch(self, step: int) -> tuple[list[dict], list[int]]:
        """Step `step`'s trajectories in batch order, and their log rows."""
        try:
            groups = split_groups(self.rows[step], self.prompt_id, self.sample_idx)
            # a log row is the trajectory dict the controller got (as its resume reads them)
            trajs = {r: self.reader[r] for g in groups for r in g}
        except (RolloutLogError, OSError) as exc:
            raise Refused(_line(exc)) from None
        ordered = _take_in_batch_order(groups, [[trajs[r] for r in g] for g in groups])
        rows = [r for g in ordered for r in g]
        return [trajs[r] for r in rows], rows

    def close(self) -> None:
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.close()
            self.reader = None


# ------------------------------------------------------------------------------ the run's files

def _line(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    return (text.splitlines() or [type(exc).__name__])[0]


def load_run_config(run_dir: Path):
    if not run_dir.is_dir():
        raise Refused(f"{run_dir}: no such run directory")
    path = run_dir / run_files.CONFIG
    if not path.is_file():
        raise Refused(f"{path}: no such file (the run's settings, written when it starts): give "
                      "a run directory")
    try:
        cfg = load(path)
    except ConfigError as exc:
        msg = _line(exc)
        raise Refused(msg if str(path) in msg else f"{path}: {msg}") from None
    t = cfg.topology
    if t.n_trainers != 1 or t.tp != 1 or t.pp != 1:
        dp = t.n_trainers // max(t.tp * t.pp, 1)
        raise Refused(f"{path}: the run trained on {t.n_trainers} trainer ranks (tp={t.tp}, "
                      f"pp={t.pp}, dp={dp}); replay rebuilds only single-rank trainers "
                      "(tp = pp = dp = 1)")
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise Refused(f"{path}: the run's initial model {cfg.model.path} (model.path) is gone "
                      "(no config.json there)")
    return cfg


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step (the last line of a step wins; {} without the file)."""
    try:
        return run_files.RunDir(run_dir).metrics_by_step()
    except run_files.RunFileError as exc:
        raise Refused(str(exc)) from None


def trainer_threads(cfg) -> int:
    """How many torch threads the run's trainer rank ran (see the module docstring)."""
    cpus = role_cpus(cfg.topology, "trainer")
    if cpus:
        return len(cpus)        # one trainer rank: all of them
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS", "1")), 1)
    except ValueError:
        return 1


# ------------------------------------------------------------------------------ comparison

def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _logged(logged: dict, key: str) -> float | None:
    """A logged number; NaN for a null one (the trainer measured nothing: a step with no
    forward pass), None when the line has no such field."""
    return math.nan if key in logged and logged[key] is None else _num(logged.get(key))


def _same(a: float, b: float | None) -> bool:
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))


def relative_difference(replayed: float, logged: float | None, scale: float = 0.0) -> float | None:
    """|replayed - logged| / max(|logged|, scale); None without a logged value; 0 for two
    NaNs, inf for one."""
    if logged is None:
        return None
    if math.isnan(replayed) or math.isnan(logged):
        return 0.0 if math.isnan(replayed) and math.isnan(logged) else math.inf
    d = abs(replayed - logged)
    den = max(abs(logged), scale)
    return d / den if den > 0 else (0.0 if d == 0 else math.inf)


def compare(step: int, stats: dict, logged: dict | None) -> dict:
    """One step's replayed statistics against metrics.jsonl's line for it."""
    logged = logged or {}
    scale = _num(logged.get("adv_abs_mean"))
    scale = stats["adv_abs_mean"] if scale is None else scale
    loss, gn = _logged(logged, "loss"), _logged(logged, "grad_norm")
    same_batch = all(_num(logged.get(k)) in (None, stats[k]) for k in ("n_tokens", "n_seqs"))
    return {"step": step, "loss": stats["loss"], "logged_loss": loss,
            "loss_diff": relative_difference(stats["loss"], loss, scale),
            "grad_norm": stats["grad_norm"], "logged_grad_norm": gn,
            "grad_norm_diff": relative_difference(stats["grad_norm"], gn),
            "exact": _same(stats["loss"], loss) and _same(stats["grad_norm"], gn),
            "same_batch": same_batch}


def _fmt(x: float | None, spec: str = ".9g") -> str:
    return "-" if x is None else format(x, spec)


# ------------------------------------------------------------------------------ the CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m areal_hpc.replay",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    ap.add_argument("--steps", type=int, default=None,
                    help="replay steps 0..N-1 (default: every step the log shows consumed)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write DIR/replay.jsonl and DIR/policy (the weights after the last step)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a step's loss differs from the logged one by more than --tol")
    ap.add_argument("--tol", type=float, default=None,
                    help="--check's bound on |loss difference| / max(|logged loss|, adv_abs_mean)"
                         " (default by model dtype: " +
                         ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOL.items()) + ")")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where to train (default: the run's topology.device)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: what the run's trainer rank had)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _replay(args)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def _replay(args) -> int:
    if args.steps is not None and args.steps < 1:
        raise Refused(f"--steps must be >= 1, got {args.steps}")
    if args.tol is not None and not (args.tol >= 0 and math.isfinite(args.tol)):
        raise Refused(f"--tol must be a finite number >= 0, got {args.tol}")
    if args.threads is not None and args.threads < 1:
        raise Refused(f"--threads must be >= 1, got {args.threads}")
    run_dir = args.run_dir
    cfg = load_run_config(run_dir)
    metrics = read_metrics(run_dir)
    batches = Batches(run_dir / run_files.ROLLOUTS, cfg.rollout.group_size)
    try:
        S = batches.n_steps if args.steps is None else args.steps
        if S > batches.n_steps:
            raise Refused(f"{batches.path}: --steps {S}, but the log shows only "
                          f"{batches.n_steps} step(s) consumed")
        if args.check and not any(_num(metrics.get(s, {}).get("loss")) is not None
                                  for s in range(S)):
            raise Refused(f"{run_files.RunDir(run_dir).metrics}: no logged loss for steps 0-{S - 1}: "
                          "nothing to check against")
        if args.out is not None and (args.out / "replay.jsonl").exists():
            raise Refused(f"{args.out / 'replay.jsonl'} already exists (choose another --out)")
        return _train(args, cfg, batches, metrics, S)
    finally:
        batches.close()


def _train(args, cfg, batches: Batches, metrics: dict[int, dict], S: int) -> int:
    device = args.device or cfg.topology.device
    tol = DEFAULT_TOL.get(cfg.model.dtype, DEFAULT_TOL["float32"]) if args.tol is None else args.tol
    threads = args.threads or trainer_threads(cfg)
    for pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=pattern)
    import torch
    import torch.distributed as dist

    if device == "cuda":
        if not torch.cuda.is_available():
            raise Refused("a CUDA replay (the run's topology.device, or --device cuda), but no GPU "
                          "is visible here (--device cpu replays on the CPU, not bit-identically)")
        torch.cuda.set_device(0)
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    t0 = time.monotonic()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # one process
    try:
        from .train.megatron_model import init_megatron_parallel   # torch, Megatron: only for a replay
        from .train.trainer import make_actor
        # as the trainer's Actor does it (seed train.seed); see "Randomness" in the docstring
        init_megatron_parallel(tp=1, pp=1, seed=cfg.train.seed, backend=backend)
        actor = make_actor(cfg, None, device=device)
        print(f"replaying steps 0-{S - 1} of {args.run_dir} from {cfg.model.path} "
              f"({cfg.model.dtype}, {device}, {threads} thread(s); built in "
              f"{time.monotonic() - t0:.1f}s)", flush=True)
        print(f"{'step':>4} {'loss':>16} {'logged':>16} {'diff':>9}  {'grad_norm':>14} "
              f"{'logged':>14} {'diff':>9}  {'tokens':>6}", flush=True)
        out = None
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            out = open(args.out / "replay.jsonl", "w")
        results = []
        try:
            for s in range(S):
                trajs, rows = batches.batch(s)
                stats = actor.train_step(trajs, s)
                res = compare(s, stats, metrics.get(s))
                results.append(res)
                flag = "" if res["same_batch"] else "  other batch than logged (n_tokens/n_seqs)!"
                print(f"{s:>4} {stats['loss']:>16.9g} {_fmt(res['logged_loss'], '>16.9g')} "
                      f"{_fmt(res['loss_diff'], '>9.2e')}  {stats['grad_norm']:>14.8g} "
                      f"{_fmt(res['logged_grad_norm'], '>14.8g')} "
                      f"{_fmt(res['grad_norm_diff'], '>9.2e')}  {stats['n_tokens']:>6}{flag}",
                      flush=True)
                if out is not None:
                    out.write(run_files.json_line({**res, "rows": rows, "replayed": stats,
                                                   "logged": metrics.get(s)}))
                    out.flush()
        finally:
            if out is not None:
                out.close()
        if args.out is not None:
            actor.save_hf(str(args.out / run_files.POLICY))
    finally:
        dist.destroy_process_group()
    return _summary(results, tol, args.check)


def _summary(results: list[dict], tol: float, check: bool) -> int:
    compared = [r for r in results if r["loss_diff"] is not None]
    missing = [r["step"] for r in results if r["loss_diff"] is None]
    if missing:
        print(f"no logged loss for step(s) {missing} (metrics.jsonl): not compared")
    if not compared:
        print("nothing compared")
        return EXIT_OK
    worst = max(compared, key=lambda r: r["loss_diff"])
    gn = [r for r in compared if r["grad_norm_diff"] is not None]
    worst_gn = max(gn, key=lambda r: r["grad_norm_diff"]) if gn else None
    exact = sum(r["exact"] for r in compared)
    print(f"max relative difference: loss {worst['loss_diff']:.3e} (step {worst['step']}; "
          f"relative to max(|loss|, adv_abs_mean))" +
          (f", grad_norm {worst_gn['grad_norm_diff']:.3e} (step {worst_gn['step']})"
           if worst_gn else "") +
          f"; {exact} of {len(compared)} step(s) bit-identical; tolerance {tol:g}")
    bad = [r["step"] for r in compared if not r["loss_diff"] <= tol]
    other = [r["step"] for r in results if not r["same_batch"]]
    if other:
        print(f"step(s) {other}: the replayed batch has another token or sequence count than "
              "the logged one")
    if bad:
        print(f"step(s) {bad}: loss differs by more than the tolerance")
    if check and (bad or other):
        return EXIT_DIFFERS
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
