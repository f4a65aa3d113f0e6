"""Paired comparisons over seeds (areal_hpc/analysis/paired.py): the t quantiles, the paired and
unpaired intervals, and the markdown table on hand-made records."""

import math
import statistics

import pytest

from areal_hpc.analysis.paired import (cell_of, compare, paired_interval, paired_table, pooled_sd,
                                       t_quantile, welch_interval)

def test_t_quantiles():
    """scipy's, with the normal quantile at infinite df (published: 2.776445105 at df 4)."""
    assert t_quantile(0.975, 4) == pytest.approx(2.776445105, rel=1e-8)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.959963985, rel=1e-9)
    assert t_quantile(0.975, 4) < t_quantile(0.975, 3.7) < t_quantile(0.975, 3)   # Welch's df
    with pytest.raises(ValueError):
        t_quantile(1.0, 4)


def test_paired_interval_by_hand():
    d = [0.02, 0.05, -0.01, 0.04]         # mean 0.025, sd 0.02646
    p = paired_interval(d)
    sd = statistics.stdev(d)
    half = 3.182446305 * sd / 2
    assert p["n"] == 4 and p["mean"] == pytest.approx(0.025) and p["sd"] == pytest.approx(0.0264575, rel=1e-5)
    assert (p["lo"], p["hi"]) == pytest.approx((0.025 - half, 0.025 + half))
    assert paired_interval([0.0, 0.0, 0.0])["lo"] == 0.0            # identical updates: a point
    one = paired_interval([0.1])
    assert one["mean"] == 0.1 and one["sd"] is None and one["lo"] is None


def test_welch_interval_and_pooled_sd_by_hand():
    a, b = [0.30, 0.25, 0.35], [0.20, 0.22, 0.18, 0.24]
    va, vb = statistics.variance(a) / 3, statistics.variance(b) / 4
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    w = welch_interval(a, b)
    assert w["mean"] == pytest.approx(0.3 - 0.21) and w["df"] == pytest.approx(df)
    assert w["hi"] - w["mean"] == pytest.approx(t_quantile(0.975, df) * math.sqrt(va + vb))
    sp = math.sqrt((2 * statistics.variance(a) + 3 * statistics.variance(b)) / 5)
    assert pooled_sd(a, b) == pytest.approx(sp)
    assert pooled_sd([0.1], [0.2]) is None


def test_pairing_narrows_the_interval_for_correlated_runs():
    # seeds differ a lot (shared by both objectives), the objectives by a steady 0.03
    seed_effect = [0.10, 0.30, 0.18, 0.25, 0.05]
    a = {s: {"ok": True, "v": x + 0.03 + 0.004 * (-1) ** s} for s, x in enumerate(seed_effect)}
    b = {s: {"ok": True, "v": x} for s, x in enumerate(seed_effect)}
    c = compare(a, b, lambda r: r["v"])
    p, w = c["paired"], c["welch"]
    assert p["n"] == 5 and p["mean"] == pytest.approx(w["mean"]) and p["mean"] == pytest.approx(0.0308)
    assert 0 < p["lo"] and (p["hi"] - p["lo"]) < 0.1 * (w["hi"] - w["lo"])
    assert w["lo"] < 0 < w["hi"]           # unpaired, the same runs show nothing
    assert c["in_pooled_sd"] == pytest.approx(p["mean"] / c["pooled_sd"])


def test_a_failed_run_is_listed_not_dropped():
    a = {0: {"ok": True, "v": 0.3}, 1: {"ok": False}, 2: {"ok": True, "v": 0.2}, 3: {"ok": True, "v": None}}
    b = {0: {"ok": True, "v": 0.25}, 1: {"ok": True, "v": 0.2}, 2: {"ok": True, "v": 0.1}, 3: {"ok": True, "v": 0.1},
         4: {"ok": True, "v": 0.1}}
    c = compare(a, b, lambda r: r["v"])
    assert c["paired"]["n"] == 2 and c["seeds"] == 5
    assert c["failed"] == {1: "A failed", 3: "A without a value", 4: "no A run"}
    assert (c["n_failed"], c["n_missing"], c["n_no_value"]) == (1, 1, 1)


def _rec(eta, objective, seed, final, ok=True, collapsed_at=None, extra=()):
    over = ["train.total_steps=40", "topology.trainer_cpus=0", f"rollout.max_staleness={eta}",
            f"train.off_policy={objective}", f"train.seed={seed}", f"data.seed={seed}", *extra]
    r = {"setting": f"eta{eta}-{objective}", "seed": seed, "task": "tiny", "ok": ok, "overrides": over}
    if ok:
        r.update(final_acc=final, held_curve=[(10.0, final - 0.02), (20.0, final)],
                 reward_curve=[final] * 12, reward_last10=final, collapsed=collapsed_at is not None,
                 collapsed_at=collapsed_at, collapsed_by="reward" if collapsed_at else None,
                 diag_skipped_last10={"reward": 0})
    return r


def test_cells_ignore_what_tells_runs_apart():
    a, b = _rec(2, "naive", 0, 0.3), _rec(2, "trust_region", 1, 0.3)
    assert cell_of(a)[0] == cell_of(b)[0] == "task=tiny train.total_steps=40"
    assert cell_of(a)[1:] == (2, "naive") and cell_of({"setting": "sync", "seed": 0}) is None


def test_paired_table_markdown():
    recs = [_rec(2, o, s, v) for s in range(3) for o, v in (("trust_region", 0.25 + 0.05 * s),
                                                             ("naive", 0.27 + 0.05 * s))]
    recs[1] = _rec(2, "naive", 0, None, ok=False)                   # seed 0's naive run failed
    recs.append(_rec(2, "decoupled", 1, 0.1, collapsed_at=23))
    recs.append(_rec(8, "naive", 0, 0.2, extra=["train.lr=3e-5"]))  # another regime
    recs[-1]["diag_skipped_last10"] = {"reward": 2}
    out = paired_table(recs)
    assert "### η = 2, train.lr=(default)" in out and "### η = 8, train.lr=3e-5" in out   # regimes
    assert "train.total_steps" not in out.split("### η = 2")[1].splitlines()[0]
    assert "naive 2 of 3 ok (1 failed: seed 0)" in out
    assert "decoupled 1 of 1 (seed 1 at step 23, reward)" in out
    assert "steps without a value skipped: naive 2" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| naive − trust_region | final held-out acc")]
    assert len(rows) == 1
    cols = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cols[2] == "2" and cols[3] == "1 of 3 failed (seed 0: naive failed)"
    assert cols[6] == "+0.020" and cols[7] == "0.000" and cols[8] == "[+0.020, +0.020]"
    assert "(no trust_region runs in this cell" in out             # η = 8, the other regime
    every = paired_table(recs, baseline="all")
    assert ("| decoupled − naive | final held-out acc | 1 | 1 of 3 failed, 2 of 3 not run (seed 0: no decoupled "
            "run, naive failed; seed 2: no decoupled run) |") in every
