from collections import Counter

import pytest

from areal_hpc.data.tiny_task import (ALPHABET, format_question, format_solution, make_problems,
                                      term_count_weights)


def terms_of(problem: dict) -> list[int]:
    return [int(t) for t in problem["question"].removesuffix("=").split("+")]


def test_format_by_hand():
    assert format_question([12, 7, 30]) == "12+7+30="
    assert format_solution([12, 7, 30]) == "12+7=19,19+30=49,\\boxed{49}"
    assert format_solution([0, 0]) == "0+0=0,\\boxed{0}"
    assert format_solution([99, 99, 99, 99]) == "99+99=198,198+99=297,297+99=396,\\boxed{396}"


def test_deterministic_per_seed():
    assert make_problems(50, seed=3) == make_problems(50, seed=3)
    assert make_problems(50, seed=3) != make_problems(50, seed=4)
    # A prefix of a longer draw is the shorter draw: n does not change the stream.
    assert make_problems(100, seed=3)[:50] == make_problems(50, seed=3)


def test_problems_are_correct_and_well_formed():
    for p in make_problems(500, seed=0):
        assert set(p) == {"question", "answer", "solution"}
        terms = terms_of(p)
        assert 2 <= len(terms) <= 10
        assert all(0 <= t <= 9 for t in terms)
        assert p["answer"] == str(sum(terms))
        assert p["solution"] == format_solution(terms)
        assert p["solution"].endswith("\\boxed{" + p["answer"] + "}")
        assert set(p["question"] + p["solution"]) <= set(ALPHABET)


def test_term_count_weights_by_hand():
    assert term_count_weights(2, 4, tail_exponent=2.0) == pytest.approx(
        {2: 36 / 49, 3: 9 / 49, 4: 4 / 49})  # raw 1, 1/4, 1/9; total 49/36
    assert term_count_weights(2, 4) == pytest.approx(
        {2: 6 / 11, 3: 3 / 11, 4: 2 / 11})  # default exponent 1: raw 1, 1/2, 1/3; total 11/6


def test_k_is_long_tailed():
    counts = Counter(len(terms_of(p)) for p in make_problems(20_000, seed=1))
    assert set(counts) == set(range(2, 11))
    # P(k=2) = 1 / H_9 = 1 / 2.82897 = 0.3535; P(k=10) = P(2) / 9 = 0.0393 (std ~0.003, ~0.0014).
    assert 0.34 < counts[2] / 20_000 < 0.367
    assert 0.034 < counts[10] / 20_000 < 0.045
    assert all(counts[k] > counts[k + 1] for k in range(2, 10))


def test_options():
    problems = make_problems(200, seed=0, min_terms=3, max_terms=3, max_value=99)
    assert all(len(terms_of(p)) == 3 and max(terms_of(p)) <= 99 for p in problems)
    assert max(max(terms_of(p)) for p in problems) > 9
    with pytest.raises(ValueError):
        make_problems(1, seed=0, min_terms=1)


def test_the_answer_format_ends_answer_n_within_its_alphabet():
    from areal_hpc.data.tiny_task import alphabet

    assert format_solution([12, 7, 30], "answer") == "12+7=19,19+30=49,Answer: 49"
    boxed, answer = make_problems(200, seed=5), make_problems(200, seed=5, answer_format="answer")
    assert [p["question"] for p in boxed] == [p["question"] for p in answer]   # same problems
    assert all(set(p["question"] + p["solution"]) <= set(alphabet("answer")) for p in answer)
    assert alphabet("boxed") == ALPHABET and alphabet("answer").startswith(ALPHABET)
    with pytest.raises(ValueError, match="unknown answer format 'x'"):
        make_problems(1, seed=0, answer_format="x")


def test_the_tool_format_calls_the_calculator_in_a_share_of_the_solutions():
    """The calculator's own parse of a tool solution's call gives the result written after it,
    as the environment appends it (observation template "{observation},")."""
    from areal_hpc.data.tiny_task import alphabet
    from areal_hpc.env.calculator import evaluate, last_call, show

    assert format_solution([12, 7, 30], "tool", tool=True) == "[12+7+30]49,\\boxed{49}"
    assert format_solution([12, 7, 30], "tool") == format_solution([12, 7, 30])
    problems = make_problems(2000, seed=5, answer_format="tool")
    calls = [p for p in problems if "[" in p["solution"]]
    assert 0.37 < len(calls) / len(problems) < 0.43        # tool_share 0.4
    assert all(set(p["question"] + p["solution"]) <= set(alphabet("tool")) for p in problems)
    for p in calls:
        turn, rest = p["solution"].split("]")
        assert rest == show(evaluate(last_call(turn + "]", "[", "]"))) + "," \
            + f"\\boxed{{{p['answer']}}}"
