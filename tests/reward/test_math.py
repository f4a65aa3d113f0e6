import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.data.answers import last_boxed
from areal_hpc.reward.math import math_reward


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
    assert last_boxed("\\boxed{43 \\boxed{42}}") == "43 \\boxed{42}"     # the outer box
    assert last_boxed("\\boxed{7} \\boxed{ \\boxed{8}") == "8"          # its outer one unclosed


def test_works_off_the_main_thread():
    # math_verify's default signal.alarm timeout raises outside the main thread.
    results = []
    worker = threading.Thread(target=lambda: results.extend([
        math_reward("\\boxed{\\frac{2}{4}}", "0.5"), math_reward("\\boxed{3}", "4")]))
    worker.start()
    worker.join()
    assert results == [1.0, 0.0]


@pytest.mark.parametrize("how,text,expected", [
    ("boxed", "so \\boxed{12} then \\boxed{13}", "13"),
    ("gsm8k", "48/2 = 24 clips\n#### 72\n", "72"),
    ("gsm8k", "no mark here 5", None),
    ("answer", "3+4=7.\nAnswer: 7.", "7"),
    ("answer", "answer:  -1,200\nthen nothing", "-1,200"),
    ("last_number", "first 3, then 4.5 and finally 10", "10"),
    ("last_number", "no digits", None),
])
def test_answer_extractors(how, text, expected):
    from areal_hpc.data.answers import extract_answer
    assert extract_answer(text, how) == expected


def test_math_reward_with_another_extractor():
    from areal_hpc.data.answers import extract_answer
    assert math_reward("The total is 1,200.\n#### 1200", "1200", "gsm8k") == 1.0
    assert math_reward("Answer: 1/2", "0.5", "answer") == 1.0
    assert math_reward("\\boxed{7}", "7", "answer") == 0.0        # no Answer: line
    with pytest.raises(ValueError, match="unknown answer extractor"):
        extract_answer("x", "regex")


def _last_boxed_by_rescanning(text):
    """The specification: of the \\boxed{ whose braces balance (each start rescanned to the end:
    quadratic on text full of unclosed boxes), the one that closes last (of nested boxes the
    outer one)."""
    found, start = None, text.find("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                if found is None or i > found[1]:
                    found = (start + len("\\boxed{"), i)
                break
            i += 1
        start = text.find("\\boxed{", start + 1)
    return None if found is None else text[found[0]:found[1]]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "{", "}", "a", "1", "\\boxed"]), max_size=30))
def test_last_boxed_in_one_pass_equals_the_rescanning_definition(parts):
    text = "".join(parts)
    assert last_boxed(text) == _last_boxed_by_rescanning(text)


def test_last_boxed_on_a_looping_completion():
    """64 KB of unclosed boxes (what a looping policy writes): one pass, the earlier whole box."""
    assert last_boxed("\\boxed{7} " + "\\boxed{" * 9000) == "7"


# The equivalence policy (README, "Rewards"): which boxed answers count as the reference.
ACCEPTED = [
    ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"), ("1.0", "1"), ("12.0", "12"),
    ("10^3", "1000"), ("1,000", "1000"),                    # one number, another notation
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"), ("x+1", "1+x"), ("2x", "x*2"),   # the same expression
    ("x=2", "2"), ("2", "x=2"),                              # a variable named
    ("12\\text{ cm}", "12"), ("$5", "5"), ("5\\$", "5"),     # units and currency dropped
    ("50\\%", "\\frac{1}{2}"),                              # a percentage is its fraction
    ("3,2", "2,3"), ("2,3", "\\{2,3\\}"),                   # a list of solutions is a set
    ("{2}", "2"), ("\\infty", "\\infty"),
    ("0.1", "\\frac{1}{10}"), ("0.125", "\\frac{1}{8}"), ("2.50", "\\frac{5}{2}"),  # exact decimals
    ("x = 40 + 2 = 42", "42"), ("42 = 42", "42"), ("x = 42", "x = 42"),  # every side the answer
    ("\\boxed{42}", "42"), ("\\boxed{\\boxed{\\frac{1}{2}}}", "0.5"),     # a box around all of it
]
REFUSED = [
    ("0.333", "\\frac{1}{3}"), ("3.14", "\\pi"), ("0.7071", "\\frac{\\sqrt{2}}{2}"),  # approximations
    ("1.0001", "1"), ("0.99", "1"), ("1e3", "1000"),
    ("-2", "2"), ("\\pm 2", "2"),                            # another sign, or both
    ("2 or 3", "2"), ("2 \\text{ or } 3", "2"), ("2, 3", "2"),   # hedged: several answers
    ("(1,2)", "[1,2]"),                                      # open and closed intervals
    ("\\text{12 apples}", "12"), ("5 dollars", "5"),         # a number inside words
    # the leaks math_verify left (issue: trust boundary, third round): it rounds decimals to 6
    # places, takes the right side of any equation, and reads the inner of nested boxes
    ("0.5000001", "\\frac{1}{2}"), ("0.5000001", "0.5"), ("0.4999999", "\\frac{1}{2}"),
    ("3.141593", "\\pi"), ("1.4142136", "\\sqrt{2}"), ("0.3333333333333333333", "\\frac{1}{3}"),
    ("43 = 42", "42"), ("2x = 84", "42"), ("42 = x", "42"), ("x = 43 = 42", "42"),
    ("\\boxed{43 \\boxed{42}}", "42"), ("43 \\boxed{42}", "42"), ("\\boxed{42} \\boxed{42}", "42"),
]


@pytest.mark.parametrize("pred, ref", ACCEPTED)
def test_equivalences_the_policy_accepts(pred, ref):
    assert math_reward(f"\\boxed{{{pred}}}", ref) == 1.0


@pytest.mark.parametrize("pred, ref", REFUSED)
def test_equivalences_the_policy_refuses(pred, ref):
    assert math_reward(f"\\boxed{{{pred}}}", ref) == 0.0


def test_a_box_inside_another_extractors_answer_is_unwrapped_only_whole():
    assert math_reward("Answer: \\boxed{42}", "42", "answer") == 1.0
    assert math_reward("Answer: 43 \\boxed{42}", "42", "answer") == 0.0
