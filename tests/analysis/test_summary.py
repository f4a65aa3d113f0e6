"""Every number of the summary on a log with known content (tests/analysis/conftest.py KNOWN),
computed by hand below, then the same numbers as the rich tables print them."""
import math

import numpy as np
import pytest
from rich.console import Console

from areal_hpc.analysis import report, summary as S
from areal_hpc.analysis.load import COLUMNS, load_run
from areal_hpc.storage.rollout_log import PARTIAL, RolloutWriter

# Output lengths 4 2 6 3 3 2 1 5 4 2 (32 tokens); prompt lengths sum to 34. Trained rows 0-5 at
# steps 0, 0, 1, 1, 2, 2; rows 6-7 dropped as stale, rows 8-9 pending.
# Per-token staleness of trained rows (step − version): row 0: 0000, row 1: 00, row 2: 110000,
# row 3: 000, row 4: 210, row 5: 11 → 14 zeros, 5 ones, 1 two (20 tokens).
EXPECTED_OVERVIEW = {
    "trajectories": 10, "prompts": 5, "output_tokens": 32, "prompt_tokens": 34, "steps": 3,
    "trained": 6, "pending": 2, "dropped_stale": 2, "failed": 0, "partial": 0,
    "reward_mean": 5.5 / 10, "accuracy": 5 / 10,           # 0.5 is not > 0.5
    "interrupted_share": 2 / 10,                            # rows 2 and 4
    "staleness_mean": 7 / 20, "staleness_p50": 0, "staleness_p95": 1, "staleness_max": 2,
    "traj_staleness_mean": (0 + 0 + 1 + 0 + 2 + 1) / 6, "traj_staleness_max": 2,
    "length_mean": 3.2, "length_p50": 3, "length_p90": 5, "length_p99": 6, "length_max": 6,
    "truncated_share": 2 / 10, "wall_s": 9.0, "tokens_per_s": 32 / 9,
    "reward_errors": 2, "reward_timeouts": 1,
    "turns_mean": 1.0, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0,   # single-turn
    "discarded": 0, **{f"discarded_{c}": 0 for c in ("timeout", "died", "raised", "refused", "env")},
}


def test_partial_rows_are_counted_apart(known_log, known):
    """Rows saved at a preemption (PARTIAL) are prefixes of rows a resume appends later: the
    statistics leave them out, and the overview counts them."""
    trajs, _ = known
    w = RolloutWriter.reopen(known_log, len(trajs))
    w.append([dict(t, finish_reason="abort", reward=0.0) for t in trajs[8:10]], consumed=PARTIAL)
    w.close()
    got = S.overview(load_run(known_log, progress=False))
    assert got == pytest.approx({**EXPECTED_OVERVIEW, "partial": 2}, abs=1e-9, nan_ok=True)


@pytest.fixture
def run(known_log):
    return load_run(known_log, progress=False)


def test_overview(run):
    got = S.overview(run)
    assert set(got) == {k for k, _, _ in S.OVERVIEW_FIELDS}
    for key, want in EXPECTED_OVERVIEW.items():
        assert got[key] == pytest.approx(want, abs=1e-9), key
    assert run.token_staleness == {0: 14, 1: 5, 2: 1}


def test_per_trajectory_columns(run):
    t = run.traj
    assert list(t.columns) == list(COLUMNS) and len(t) == 10
    assert t["version_first"].tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 2, 2]
    assert t["version_last"].tolist() == [0, 0, 1, 1, 2, 1, 0, 0, 2, 2]
    assert t["version_changes"].tolist() == [0, 0, 1, 0, 2, 0, 0, 0, 0, 0]
    assert t["consumed_step"].tolist() == [0, 0, 1, 1, 2, 2, -2, -2, -1, -1]
    np.testing.assert_array_equal(t["staleness"], [0, 0, 1, 0, 2, 1] + [np.nan] * 4)
    assert t["reward_error"].tolist()[3:5] == ["timeout after 10 s", "reward worker process died"]
    assert t["latency_s"].tolist() == [3, 2, 5, 3, 4, 4, 1, 5, 3, 2]
    assert t["run"].unique().tolist() == ["known"]


def test_by_step(run):
    df = S.by_step(run)
    assert df["first"].tolist() == df["last"].tolist() == [0, 1, 2]
    assert df["trajectories"].tolist() == [2, 2, 2]
    assert df["reward"].tolist() == [1.0, 0.5, 0.5]
    assert df["accuracy"].tolist() == [1.0, 0.5, 0.5]
    assert df["length_mean"].tolist() == [3.0, 4.5, 2.5]
    assert df["staleness_mean"].tolist() == [0.0, 0.5, 1.5]
    assert df["time_s"].tolist() == pytest.approx([3, 5, 6])   # last trajectory of each step
    binned = S.by_step(run, max_rows=2)                        # steps 0-1 and 2
    assert binned["first"].tolist() == [0, 2] and binned["last"].tolist() == [1, 2]
    assert binned["trajectories"].tolist() == [4, 2]
    assert binned["reward"].tolist() == [0.75, 0.5]
    assert binned["length_mean"].tolist() == [3.75, 2.5]
    assert binned["staleness_mean"].tolist() == [0.25, 1.5]


def test_by_version(run):
    df = S.by_version(run)             # by the version of the first token
    assert df["first"].tolist() == [0, 1, 2]
    assert df["trajectories"].tolist() == [6, 2, 2]
    assert df["reward"].tolist() == pytest.approx([3.5 / 6, 0.5, 0.5])
    assert df["accuracy"].tolist() == pytest.approx([3 / 6, 0.5, 0.5])
    assert df["length_mean"].tolist() == pytest.approx([21 / 6, 2.5, 3.0])
    assert df["interrupted_share"].tolist() == pytest.approx([2 / 6, 0, 0])
    assert df["trained"].tolist() == [4, 2, 0]


def test_throughput(run):
    # 5 s bins over a 9 s run; the last bin covers 4 s. Tokens spread over [first token, end]:
    # rank 1: rows 0, 1 (6 tok) + 2 of row 4's 3 + 1 of row 5's 2 in bin 0; the rest in bin 1.
    # rank 2: rows 2, 3, the instant row 6 and 1.25 of row 7's 5 tokens in bin 0.
    df = S.throughput(run, bin_s=5)
    assert df.index.tolist() == [0, 5] and df.attrs["bin_s"] == 5
    assert df[1].tolist() == pytest.approx([9 / 5, 8 / 4])
    assert df[2].tolist() == pytest.approx([11.25 / 5, 3.75 / 4])
    gen = S.per_generator(run)
    assert gen.index.tolist() == [1, 2]
    assert gen["trajectories"].tolist() == [6, 4]
    assert gen["output_tokens"].tolist() == [17, 15]
    assert gen["tokens_per_s"].tolist() == pytest.approx([17 / 9, 15 / 9])
    assert gen["reward_errors"].tolist() == [1, 1]
    assert S.nice_bin(9) == 1 and S.nice_bin(52.7) == 5 and S.nice_bin(130) == 20


def test_reward_errors(run):
    errs = S.reward_errors(run)
    assert sorted(zip(errs["error"], errs["count"])) == [
        ("reward worker process died", 1), ("timeout after 10 s", 1)]


def test_percentiles_are_nearest_rank():
    assert S.percentile([1, 2, 3, 4], 50) == 2 and S.percentile([1, 2, 3, 4], 51) == 3
    assert S.hist_percentile({0: 14, 1: 5, 2: 1}, 70) == 0
    assert S.hist_percentile({0: 14, 1: 5, 2: 1}, 71) == 1
    assert S.hist_percentile({0: 14, 1: 5, 2: 1}, 100) == 2
    assert math.isnan(S.percentile([], 50)) and math.isnan(S.hist_percentile({}, 50))


def _rows(table) -> list[list[str]]:
    """The body rows of a rendered rich table, as cell strings."""
    console = Console(width=200, record=True)
    console.print(table)
    lines = console.export_text().splitlines()
    return [[c.strip() for c in line.strip("│").split("│")] for line in lines
            if line.startswith("│")]


def test_printed_tables(run):
    overview = _rows(report.overview_table([run]))
    assert [r[0] for r in overview] == [label.strip() for _, label, _ in S.OVERVIEW_FIELDS]
    assert [r[1] for r in overview] == [
        "10", "5", "32", "34", "3", "6", "2", "2", "0", "0", "+0.5500", "0.5000", "20.00%",
        "0.350", "0", "1", "2", "0.667", "2", "3.2", "3", "5", "6", "6", "20.00%", "9.0",
        "3.6", "2", "1", "0", "0", "0", "0", "0", "0", "1.00", "0", "0", "0.0"]
    assert _rows(report.step_table(run, 20)) == [
        ["0", "2", "+1.000", "1.000", "3.0", "0.00", "3.0"],
        ["1", "2", "+0.500", "0.500", "4.5", "0.50", "5.0"],
        ["2", "2", "+0.500", "0.500", "2.5", "1.50", "6.0"]]
    assert _rows(report.step_table(run, 2))[0][0] == "0–1"
    assert _rows(report.version_table(run, 20)) == [
        ["0", "6", "+0.583", "0.500", "3.5", "33.3%", "4"],
        ["1", "2", "+0.500", "0.500", "2.5", "0.0%", "2"],
        ["2", "2", "+0.500", "0.500", "3.0", "0.0%", "0"]]
    totals, over_time = report.generator_tables(run, bin_s=5)
    assert _rows(totals) == [["1", "6", "17", "1.9", "1"], ["2", "4", "15", "1.7", "1"]]
    assert _rows(over_time) == [["0–5", "1.8", "2.2"], ["5–10", "2.0", "0.9"]]
    errors = _rows(report.error_table(run))
    assert sorted(errors) == [["1", "reward worker process died"], ["1", "timeout after 10 s"]]


def test_show_rows():
    assert report.show_rows(10, 3) == [0, 4, 9]         # spread from first to last
    assert report.show_rows(2, 5) == [0, 1] and report.show_rows(0, 5) == []


def test_small_blocks_give_the_same_numbers(known_log):
    """Rows are read in blocks of whole rows; a 5-token budget splits the log into many."""
    whole = load_run(known_log, progress=False)
    blocks = load_run(known_log, progress=False, block_tokens=5)
    assert blocks.token_staleness == whole.token_staleness
    assert blocks.traj.equals(whole.traj)


def test_engine_restarts_from_the_metrics(run):
    """The steps at which the metrics' running total of engine restarts grew, with how many and
    the generators live; a requeued attempt's counter starting again from 0 adds nothing twice;
    no table when no engine was restarted."""
    import dataclasses
    assert S.engine_restarts(run).empty and report.engine_table(run) is None
    metrics = [{"step": 0, "engine_restarts": 0, "generators_live": 2},
               {"step": 1, "engine_restarts": 1, "generators_live": 2},
               {"step": 2, "engine_restarts": 1, "generators_live": 2},
               {"step": 3, "engine_restarts": 3, "generators_live": 1},
               {"step": 4, "engine_restarts": 0, "generators_live": 2},     # the next attempt
               {"step": 5, "generators_live": 2}]                          # older metrics: no key
    faulty = dataclasses.replace(run, metrics=metrics)
    assert S.engine_restarts(faulty).to_dict("records") == [
        {"step": 1, "restarts": 1, "new": 1, "generators_live": 2},
        {"step": 3, "restarts": 3, "new": 2, "generators_live": 1}]
    assert _rows(report.engine_table(faulty)) == [["1", "1", "1", "2"], ["3", "2", "3", "1"]]
