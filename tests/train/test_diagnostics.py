"""The one-line warnings that precede a collapse (`train.diagnostics.CollapseWatch`)."""
from areal_hpc.train.diagnostics import CollapseWatch


def _rec(step, ess=0.9, cut=0.0, length=20.0):
    return {"step": step, "ess": ess, "kl_behav": 0.01, "truncated_frac": cut, "response_len": length}


def test_each_sign_warns_once_until_it_clears():
    w = CollapseWatch()
    assert w.check(_rec(0)) == []
    first = w.check(_rec(1, ess=0.3))
    assert len(first) == 1 and first[0].startswith("step 2: effective sample size 0.30")
    assert w.check(_rec(2, ess=0.2)) == []            # still low: said already
    assert w.check(_rec(3, ess=0.8)) == []            # cleared
    assert len(w.check(_rec(4, ess=0.4))) == 1        # back: said again
    cut = w.check(_rec(5, ess=0.4, cut=0.5))
    assert len(cut) == 1 and "50% of the batch cut at rollout.max_new_tokens" in cut[0]


def test_lengths_running_away():
    w = CollapseWatch()
    for step in range(5):
        assert w.check(_rec(step, length=20.0)) == []
    said = [m for step, n in enumerate([25, 30, 40, 60, 80], start=5) for m in w.check(_rec(step, length=n))]
    assert len(said) == 1 and "mean response length" in said[0] and "the first 5 steps' 20" in said[0]


def test_records_without_the_fields_are_quiet():
    w = CollapseWatch()
    assert w.check({"step": 0}) == [] and w.check({"step": 1, "loss": 0.1}) == []


def test_a_step_without_a_measurement_neither_raises_nor_clears_the_ess_sign():
    """A step with no forward pass writes ess NaN (null in metrics.jsonl): it must not read as
    on-policy and clear a standing warning; the next warning says how many were skipped."""
    w = CollapseWatch()
    assert len(w.check(_rec(0, ess=0.3))) == 1
    assert w.check(_rec(1, ess=float("nan"))) == []
    assert w.check(_rec(2, ess=None)) == []
    assert w.check(_rec(3, ess=0.2)) == []                # still the same warning: not said again
    assert w.skipped == 2
    assert w.check(_rec(4, ess=0.9)) == []
    again = w.check(_rec(5, ess=0.1))
    assert len(again) == 1 and "2 step(s) without a measurement skipped" in again[0]


def test_a_step_with_no_learning_signal_is_said():
    w = CollapseWatch()
    rec = {**_rec(0, ess=float("nan")), "no_signal_steps": 1, "dropped_frac": float("nan"),
           "adv_abs_mean": 0.0, "reward": 0.0}
    said = w.check(rec)
    assert len(said) == 1 and "no learning signal in the whole step" in said[0]
    assert "dropped_frac not measured" in said[0] and "batch reward 0.000" in said[0]
