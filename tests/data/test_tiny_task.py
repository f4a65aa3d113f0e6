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
        assert all(0 <= t <= 99 for t in terms)
        assert p["answer"] == str(sum(terms))
        assert p["solution"] == format_solution(terms)
        assert p["solution"].endswith("\\boxed{" + p["answer"] + "}")
        assert set(p["question"] + p["solution"]) <= set(ALPHABET)


def test_term_count_weights_by_hand():
    w = term_count_weights(2, 4, tail_exponent=2.0)  # raw 1, 1/4, 1/9; total 49/36
    assert w == pytest.approx({2: 36 / 49, 3: 9 / 49, 4: 4 / 49})


def test_k_is_long_tailed():
    counts = Counter(len(terms_of(p)) for p in make_problems(20_000, seed=1))
    assert set(counts) == set(range(2, 11))
    # P(k=2) = 1 / sum_{j=1..9} j^-2 = 0.6452; P(k=10) = P(2) / 81 = 0.00797.
    assert 0.63 < counts[2] / 20_000 < 0.66
    assert 0.004 < counts[10] / 20_000 < 0.012
    assert all(counts[k] > counts[k + 1] for k in range(2, 10))


def test_exclude_and_options():
    first = make_problems(5, seed=0)
    skipped = make_problems(5, seed=0, exclude={first[0]["question"]})
    assert skipped[:4] == first[1:]
    small = make_problems(200, seed=0, min_terms=3, max_terms=3, max_value=9)
    assert all(len(terms_of(p)) == 3 and max(terms_of(p)) <= 9 for p in small)
    with pytest.raises(ValueError):
        make_problems(1, seed=0, min_terms=1)
