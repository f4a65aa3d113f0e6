"""Same seed, same run (issue 30), through the launcher a user runs: a synchronous run repeats bit
for bit on CPU: a run with a checkpoint after every step, and one preempted while a batch is
being generated and resumed, are equal: the same rollout log (times and the
preempted samples' PARTIAL rows apart), the same metrics and held-out evaluations (times apart)
and the same final weights.

What makes it so: every sample draws from its own seed (rollout.per_request_seeds, on here), so
its tokens do not depend on how vLLM happened to batch it (without the seeds two such runs
differed from the first sample's first tokens: 102 differences in this comparison); in sync mode
the generator sends the scored groups in the order their prompts came, so the batch (and the
log's rows) come in one order; a preempted sample whose tokens all came from the weights the
resumed generator holds is generated again from its own seed, drawing what the uninterrupted run
drew; the trainer's side was exact already (tools/replay_run.py --check)."""
import json
import os
import signal
import subprocess

import numpy as np
from safetensors.numpy import load_file

from areal_hpc.preemption import HOLD_HOOK_ENV
from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage.rollout_log import NO_SEED, PARTIAL, RolloutReader
from tests.e2e.test_preempt_resume import _check_log, _finish, _steps_done, _wait_for

STEPS, B, N = 4, 2, 2
TIME_FIELDS = {"t_submit", "t_first_token", "t_end"}

# Samples that never stop early: each runs LONG_TOKENS decode steps (an EOS does not end it).
LONG_TOKENS = 320
LONG = ["rollout.temperature=2.0", f"rollout.max_new_tokens={LONG_TOKENS}", "rollout.ignore_eos=true",
        "rollout.max_model_len=512"]


def _partial(run_dir):
    """The PARTIAL rows of the log: {row: (prompt_id, sample_idx, tokens, logprobs, versions,
    finish_reason)}."""
    with RolloutReader(run_dir / "rollouts.h5") as r:
        rows = np.flatnonzero(r.column("consumed_step") == PARTIAL).tolist()
        return {i: (x["prompt_id"], x["sample_idx"], x["output_tokens"], x["behav_logprobs"],
                    x["versions"], x["finish_reason"]) for i in rows for x in [r[i]]}


def _timeless(value):
    """A metrics or eval record without its times (keys ending in _s, seconds, time, per_s)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items()
                if not k.endswith(("_s", "seconds", "time", "per_s"))}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _args(jobs, model, out, name, *extra):
    # Samples of LONG_TOKENS tokens, one group in flight at a time, so that a preemption finds
    # one mid-generation (tests/e2e/test_preempt_resume.py's timing); rewards from the sampled
    # text, which differ within a group, so that the loss is not 0 and the weights move.
    fn = out / "by_text.py"
    fn.write_text("def by_text(completion, reference, row):\n"
                  "    return (sum(map(ord, completion)) % 7) / 8\n")
    return jobs.args(model, out, name, f"reward.fn={fn}:by_text", f"train.total_steps={STEPS}",
                     f"train.batch_prompts={B}", f"rollout.group_size={N}", *LONG,
                     "rollout.mode=sync", "rollout.per_request_seeds=true",
                     "rollout.max_concurrent_prompts=1", "data.eval_limit=4",
                     "data.eval_samples=2", *extra)


def _read(run):
    with RolloutReader(run / "rollouts.h5") as log:
        rows = [log[i] for i in range(len(log))]
    weights = {}
    for f in sorted((run / "policy").glob("*.safetensors")):
        weights.update(load_file(f))
    assert weights
    return {"rows": rows,
            "metrics": [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()],
            "eval": json.loads((run / "eval.json").read_text()),
            "weights": weights}


def _differences(a, b) -> list[str]:
    """Where run b differs from run a (empty: the same, bit for bit, times apart)."""
    out = []
    if len(a["rows"]) != len(b["rows"]):
        out.append(f"rollout log: {len(a['rows'])} vs {len(b['rows'])} rows")
    for i, (x, y) in enumerate(zip(a["rows"], b["rows"])):
        for k in sorted(set(x) - TIME_FIELDS):
            same = (np.array_equal(x[k], y[k]) if isinstance(x[k], np.ndarray)
                    else x[k] == y[k])
            if not same:
                out.append(f"rollout log row {i} (prompt {x['prompt_id']}, sample "
                           f"{x['sample_idx']}): {k}")
    for i, (x, y) in enumerate(zip(a["metrics"], b["metrics"])):
        tx, ty = _timeless(x), _timeless(y)
        out += [f"metrics step {i}: {k} {tx.get(k)} vs {ty.get(k)}"
                for k in sorted(set(tx) | set(ty)) if tx.get(k) != ty.get(k)]
    if len(a["metrics"]) != len(b["metrics"]):
        out.append(f"metrics: {len(a['metrics'])} vs {len(b['metrics'])} steps")
    if _timeless(a["eval"]) != _timeless(b["eval"]):
        out.append(f"eval.json: {_timeless(a['eval'])} vs {_timeless(b['eval'])}")
    if sorted(a["weights"]) != sorted(b["weights"]):
        out.append("final weights: different tensor names")
    out += [f"final weights: {k}" for k in sorted(a["weights"])
            if k in b["weights"] and a["weights"][k].tobytes() != b["weights"][k].tobytes()]
    return out


def _preempt_mid_generation(jobs, run, args, step: int) -> subprocess.Popen:
    """Start the job, held by the generator's test hook (preemption.HOLD_HOOK_ENV) once a
    sample of step `step`'s batch (weights version `step` in sync mode) has a quarter of its
    LONG_TOKENS; then USR1 to every rank, as Slurm's time-limit warning. The held generator
    steps its engine no more, so the signal finds that sample mid-generation on any box."""
    held = run.parent / f"{run.name}.held"
    proc = jobs.start(args, env={**os.environ, HOLD_HOOK_ENV: f"{step}:{LONG_TOKENS // 4}:{held}"})
    _wait_for(held.exists, proc, poll=0.05)
    for p in jobs.processes(ranks_only=True):
        p.send_signal(signal.SIGUSR1)
    return proc


def test_sync_run_repeats_and_a_preempted_one_equals_it(jobs, tiny_model, tmp_path):
    # a: uninterrupted, a checkpoint after every step; b (below): no timed checkpoint, preempted
    # mid-generation and resumed. Equal, they show both that saving a checkpoint disturbs
    # nothing and that a resume changes nothing. (b checkpoints only at the stop: a save after
    # every step there competes with the generator for this box's two cores and moved the
    # group the signal aims at.)
    code, out = _finish(jobs.start(_args(jobs, tiny_model, tmp_path, "a",
                                         "checkpoint.every_steps=1")))
    assert code == 0, out[-4000:]
    a = _read(tmp_path / "a")
    rows = a["rows"]
    assert len(rows) == STEPS * B * N
    # every sample has its own seed, distinct within its group (and here over the whole run)
    seeds = [r["seed"] for r in rows]
    assert NO_SEED not in seeds and len(set(seeds)) == len(seeds)
    for g in range(0, len(rows), N):
        assert [r["seed"] - rows[g]["seed"] for r in rows[g:g + N]] == list(range(N))
    # on-policy: every token of a row trained at step c comes from version c
    with RolloutReader(tmp_path / "a" / "rollouts.h5") as log:
        consumed = log.column("consumed_step").tolist()
    assert sorted(set(consumed)) == list(range(STEPS))
    assert all(set(r["versions"].tolist()) == {c} for r, c in zip(rows, consumed))
    # something was learned, or the weights' equality would say little
    assert all(m["grad_norm"] > 0 for m in a["metrics"])
    # a logged row regenerates from its seed and the policy it came from (version 0: the
    # initial model; tests/analysis/test_regenerate.py: a difference, and what it refuses)
    regen = ["-m", "areal_hpc.analysis.regenerate", str(tmp_path / "a")]
    r = jobs.run([*regen, "1"], timeout=300)
    assert r.returncode == 0 and "regenerated the same, tokens and log-probabilities bit for bit" \
        in r.stdout, (r.stdout, r.stderr[-3000:])
    later = consumed.index(1)
    r = jobs.run([*regen, str(later)], timeout=60)
    assert r.returncode == 2 and "--step 1" in r.stderr, r.stderr[-3000:]

    # The same config preempted (USR1, as Slurm's time-limit warning) while step STEPS/2's
    # batch is being generated (_preempt_mid_generation).
    args = _args(jobs, tiny_model, tmp_path, "b", "checkpoint.every_steps=0")
    run = tmp_path / "b"
    code, out = _finish(_preempt_mid_generation(jobs, run, args, STEPS // 2))
    assert code == 3, out[-4000:]
    done = _steps_done(run)
    assert done == STEPS // 2 and ck.find_latest(run)[1]["step"] == done
    partial = _partial(run)
    cut = [i for i, p in partial.items() if p[5] == "abort" and 0 < len(p[2]) < LONG_TOKENS]
    assert cut, ({i: (p[0], p[1], len(p[2]), p[5]) for i, p in partial.items()}, out[-4000:])
    ctrl = ck.read_state(ck.find_latest(run)[0] / ck.STATE)["controller"]
    referenced = {r for first, n in zip(ctrl.partial_first_row, ctrl.partial_rows)
                  for r in range(first, first + n)}
    assert referenced == set(partial)

    code, out = _finish(jobs.start(args))
    assert code == 0, out[-4000:]
    assert "generated again from their seeds" in out, out[-4000:]
    _check_log(run, STEPS, B * N)               # nothing lost, each step once, the audit agrees
    b = _read(run)
    with RolloutReader(run / "rollouts.h5") as log:
        kept = log.column("consumed_step") != PARTIAL
    assert int((~kept).sum()) == len(partial)
    b["rows"] = [r for r, k in zip(b["rows"], kept) if k]
    # a generated-again sample repeats its partial tokens, log-probabilities and versions
    keys = [(int(r["prompt_id"]), int(r["sample_idx"])) for r in b["rows"]]
    for i, (pid, idx, tokens, logprobs, versions, finish) in partial.items():
        row, k = b["rows"][keys.index((pid, idx))], len(tokens)
        assert row["output_tokens"][:k].tolist() == tokens.tolist()
        assert row["behav_logprobs"][:k].tolist() == logprobs.tolist()
        assert row["versions"][:k].tolist() == versions.tolist()
    assert _differences(a, b) == []
