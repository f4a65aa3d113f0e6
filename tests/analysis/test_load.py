"""A rollout log with bad rows (values no writer of today stores: an inf reward an older writer
did, a negative policy version): readers name the file, the row and the field in one line, and
go on without those rows where asked to (`skip_bad`, `--skip-bad-rows`)."""
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest

from areal_hpc.analysis.cli import EXIT_BAD_FILE, main
from areal_hpc.analysis.load import load_run
from areal_hpc.storage.rollout_log import RolloutLogError, RolloutReader

BAD = {2: ("traj/reward", np.inf, "reward is not a finite number: inf"),
       4: ("tokens/versions", -5, "versions is negative: -5")}


@pytest.fixture
def bad_log(known_log, tmp_path):
    """KNOWN with row 2's reward inf (as a writer before the write-time check stored 1e300) and
    row 4's first token version negative, written through HDF5 (checksums hold)."""
    path = tmp_path / "bad" / "rollouts.h5"
    path.parent.mkdir()
    shutil.copy(known_log, path)
    with h5py.File(path, "r+") as f:
        f["traj/reward"][2] = np.inf
        start = int(f["traj/output_end"][3])
        f["tokens/versions"][start] = -5
    return path


def test_strict_by_default_naming_the_row_and_the_option(bad_log):
    with pytest.raises(RolloutLogError) as e:
        load_run(bad_log, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and str(bad_log) in msg and "row 2: reward is not a finite number" in msg
    assert "--skip-bad-rows" in msg and "skip_bad=True" in msg
    with RolloutReader(bad_log) as r, pytest.raises(RolloutLogError, match="row 4: versions is negative"):
        r.tokens("versions")


def test_skip_bad_leaves_out_the_bad_rows_and_names_them(known_log, bad_log):
    clean, run = load_run(known_log, progress=False), load_run(bad_log, progress=False, skip_bad=True)
    assert run.skipped == {row: why for row, (_, _, why) in BAD.items()}
    assert run.traj["row"].tolist() == [0, 1, 3, 5, 6, 7, 8, 9]
    kept = clean.traj[~clean.traj["row"].isin(list(BAD))].reset_index(drop=True)
    pd.testing.assert_frame_equal(run.traj.drop(columns="run"), kept.drop(columns="run"))
    # rows 2 and 4 were consumed (steps 1 and 2) with 6 and 3 tokens: out of the histogram too
    assert sum(run.token_staleness.values()) == sum(clean.token_staleness.values()) - 9
    with RolloutReader(bad_log, skip_bad=True) as r:
        assert np.isinf(r.column("reward")[2]) and r.bad == {2: BAD[2][2]}   # as stored, named
        with pytest.raises(RolloutLogError, match="row 2: reward"):
            r[2]                                    # a bad row asked for by index is an error


def test_skip_bad_does_not_skip_a_damaged_structure(known_log, tmp_path):
    path = tmp_path / "r.h5"
    shutil.copy(known_log, path)
    with h5py.File(path, "r+") as f:
        f["traj/output_end"][4] = 3                 # offsets that go backwards: no row to skip
    with pytest.raises(RolloutLogError, match="row 4: output_end is an offset that goes backwards"):
        load_run(path, progress=False, skip_bad=True)


def test_the_cli_refuses_in_one_line_or_skips_where_asked(bad_log, tmp_path, capsys):
    assert main([str(bad_log), "--no-plots"]) == EXIT_BAD_FILE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 2: reward is not a finite number" in err[0]
    assert "--skip-bad-rows" in err[0]
    out = tmp_path / "out"
    assert main([str(bad_log), "--skip-bad-rows", "--out", str(out), "--export", "csv",
                 "--show", "3"]) == 0
    printed = capsys.readouterr()
    assert printed.err.splitlines() == [f"{bad_log}: row {row} left out: {why}"
                                        for row, (_, _, why) in BAD.items()]
    df = pd.read_csv(out / "trajectories.csv")
    assert df["row"].tolist() == [0, 1, 3, 5, 6, 7, 8, 9] and np.isfinite(df["reward"]).all()
    assert (out / "reward.png").stat().st_size > 5000
    assert "known row 9 " in printed.out and "known row 4 " not in printed.out   # the file's rows
