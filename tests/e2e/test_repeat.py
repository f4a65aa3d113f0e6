"""A synchronous run repeats bit for bit on CPU (issue 30): two runs of one config give the same
rollout log (times apart), the same metrics (times apart), the same held-out evaluations and the
same final weights, the second one checkpointing after every step.

What makes it so: every sample draws from its own seed (rollout.per_request_seeds, on here), so
its tokens do not depend on how vLLM happened to batch it (without the seeds two such runs
differed from the first sample's first tokens: 102 differences in this comparison); in sync mode the generator sends the
scored groups in the order their prompts came, so the batch (and the log's rows) come in one
order; the trainer's side was exact already (tools/replay_run.py --check)."""
import json

import numpy as np
from safetensors.numpy import load_file

from areal_hpc.storage.rollout_log import NO_SEED, RolloutReader

STEPS, B, N = 3, 2, 2
TIME_FIELDS = {"t_submit", "t_first_token", "t_end"}


def _timeless(value):
    """A metrics or eval record without its times (keys ending in _s, seconds, time, per_s)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items()
                if not k.endswith(("_s", "seconds", "time", "per_s"))}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _run(jobs, model, out, name, *extra):
    fn = out / "by_length.py"       # rewards that differ within a group: the loss is not 0
    fn.write_text("def by_length(completion, reference, row):\n"
                  "    return (len(completion) % 7) / 8\n")
    r = jobs.run(jobs.args(model, out, name, f"reward.fn={fn}:by_length", f"train.total_steps={STEPS}",
                           f"train.batch_prompts={B}", f"rollout.group_size={N}",
                           "rollout.max_new_tokens=24", "rollout.mode=sync",
                           "rollout.per_request_seeds=true",
                           "data.eval_limit=4", "data.eval_samples=2", "data.eval_every_steps=2",
                           "tensorboard=false", *extra), timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    run = out / name
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


def test_sync_runs_repeat_bit_for_bit(jobs, tiny_model, tmp_path):
    a = _run(jobs, tiny_model, tmp_path, "a", "checkpoint.every_steps=0")
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
    # The second run checkpoints after every step: equal to the first, it shows both that a run
    # repeats and that saving a checkpoint disturbs nothing (trainer, optimizer, RNG, π_prox).
    b = _run(jobs, tiny_model, tmp_path, "b", "checkpoint.every_steps=1")
    assert _differences(a, b) == []
