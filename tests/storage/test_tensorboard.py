"""The TensorBoard mirror of metrics.jsonl: each step once, at its wall-clock time, across resumes."""
import json
import math

from areal_hpc.storage.tensorboard import TensorBoardLog, read_scalars, tag_of


def _row(step, t0=1.7e9):
    return {"step": step, "version": step + 1, "loss": 0.1 * step, "reward": 0.5, "clip_frac": 0.0,
            "seconds": 1.5, "reward/format": 1.0, "grad_norm": math.nan, "label": "x",
            "time": t0 + 10 * step}


def _append(run_dir, rows):
    with open(run_dir / "metrics.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_tags_group_the_fields():
    assert [tag_of(k) for k in ("loss", "reward", "staleness_mean", "weight_sync_s", "seconds",
                                "reward/format", "gen_tok_per_s")] == [
        "train/loss", "rollout/reward", "rollout/staleness_mean", "time/weight_sync_s",
        "time/seconds", "reward/format", "time/gen_tok_per_s"]
    assert [tag_of(k) for k in ("engine_restarts", "generators_live")] == [
        "rollout/engine_restarts", "rollout/generators_live"]


def test_a_resume_rebuilds_the_files_so_each_step_is_there_once(tmp_path):
    evals = [{"label": "initial", "step": 0, "accuracy": 0.1, "time": 1.7e9 - 5}]
    tb = TensorBoardLog.open(tmp_path, evals)
    for s in range(5):                     # an attempt trains 5 steps, then is killed
        _append(tmp_path, [_row(s)])
        tb.step(_row(s))
    tb.writer.flush()                      # (killed: never closed)
    assert [p[0] for p in read_scalars(tmp_path)["train/loss"]] == [1, 2, 3, 4, 5]
    # the resume from the checkpoint at 3 drops steps 3 and 4 from metrics.jsonl (trainer._resume)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()[:3]
    (tmp_path / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))
    tb = TensorBoardLog.open(tmp_path, evals)
    for s in range(3, 6):
        tb.step(_row(s, t0=1.8e9))
    tb.evaluation({"label": "final", "step": 6, "accuracy": 0.3, "pass@4": 0.5, "time": 1.8e9 + 60})
    tb.close()
    got = read_scalars(tmp_path)
    assert [p[0] for p in got["train/loss"]] == [1, 2, 3, 4, 5, 6]          # no step twice, no gap
    assert [round(p[1], 6) for p in got["train/loss"]] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert [p[2] for p in got["train/loss"]][2:4] == [1.7e9 + 20, 1.8e9 + 30]  # each at its time
    assert [(p[0], round(p[1], 6)) for p in got["eval/accuracy"]] == [(0, 0.1), (6, 0.3)]
    assert got["eval/pass@4"][0][:2] == (6, 0.5)
    assert "train/grad_norm" not in got and "train/label" not in got   # NaN and text are left out
    assert [p[0] for p in got["reward/format"]] == [1, 2, 3, 4, 5, 6]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_generator_totals_are_written_at_the_last_step(tmp_path):
    (tmp_path / "generators.json").write_text(json.dumps([{
        "rank": 1, "tokens": 1000, "version": 4, "reward": {"calls": 10, "errors": 1},
        "seconds": {"busy": 8.0, "pause": 1.0, "eval": 2.0, "idle": 1.0, "idle_scoring": 0.0}}]))
    tb = TensorBoardLog.open(tmp_path)
    tb.generators(tmp_path, 4)
    tb.close()
    got = read_scalars(tmp_path)
    assert (got["generator/1/busy_share"][0][0], round(got["generator/1/busy_share"][0][1], 6)) == (4, 0.8)
    assert got["generator/1/reward_errors"][0][1] == 1.0
