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
