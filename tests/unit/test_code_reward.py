"""The `code_tests` reward: the share of tests that pass, counted outside the solution's process."""

import pytest

from astraflow.workflows.code import code_tests

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"]


def test_code_tests_scores_the_share_of_tests_passed():
    assert code_tests("", "```python\ndef add(a, b):\n    return a + b\n```", tests=TESTS) == pytest.approx(
        2 / 3
    )


def test_a_solution_that_rewrites_the_harness_counter_scores_at_most_one():
    tamper = (  # every variable of the harness's frames that counts is set to a million
        "import sys\n"
        "frame = sys._getframe(1)\n"
        "while frame is not None:\n"
        "    for name in ('_passed', '_index'):\n"
        "        if name in frame.f_globals:\n"
        "            frame.f_globals[name] = 10**6\n"
        "    frame = frame.f_back\n"
        "def add(a, b):\n"
        "    return a + b\n"
    )
    score = code_tests("", tamper, tests=TESTS)
    assert 0.0 <= score <= 1.0
    assert score == pytest.approx(2 / 3)  # what the tests it really passed are worth


def test_a_solution_that_fails_every_test_scores_zero():
    assert code_tests("", "def add(a, b):\n    return 7\n", tests=TESTS) == 0.0
