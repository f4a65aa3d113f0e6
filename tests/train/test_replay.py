"""areal_hpc.replay: training replayed from a run's rollout log, without generators.

The batch order is checked against the controller's own ReadyBuffer (arrivals out of version
order, stale drops, a checkpoint/resume in between); the replay itself against a real tiny run
(mpiexec, vLLM, Megatron), whose logged losses it must reproduce; and its refusals (exit 2, one
line) on synthetic run directories."""
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from areal_hpc import replay
from areal_hpc.config import load, to_yaml
from areal_hpc.rollout.staleness import ReadyBuffer
from areal_hpc.storage.rollout_log import DROPPED_STALE, RolloutReader, RolloutWriter

N = 2   # group size of the synthetic logs
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def _traj(pid, idx, versions, rng):
    n_out = len(versions)
    return {
        "prompt_id": pid, "sample_idx": idx,
        "prompt_tokens": rng.integers(0, 100, 3, dtype=np.int32),
        "output_tokens": rng.integers(0, 100, n_out, dtype=np.int32),
        "behav_logprobs": -rng.random(n_out, dtype=np.float32),
        "versions": np.asarray(versions, dtype=np.int32),
        "reward": float(rng.integers(0, 2)), "finish_reason": "stop", "generator_rank": 1,
        "t_submit": 1.0, "t_first_token": 1.5, "t_end": 2.0,
    }


def _simulate(path, seed, steps=12, B=3, eta=2):
    """The controller's buffer bookkeeping (receive → log + buffer; drop stale; take B oldest
    first; a resume re-adds the checkpoint's buffered groups), logged to `path`. Returns each
    step's batch as the trainer got it: [(row, trajectory)] in batch order."""
    rng, gen = random.Random(seed), np.random.default_rng(seed)
    writer, buf = RolloutWriter(path), ReadyBuffer()
    version, pid, batches = 0, 0, []
    while version < steps:
        for _ in range(rng.randint(0, 4)):                  # groups arrive, any staleness
            oldest = max(0, version - rng.randint(0, eta + 1))
            trajs = []
            for i in range(N):
                vs = sorted([oldest if i == 0 else rng.randint(oldest, version)]
                            + [rng.randint(oldest, version) for _ in range(rng.randint(0, 3))])
                trajs.append(_traj(pid, i, vs, gen))
            buf.add(trajs, writer.append(trajs))
            pid += 1
        if rng.random() < 0.3:
            stale = buf.drop_older_than(version - eta)
            writer.mark_consumed([r for g in stale for r in g.rows], DROPPED_STALE)
        if rng.random() < 0.2:                              # checkpoint, then resume from it
            resumed = ReadyBuffer()
            for g in buf.groups():
                resumed.add(g.trajectories, g.rows)
            buf = resumed
        if len(buf) >= B:
            groups = buf.take(B)
            writer.mark_consumed([r for g in groups for r in g.rows], version)
            batches.append([(r, t) for g in groups for r, t in zip(g.rows, g.trajectories)])
            version += 1
    writer.close()
    return batches


@pytest.mark.parametrize("seed", range(6))
def test_batches_come_back_in_the_controllers_order(tmp_path, seed):
    path = tmp_path / "rollouts.h5"
    expected = _simulate(path, seed)
    b = replay.Batches(path, N)
    try:
        assert b.n_steps == len(expected)
        reordered = 0
        for s, want in enumerate(expected):
            trajs, rows = b.batch(s)
            assert rows == [r for r, _ in want]
            reordered += rows != sorted(rows)
            for got, (_, t) in zip(trajs, want):
                for key in ("prompt_tokens", "output_tokens", "behav_logprobs", "versions"):
                    assert got[key].dtype == t[key].dtype
                    np.testing.assert_array_equal(got[key], t[key])
                assert (got["reward"], got["prompt_id"], got["sample_idx"]) == \
                    (t["reward"], t["prompt_id"], t["sample_idx"])
    finally:
        b.close()
    assert reordered, "the simulation should take some groups out of row order"


def test_batch_order_sorts_by_oldest_version_then_row():
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replay.batch_order(groups, [2, 1, 2, 0]) == [[6, 7], [2, 3], [0, 1], [4, 5]]
    pid = np.array([5, 5, 5, 5, 6, 6])
    sidx = np.array([0, 1, 0, 1, 0, 1])
    assert replay.split_groups(np.array([0, 1, 2, 3, 4, 5]), pid, sidx) == [[0, 1], [2, 3], [4, 5]]
    assert replay.split_groups(np.array([0, 1, 4, 5]), pid, sidx) == [[0, 1], [4, 5]]


# ----------------------------------------------------------------------------- refusals

def _run_dir(tmp_path, *overrides, model=True):
    """A run directory with config.yaml (and a model directory with a config.json) only."""
    model_dir = tmp_path / "model"
    if model:
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir(parents=True)
    cfg = load(CONFIG, [f"model.path={model_dir}", f"output_dir={tmp_path}",
                                         "name=run", f"rollout.group_size={N}", *overrides])
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def _refused(capsys, *argv) -> str:
    assert replay.main([str(a) for a in argv]) == replay.EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_refuses_what_it_cannot_replay(tmp_path, capsys):
    assert "no such run directory" in _refused(capsys, tmp_path / "nope")
    run = _run_dir(tmp_path / "a")
    assert "no rollout log" in _refused(capsys, run)
    (run / "rollouts.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    assert "rollouts.h5" in _refused(capsys, run)                  # damaged
    (run / "rollouts.h5").unlink()
    w = RolloutWriter(run / "rollouts.h5")
    w.append([_traj(0, i, [0, 0], np.random.default_rng(i)) for i in range(N)])
    w.close()
    assert "no trajectory was consumed" in _refused(capsys, run)
    w = RolloutWriter.reopen(run / "rollouts.h5", keep_rows=2)
    w.mark_consumed([0, 1], 1)                                     # step 1, but no step 0
    w.close()
    assert "no row holds step 0" in _refused(capsys, run)
    w = RolloutWriter.reopen(run / "rollouts.h5", keep_rows=2)
    w.mark_consumed([0, 1], 0)
    w.close()
    assert "only 1 step(s)" in _refused(capsys, run, "--steps", 3)
    assert "no logged loss" in _refused(capsys, run, "--check")     # no metrics.jsonl
    w = RolloutWriter.reopen(run / "rollouts.h5", keep_rows=2)
    w.mark_consumed([1], -1)                                       # half a group trained
    w.close()
    assert "not a whole group" in _refused(capsys, run)

    assert "tp=2" in _refused(capsys, _run_dir(tmp_path / "b", "topology.n_trainers=2",
                                               "topology.tp=2"))
    assert "dp=2" in _refused(capsys, _run_dir(tmp_path / "c", "topology.n_trainers=2"))
    assert "is gone" in _refused(capsys, _run_dir(tmp_path / "d", model=False))
    (tmp_path / "e").mkdir()
    assert "config.yaml" in _refused(capsys, tmp_path / "e")


# ----------------------------------------------------------------------------- a real run

def test_replay_reproduces_a_tiny_run(reward_fn_run, jobs, tmp_path, capsys):
    """A real run (the session's `reward_fn_run`, tests/conftest.py: async, η = 1, two
    minibatches per step, so the minibatch split depends on the batch order), replayed: every
    step's loss and grad_norm come out bit-identical to the logged ones (same machine, code and
    thread count), from the logged rows, and the weights after the last step are the run's
    final policy, bit for bit."""
    steps, B, n = reward_fn_run["steps"], reward_fn_run["B"], reward_fn_run["n"]
    run, out = reward_fn_run["run"], tmp_path / "replayed"

    assert f"only {steps} step(s)" in _refused(capsys, run, "--steps", steps + 1)
    t0 = time.monotonic()
    rr = jobs.run(["-m", "areal_hpc.replay", str(run), "--check", "--out", str(out)], timeout=600)
    took = time.monotonic() - t0
    assert rr.returncode == 0, (rr.stdout[-3000:], rr.stderr[-6000:])
    print(rr.stdout, f"replay took {took:.1f}s", sep="\n")
    assert f"{steps} of {steps} step(s) bit-identical" in rr.stdout

    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (out / "replay.jsonl").read_text().splitlines()]
    with RolloutReader(run / "rollouts.h5") as log:
        consumed = log.column("consumed_step")
    assert [x["step"] for x in lines] == [m["step"] for m in metrics] == list(range(steps))
    assert sum((m["grad_norm"] or 0) > 0 for m in metrics) >= steps // 2, metrics
    for x, m in zip(lines, metrics):
        assert sorted(x["rows"]) == np.flatnonzero(consumed == x["step"]).tolist()
        assert x["replayed"]["n_tokens"] == m["n_tokens"] and x["replayed"]["n_seqs"] == B * n
        assert x["replayed"]["n_micro_batches"] == m["n_micro_batches"]
        assert (x["loss"], x["grad_norm"]) == (m["loss"], m["grad_norm"])
        assert x["replayed"]["lr"] == m["lr"] and x["replayed"]["approx_kl"] == m["approx_kl"]
    final, replayed = load_file(run / "policy" / "model.safetensors"), \
        load_file(out / "policy" / "model.safetensors")
    assert final.keys() == replayed.keys()
    for k in final:
        np.testing.assert_array_equal(final[k], replayed[k], err_msg=k)

    # --check fails on a loss off by more than the tolerance (here: a doctored metrics.jsonl),
    # through the tools/ wrapper, for the first step only
    doctored = tmp_path / "doctored"
    doctored.mkdir()
    for name in ("config.yaml", "rollouts.h5"):
        shutil.copy(run / name, doctored / name)
    m0 = {**metrics[0], "loss": metrics[0]["loss"] + 2e-3 * metrics[0]["adv_abs_mean"]}
    (doctored / "metrics.jsonl").write_text(json.dumps(m0) + "\n")
    rr = jobs.run(["tools/replay_run.py", str(doctored), "--steps", "1", "--check"], timeout=600)
    assert rr.returncode == replay.EXIT_DIFFERS, (rr.stdout[-3000:], rr.stderr[-6000:])
    assert "step(s) [0]: loss differs by more than the tolerance" in rr.stdout
