"""End to end on the real stack: mpiexec → trainer rank (Megatron-core) + generator rank (vLLM),
trajectories over MPI, weights over a gloo group, rollouts in HDF5."""
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.storage.rollout_log import DROPPED_STALE, RolloutReader

# (Sync mode's run, on-policy rows and all, is tests/e2e/test_repeat.py's.)
def test_short_run_eta_1(reward_fn_run):
    """The session's `reward_fn_run` (tests/conftest.py: async, η = 1, one generator; its reward
    function and chat template change nothing checked here), checked as a short run
    (`_check_short_run`)."""
    k = reward_fn_run
    _check_short_run(k["run"], k["stdout"], k["steps"], k["B"], k["n"], "async", 1, 1)


def test_short_run_eta_4_two_generators_guarded(jobs, tiny_model, tmp_path):
    """η = 4 on two generators (mpiexec -n 3), with an off-policy correction and the collapse
    guards on: their diagnostics are in metrics.jsonl and the groups they leave out are counted
    and balanced by the audit; otherwise checked as a short run (`_check_short_run`)."""
    steps, B, n, eta, generators = 3, 2, 2, 4, 2
    r = jobs.run(jobs.args(tiny_model, tmp_path, "e2e", f"train.total_steps={steps}",
                           f"train.batch_prompts={B}", f"rollout.group_size={n}",
                           "rollout.max_new_tokens=24", "rollout.mode=async",
                           f"rollout.max_staleness={eta}", f"topology.n_generators={generators}",
                           "data.eval_limit=6", "data.eval_samples=1", "data.eval_every_steps=2",
                           "train.off_policy=token_mask", "train.behav_kl_coef=0.01",
                           "train.filter_zero_variance=true", "train.overlong=filter"),
                 timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    _check_short_run(tmp_path / "e2e", r.stdout, steps, B, n, "async", eta, generators)
    assert not jobs.leftovers(), "processes of the job are still running"


def _check_short_run(run, stdout, steps, B, n, mode, eta, generators):
    """A few steps; from rollouts.h5: every step took B groups, no trained token is older than η,
    weight updates reached the generators mid-run (at η = 1: at η = 4 the window may let every
    group come from the first weights; every update still reaches every generator by the end,
    generators.json), groups never span generators, and nothing was generated for a step the
    run never takes; the evaluations at the start, at step 2 (data.eval_every_steps) and at the
    end. At η = 4, with the guards on, their figures."""
    guarded = eta == 4
    assert "held-out accuracy" in stdout
    evals = json.loads((run / "eval.json").read_text())
    assert [(e["label"], e["step"]) for e in evals] == [("initial", 0), ("step 2", 2), ("final", steps)]
    assert evals[-1]["version"] == steps                    # the final policy was evaluated
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    clock = [m["elapsed_s"] for m in metrics]
    assert clock == sorted(clock) and clock[0] > 0 and all(m["time"] > 1.7e9 for m in metrics)
    for m in metrics:       # the diagnostics of every step: measured, or null without a forward
        if m["n_tokens"]:
            assert 0 < m["ess"] <= 1 and 0 < m["seq_ess"] <= 1 and m["kl_behav"] >= 0, m
        else:
            assert m["no_signal_steps"] == 1 and m["ess"] is m["kl_behav"] is m["loss"] is None, m
        assert 0 <= m["truncated_frac"] <= 1 and m["entropy"] > 0 and 0 <= m["zero_var_groups"] <= B
        cut = round(m["truncated_frac"] * B * n)
        if guarded:     # the zero-variance groups' samples and the cut ones, each once
            assert n * m["zero_var_groups"] <= m["filtered_seqs"] <= n * m["zero_var_groups"] + cut, m
        else:
            assert m["filtered_seqs"] == 0, m
    if guarded:
        from areal_hpc.audit import audit
        report = audit(run)
        assert report.ok, report.text()
        assert "group(s) without learning signal" in report.text()
        zero = sum(m["zero_var_groups"] for m in metrics)
        assert f"{zero} group(s) without learning signal over {steps} steps" in report.text()
    with RolloutReader(run / "rollouts.h5") as log:
        rows = [log[i] for i in range(len(log))]
        consumed = log.column("consumed_step")
        assert f"total_steps: {steps}" in log.config_yaml
    assert sorted({c for c in consumed.tolist() if c >= 0}) == list(range(steps))
    assert (consumed >= 0).sum() == steps * B * n           # each step took exactly B groups
    # the η window is capped at total_steps: every logged group was trained or dropped as stale
    assert set(consumed.tolist()) <= set(range(steps)) | {DROPPED_STALE}, sorted(set(consumed.tolist()))
    for row in rows:
        assert len(row["output_tokens"]) == len(row["behav_logprobs"]) == len(row["versions"]) >= 1
        assert np.all(row["behav_logprobs"] <= 0)
        assert np.all(np.diff(row["versions"]) >= 0)       # versions never go back within a sample
    versions = sorted({int(v) for row in rows for v in row["versions"]})
    # the last batch is issued η versions before its step at the earliest (the η window), so at
    # η < steps - 1 its tokens come from updated weights: an update reached a generator mid-run
    if eta < steps - 1:
        assert versions[-1] >= steps - 1 - eta, versions
    for row, c in zip(rows, consumed):
        if c >= 0:
            assert c - row["versions"].min() <= eta         # η held for every trained token
            if mode == "sync":                              # on-policy: one version, the current
                assert set(row["versions"].tolist()) == {c}
    # a group's n rows are appended together, from one generator (a prompt dropped as too stale
    # is issued again under the same id: its groups may come from different generators)
    assert len(rows) % n == 0
    groups = [rows[i:i + n] for i in range(0, len(rows), n)]
    for g in groups:
        assert len({r["prompt_id"] for r in g}) == 1 and len({r["generator_rank"] for r in g}) == 1
    used = {g[0]["generator_rank"] for g in groups}
    assert used <= set(range(1, 1 + generators))
    if generators > 1:
        assert len(used) == generators
    assert (run / "policy" / "config.json").exists() and (run / "eval.json").exists()
    # Each generator's time buckets add up to its whole span (first prompt until the last batch
    # is taken): at least from its first sample's submission to its last sample's end, at most
    # until now.
    stats = json.loads((run / "generators.json").read_text())
    assert sorted(g["rank"] for g in stats) == list(range(1, 1 + generators))
    for g in stats:
        assert g["version"] == steps, g                     # every update reached every generator
        sec = g["seconds"]
        assert set(sec) == {"busy", "pause", "eval", "idle", "idle_scoring", "submit", "send",
                            "other"} and min(sec.values()) >= 0
        mine = [r for r in rows if r["generator_rank"] == g["rank"]]
        first = min(r["t_submit"] for r in mine)
        assert max(r["t_end"] for r in mine) - first - 0.5 <= sum(sec.values()) <= time.time() - first, sec
        # The engine had work at least while the loop was inside its step, at most the span.
        span = sum(v for k, v in sec.items() if k != "eval")
        assert sec["busy"] - 1e-6 <= g["engine_s"] <= span + 1e-6, g


def test_code_dataset_is_scored_in_the_sandbox(jobs, tiny_model, tmp_path):
    """A code-kind dataset: every sample is run against its tests by the reward pool. The tiny
    model writes sums, not programs, so every reward is 0: what shows that the sandbox judged
    each one is the per-step mean of the tests run (one per sample) and passed (none), which
    only a code call that ran its program reports (a math call on the same text, or a grader
    error, logs neither)."""
    import json
    data = tmp_path / "code.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+1=", "tests": [{"input": "", "output": str(i + 1)}]}) + "\n")
    r = jobs.run(jobs.args(tiny_model, tmp_path, "code", "data.kind=code", f"data.train_path={data}",
                       "data.eval_path=null", "data.question_key=prompt", "data.answer_key=tests",
                       "train.total_steps=2", "train.batch_prompts=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=16"), timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    assert "errors 0, timeouts 0" in r.stderr
    metrics = [json.loads(x) for x in (tmp_path / "code" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_errors"] for m in metrics] == [0, 0]      # counted per step
    assert [(m["reward/code_tests_run"], m["reward/code_tests_passed"]) for m in metrics] \
        == [(1.0, 0.0)] * 2, metrics
    with RolloutReader(tmp_path / "code" / "rollouts.h5") as log:
        assert len(log) >= 8 and set(log.column("reward").tolist()) == {0.0}


def test_a_user_reward_function_scores_the_samples(reward_fn_run, tiny_model):
    """reward.fn from a file: the generators' reward pool calls it on every sample, with the
    dataset row; rollouts.h5 holds its values and metrics.jsonl the fields it logged. The
    prompts go through a chat template (data.chat, the template from a file). The job is the
    session's `reward_fn_run` (tests/conftest.py)."""
    from transformers import AutoTokenizer
    run = reward_fn_run["run"]
    assert "errors 0, timeouts 0" in reward_fn_run["stderr"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with RolloutReader(run / "rollouts.h5") as log:
        rows = [log[i] for i in range(len(log))]
        consumed = log.column("consumed_step")
    assert len(rows) >= 4
    texts = [tok.decode(row["output_tokens"], skip_special_tokens=True) for row in rows]
    for row, text in zip(rows, texts):
        assert row["reward"] == (len(text) % 7) / 8, (row["reward"], text)
    # Every prompt is a train question rendered through the template (not the plain question).
    from areal_hpc.config import load
    from areal_hpc.data.prompts import load_prompts, prompt_ids
    data = load(run / "config.yaml").data
    questions = [q["question"] for q in load_prompts(f"{tiny_model}/train.jsonl")]
    rendered = {tuple(prompt_ids(tok, data, q)) for q in questions}
    assert all(tuple(row["prompt_tokens"]) in rendered for row in rows)
    plain = tok(questions[0], add_special_tokens=False)["input_ids"]
    assert prompt_ids(tok, data, questions[0]) != plain
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == reward_fn_run["steps"]
    for m in metrics:      # the extra field: the mean over the step's samples
        lens = [len(t) for t, c in zip(texts, consumed) if c == m["step"]]
        assert m["reward/chars"] == pytest.approx(sum(lens) / len(lens))


def test_world_too_small_is_a_clear_error(jobs, tiny_model, tmp_path):
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", "1", sys.executable, "-m", "mpi4py", "-m", "areal_hpc.main",
           "configs/tiny_cpu.yaml", f"model.path={tiny_model}", f"data.train_path={tiny_model}/train.jsonl",
           f"data.eval_path={tiny_model}/heldout.jsonl", f"output_dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=jobs.root, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "MPI world has 1 rank(s) but the config asks for 2" in r.stderr


def test_missing_model_dir_is_a_clear_error(jobs, tmp_path):
    r = jobs.run(["-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml", f"model.path={tmp_path}/nope",
              f"output_dir={tmp_path}"], timeout=120)
    assert r.returncode == 2
    assert "no HF model at" in r.stderr and "Traceback" not in r.stderr
