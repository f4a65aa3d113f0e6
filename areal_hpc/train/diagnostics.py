"""Warnings that precede a collapse, one line each, from a step's metrics record.

Runs that collapse under stale data show it first in two places: the importance weights
(π_θ/π_behav) degenerate, so the effective sample size of a step falls, and answers stop
terminating, so responses grow to the token limit. `CollapseWatch` looks at each step's record
(metrics.jsonl's fields `ess`, `truncated_frac`, `response_len`) and says so once when a sign
appears, and again only after it has cleared. A step whose ESS was not measured (no forward
pass: NaN or null) neither raises nor clears the ESS sign; such steps are counted (`skipped`) and
named in the next ESS warning. A step with no learning signal at all (no optimizer step:
`no_signal_steps`) is a sign of its own. Pure Python."""
from __future__ import annotations

import math
from collections import deque

# A step's token-level ESS below this share of its tokens: the data is far off-policy.
ESS_LOW = 0.5
# Share of the batch cut at max_new_tokens from which lengths count as running away.
TRUNCATED_HIGH = 0.25
# Mean response length over the last WINDOW steps against the first WINDOW steps'.
LENGTH_GROWTH = 2.0
WINDOW = 5


class CollapseWatch:
    def __init__(self):
        self._first: list[float] = []
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._active: set[str] = set()
        self.skipped = 0        # steps whose ESS was not measured

    def check(self, r: dict) -> list[str]:
        """The warnings that step record `r` starts (none while a sign persists)."""
        signs: dict[str, str] = {}
        ess = r.get("ess")
        if not measured(ess):
            self.skipped += 1
            if "ess" in self._active:       # not measured: the sign is neither raised nor cleared
                signs["ess"] = ""
        elif ess < ESS_LOW:
            skipped = f"; {self.skipped} step(s) without a measurement skipped" if self.skipped else ""
            signs["ess"] = (f"effective sample size {ess:.2f} of the step's tokens (< {ESS_LOW}): "
                            f"the data is far from the policy (KL(π_behav‖π_θ) "
                            f"{_fmt(r.get('kl_behav'))}{skipped}); consider a lower "
                            "rollout.max_staleness or train.off_policy")
        if r.get("no_signal_steps"):
            signs["idle"] = ("no learning signal in the whole step (every token dropped, or every "
                             "advantage 0): no optimizer step, the weights left alone "
                             f"(dropped_frac {_fmt(r.get('dropped_frac'))}, mean |advantage| "
                             f"{_fmt(r.get('adv_abs_mean'))}, batch reward {_fmt(r.get('reward'))})")
        cut = r.get("truncated_frac")
        if cut is not None and cut >= TRUNCATED_HIGH:
            signs["cut"] = (f"{100 * cut:.0f}% of the batch cut at rollout.max_new_tokens: "
                            "responses stop terminating (train.overlong filters or shapes them)")
        length = r.get("response_len")
        if length is not None:
            if len(self._first) < WINDOW:
                self._first.append(length)
            self._recent.append(length)
            base = sum(self._first) / len(self._first)
            now = sum(self._recent) / len(self._recent)
            if len(self._first) == WINDOW and base > 0 and now >= LENGTH_GROWTH * base:
                signs["length"] = (f"mean response length {now:.0f} tokens over the last {WINDOW} "
                                   f"steps, {now / base:.1f}x the first {WINDOW} steps' {base:.0f}")
        new = [f"step {r.get('step', -1) + 1}: {text}" for key, text in signs.items()
               if key not in self._active and text]
        self._active = set(signs)
        return new


def measured(v) -> bool:
    """A value that measured something: not None (JSON null), not NaN."""
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _fmt(x) -> str:
    return f"{x:.3f}" if measured(x) else "not measured"
