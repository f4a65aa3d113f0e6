"""The analysis CLI: plots, export, --show, several runs, a log still being written, bad files."""
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from areal_hpc.analysis.cli import main
from areal_hpc.analysis.load import COLUMNS
from areal_hpc.storage.rollout_log import RolloutWriter

ROOT = Path(__file__).resolve().parents[2]
PLOTS = ("reward.png", "staleness.png", "lengths.png", "throughput.png")


def _overview_value(out: str, label: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"│ {label} "))
    return [c.strip() for c in line.strip("│").split("│")][1:]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_plots_and_export(known_log, tmp_path, capsys, fmt):
    out = tmp_path / "out"
    assert main([str(known_log), "--out", str(out), "--export", fmt]) == 0
    printed = capsys.readouterr().out
    assert _overview_value(printed, "trajectories") == ["10"]
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    df = pd.read_csv(out / "trajectories.csv") if fmt == "csv" else \
        pd.read_parquet(out / "trajectories.parquet")
    assert list(df.columns) == list(COLUMNS) and len(df) == 10
    assert df["output_len"].sum() == 32 and df["correct"].sum() == 5
    assert df["finish_reason"].tolist()[:3] == ["stop", "stop", "length"]


def test_default_out_is_beside_the_log(known_log, capsys):
    assert main([str(known_log)]) == 0
    assert all((known_log.parent / "analysis" / name).is_file() for name in PLOTS)


def test_two_runs_side_by_side(tmp_path, capsys, write_log):
    a = write_log(tmp_path / "a" / "rollouts.h5", name="sync")
    b = write_log(tmp_path / "b" / "rollouts.h5", name="async")
    out = tmp_path / "out"
    assert main([str(a), str(b), "--out", str(out), "--export", "parquet", "--bin-s", "5"]) == 0
    printed = capsys.readouterr().out
    header = next(x for x in printed.splitlines() if "sync" in x and "async" in x)
    assert header.index("sync") < header.index("async")
    assert _overview_value(printed, "trajectories") == ["10", "10"]
    assert "sync: per training step" in printed and "async: per training step" in printed
    df = pd.read_parquet(out / "trajectories.parquet")
    assert len(df) == 20 and df.groupby("run").size().to_dict() == {"async": 10, "sync": 10}
    assert all((out / name).stat().st_size > 5000 for name in PLOTS)


def test_learning_curves_from_the_run_directory(tmp_path, capsys, write_log):
    """With metrics.jsonl and eval.json beside the log: learning.png (held-out accuracy by step,
    the reward raw and smoothed, ESS, KL, the cut share); without them, no such plot."""
    from areal_hpc.analysis.plots import smoothed
    from areal_hpc.storage.run_dir import RunDir

    log = write_log(tmp_path / "r" / "rollouts.h5", name="r")
    run = RunDir(log.parent)
    for step in range(12):
        run.append_metrics({"step": step, "reward": step % 3 / 2, "ess": 0.9 - step / 40,
                            "seq_ess": 0.8, "kl_behav": step / 100, "truncated_frac": 0.1})
    run.write_evals([{"label": "initial", "step": 0, "accuracy": 0.1},
                     {"label": "final", "step": 12, "accuracy": 0.3}])
    out = tmp_path / "out"
    assert main([str(log), "--out", str(out)]) == 0
    data = (out / "learning.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000
    bare = write_log(tmp_path / "bare" / "rollouts.h5", name="bare")
    assert main([str(bare), "--out", str(tmp_path / "out2")]) == 0
    assert not (tmp_path / "out2" / "learning.png").exists()
    # the smoothing: debiased EMA (a constant stays itself; a step moves towards the new level)
    assert smoothed([2.0] * 5).tolist() == [2.0] * 5
    s = smoothed([0.0] * 5 + [1.0] * 20, span=3)
    assert s[4] == 0.0 and 0.4 < s[5] < 0.6 and s[-1] > 0.99


def test_same_names_get_distinct_labels(tmp_path, capsys, write_log):
    a = write_log(tmp_path / "a" / "rollouts.h5", name="x")
    b = write_log(tmp_path / "b" / "rollouts.h5", name="x")
    assert main([str(a), str(b), "--no-plots"]) == 0
    header = next(x for x in capsys.readouterr().out.splitlines() if "┃" in x)
    assert [c.strip() for c in header.strip("┃").split("┃")][1:] == ["a", "b"]


def test_show_decodes_with_the_tokenizer(known_log, known, trained_tiny_model, capsys):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(trained_tiny_model)
    assert main([str(known_log), "--no-plots", "--show", "2", "--tokenizer", str(trained_tiny_model)]) == 0
    printed = capsys.readouterr().out
    trajs, _ = known
    for i in (0, 9):        # first and last row
        assert f"known row {i}  prompt {trajs[i]['prompt_id']} sample {trajs[i]['sample_idx']}" in printed
        assert f"answer {tok.decode(trajs[i]['output_tokens'], skip_special_tokens=True)}" in printed
    assert "versions 2  pending" in printed


def test_show_without_a_tokenizer_prints_ids(known_log, capsys):
    assert main([str(known_log), "--no-plots", "--show", "3"]) == 0
    printed = capsys.readouterr().out
    assert "no tokenizer found" in printed
    assert "answer 10 11 12 13" in printed                    # row 0's output tokens
    assert "versions 0→2 (interrupted)" in printed            # row 4, spread pick 0, 4, 9
    assert "reward error: reward worker process died" in printed


def _analyse(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_hpc.analysis", str(path), "--no-plots"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_log_still_being_written(tmp_path, known):
    """SWMR: the analysis reads as of the moment it opens the log, while the writer goes on."""
    trajs, _ = known
    path = tmp_path / "live" / "rollouts.h5"
    w = RolloutWriter(path, config_yaml="name: live\n")
    try:
        w.append(trajs[:4])
        w.mark_consumed([0, 1], 0)
        first = _analyse(path)
        assert first.returncode == 0, first.stderr
        assert _overview_value(first.stdout, "trajectories") == ["4"]
        assert _overview_value(first.stdout, "training steps") == ["1"]
        w.append(trajs[4:])
        second = _analyse(path)
        assert second.returncode == 0, second.stderr
        assert _overview_value(second.stdout, "trajectories") == ["10"]
    finally:
        w.close()


def _bad_files(tmp_path, known_log):
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5\n")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    partial = tmp_path / "partial.h5"           # a rollout log without its token arrays
    with h5py.File(partial, "w") as f:
        f.attrs["schema_version"] = 2
        f.create_group("traj")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(known_log.read_bytes()[: known_log.stat().st_size // 2])
    return {"missing": (tmp_path / "nope.h5", "no such file"), "text": (text, "not an HDF5 file"),
            "foreign": (foreign, "not a rollout log"), "partial": (partial, "not a rollout log"),
            "truncated": (truncated, "truncated HDF5 file")}


@pytest.mark.parametrize("kind", ["missing", "text", "foreign", "partial", "truncated"])
def test_bad_file_is_one_line_and_exit_2(tmp_path, known_log, capsys, kind):
    path, message = _bad_files(tmp_path, known_log)[kind]
    assert main([str(known_log), str(path), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and message in err[0], err


def test_bad_file_from_the_command_line(tmp_path, known_log):
    path, _ = _bad_files(tmp_path, known_log)["truncated"]
    r = subprocess.run([sys.executable, "tools/analyze_rollouts.py", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {path}: truncated HDF5 file " \
        f"({path.stat().st_size} bytes, the file says {known_log.stat().st_size})"


def test_empty_log(tmp_path, capsys):
    path = tmp_path / "empty" / "rollouts.h5"
    RolloutWriter(path).close()
    assert main([str(path)]) == 1
    assert "no trajectories yet" in capsys.readouterr().err
