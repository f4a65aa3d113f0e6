import threading

import pytest

from areal_hpc.reward.math import last_boxed, math_reward


@pytest.mark.parametrize("completion, answer, reward", [
    ("12+7=19,\\boxed{19}", "19", 1.0),
    ("12+7=20,\\boxed{20}", "19", 0.0),
    ("12+7=19,19", "19", 0.0),                      # no box
    ("\\boxed{}", "19", 0.0),                       # empty box
    ("\\boxed{19", "19", 0.0),                      # unclosed box
    ("\\boxed{5},\\boxed{19}", "19", 1.0),          # the last box counts
    ("\\boxed{19},\\boxed{5}", "19", 0.0),
    ("\\boxed{19} then \\boxed{5", "19", 1.0),     # a truncated last box is not a box
    ("\\boxed{ 049 }", "49", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),                # GSM8K thousands separator
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),          # math_verify equivalence
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x+1}", "1+x", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("\\boxed{}}}{{", "1", 0.0),                    # garbage
    ("\\boxed{\\frac{}{", "1", 0.0),
    ("\\boxed{abc}", "1", 0.0),
    ("", "1", 0.0),
    ("\\boxed{1}", "", 0.0),
    (None, "1", 0.0),                               # not strings
    ("\\boxed{1}", None, 0.0),
    ("\\boxed{1}", 1, 0.0),
])
def test_math_reward(completion, answer, reward):
    assert math_reward(completion, answer) == reward


def test_last_boxed():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1}\\boxed{{2}}") == "{2}"
    assert last_boxed("no box") is None


def test_works_off_the_main_thread():
    # math_verify's default signal.alarm timeout raises outside the main thread.
    results = []
    worker = threading.Thread(target=lambda: results.extend([
        math_reward("\\boxed{\\frac{2}{4}}", "0.5"), math_reward("\\boxed{3}", "4")]))
    worker.start()
    worker.join()
    assert results == [1.0, 0.0]
