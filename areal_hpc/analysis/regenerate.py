"""Regenerate a logged trajectory from its row and the policy it was sampled from, and check that
the engine draws the same tokens and log-probabilities.

    python -m areal_hpc.analysis.regenerate runs/tiny 12                  # row 12, version 0
    python tools/export_hf.py runs/tiny --step 3 --out /tmp/v3            # the policy of version 3
    python -m areal_hpc.analysis.regenerate runs/tiny 40 --model /tmp/v3

A row can be regenerated when it has a sampling seed (rollout.per_request_seeds or
`deterministic: true`; the log's `seed` column, -1 without). Its first tokens, up to the first
change of policy version, were drawn from that seed under that version; later ones (after a
weight update or a preemption cut the sample) from a continuation seed under another policy, so
the first segment is what is compared. The sampling settings come from the run's config.yaml;
the model is --model, by default the run's `model.path` when the segment's version is 0 (the
policy the run started from). Exit status: 0 the same tokens and log-probabilities bit for bit,
1 they differ (the first differing position is printed), 2 bad input (one line naming it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ..config import ConfigError, load
from ..storage import run_dir as run_files
from ..storage.rollout_log import NO_SEED, RolloutLogError, RolloutReader

EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m areal_hpc.analysis.regenerate",
                                 description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("row", type=int, help="the row of rollouts.h5")
    ap.add_argument("--model", type=Path, help="HF directory of the policy at the row's version "
                    "(tools/export_hf.py --step V; default: model.path for version 0)")
    return ap


class BadInput(Exception):
    pass


def first_segment(row: dict) -> tuple[int, int]:
    """(version, length) of the row's first run of tokens from one policy version."""
    v = np.asarray(row["versions"])
    if not len(v):
        raise BadInput("the row has no output tokens")
    change = np.flatnonzero(v != v[0])
    return int(v[0]), int(change[0]) if len(change) else len(v)


def regenerate(run_dir: Path, index: int, model: Path | None = None) -> dict:
    """Regenerate row `index` of `run_dir`'s rollout log; returns what was compared."""
    from ..rollout.vllm_engine import VLLMEngine, engine_options     # vLLM

    log_path, config = run_dir / run_files.ROLLOUTS, run_dir / "config.yaml"
    for path in (log_path, config):
        if not path.is_file():
            raise BadInput(f"{path}: not found")
    try:
        cfg = load(config)
    except ConfigError as exc:
        raise BadInput(f"{config}: {exc}") from None
    try:
        with RolloutReader(log_path) as r:
            if not 0 <= index < len(r):
                raise BadInput(f"{log_path}: no row {index} (rows 0-{len(r) - 1})")
            row = r[index]
    except RolloutLogError as exc:
        raise BadInput(str(exc)) from None
    if row["seed"] == NO_SEED:
        raise BadInput(f"{log_path} row {index}: no sampling seed (the run drew from the engine's "
                       "shared stream; rollout.per_request_seeds was off)")
    version, k = first_segment(row)
    if model is None:
        if version != 0:
            raise BadInput(f"row {index}'s tokens come from version {version}: export it "
                           f"(python tools/export_hf.py {run_dir} --step {version} --out DIR) "
                           "and pass --model DIR")
        model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise BadInput(f"{model}: not a model directory (no config.json)")
    r = cfg.rollout
    with VLLMEngine(str(model), dtype=cfg.model.dtype, seed=cfg.train.seed,
                    tensor_parallel_size=r.engine_tp, per_request_seeds=True,
                    **engine_options(r)) as engine:
        engine.submit("regenerate", row["prompt_tokens"].tolist(), max_new_tokens=k,
                      temperature=r.temperature, top_p=r.top_p, ignore_eos=True,
                      seed=int(row["seed"]))
        out = []
        while engine.has_unfinished():
            out += engine.step()
    (smp,) = out
    return {"row": index, "version": version, "of": len(row["output_tokens"]), "model": str(model),
            **compare(row["output_tokens"][:k], row["behav_logprobs"][:k],
                      smp.output_tokens[:k], smp.behav_logprobs[:k])}


def compare(tokens, logprobs, got_tokens, got_logprobs) -> dict:
    """The logged segment against the regenerated one: tokens and log-probabilities bit for bit.
    A regenerated segment that ended early counts as different from where it ended."""
    k = len(tokens)
    got_t = np.full(k, -1, np.int64)
    got_lp = np.full(k, np.nan, np.float64)
    got_t[:len(got_tokens)], got_lp[:len(got_logprobs)] = got_tokens[:k], got_logprobs[:k]
    differ = np.flatnonzero((got_t != tokens) | (got_lp != np.asarray(logprobs, np.float64)))
    return {"tokens": k, "first_difference": int(differ[0]) if len(differ) else None,
            "logprob_max_abs_diff": float(np.nanmax(np.abs(got_lp - logprobs))) if k else 0.0,
            "logged": np.asarray(tokens).tolist(), "regenerated": got_t.tolist()}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        res = regenerate(args.run_dir, args.row, args.model)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    what = (f"row {res['row']}: its first {res['tokens']} of {res['of']} tokens (version "
            f"{res['version']}, {res['model']})")
    d = res["first_difference"]
    if d is None:
        print(f"{what}: regenerated the same, tokens and log-probabilities bit for bit")
        return 0
    print(f"{what}: differ from position {d} (logged token {res['logged'][d]}, regenerated "
          f"{res['regenerated'][d]}; log-probabilities up to {res['logprob_max_abs_diff']:.3g} apart)")
    return EXIT_DIFFERENT


if __name__ == "__main__":
    sys.exit(main())
