"""bench/fact_exam.py's pages and its grader: every page has its three forms and twenty questions whose
patterns compile, and an answer is graded HALLU before OK (a wrong fact outweighs a right word)."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

# bench/common.py sets the benchmarks' environment when imported (no exact answer cache, greedy drafting
# with speculative.exact off): not for the tests after this, which spawn servers and CLIs that inherit it.
_environment_before = dict(os.environ)
from fact_exam import DATA, FORMS, grade  # noqa: E402
os.environ.clear()
os.environ.update(_environment_before)


def test_importing_the_benchmarks_leaves_the_tests_environment_alone():
    for key in ("REAME_CACHE_ANSWERS", "REAME_SPECULATIVE_EXACT"):  # what bench/common.py sets
        assert os.environ.get(key) == _environment_before.get(key)


@pytest.mark.parametrize("language", ["en", "it"])
def test_each_page_has_three_forms_and_twenty_questions_with_patterns(language):
    page = json.loads((DATA / f"{language}.json").read_text())
    assert page["language"] == language and set(page["forms"]) == set(FORMS)
    assert len(page["questions"]) == 20 and sum(q["critical"] for q in page["questions"]) >= 10
    for question in page["questions"]:
        assert re.compile(question["accept"]) and re.compile(question["reject"])


@pytest.mark.parametrize("answer, expected", [
    ("No, it is closed on Sundays.", "OK"),
    ("It isn't open on Sundays.", "OK"),
    ("Yes, it opens at 9:00.", "HALLU"),
    ("The shop is open on Sundays.", "HALLU"),
    ("not stated", "MISS"),
])
def test_a_wrong_fact_is_a_hallucination_a_right_one_ok_anything_else_a_miss(answer, expected):
    page = json.loads((DATA / "en.json").read_text())
    question = next(q for q in page["questions"] if q["q"] == "Is the shop open on Sundays?")
    assert grade(answer, question) == expected
