import json

import pytest

from areal_hpc.data.jsonl import load_jsonl


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_gsm8k_answer_keeps_the_part_after_hashes(tmp_path):
    path = write(tmp_path / "gsm8k.jsonl", [
        json.dumps({"question": "Tom has 3 apples...", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}),
        "",
        "   ",
        json.dumps({"question": "How many?", "answer": "Half of 84 is 42.\n####  42 "}),
    ])
    assert load_jsonl(path) == [
        {"question": "Tom has 3 apples...", "answer": "7"},
        {"question": "How many?", "answer": "42"},
    ]


def test_math_answer_kept_as_is_and_custom_keys(tmp_path):
    path = write(tmp_path / "math.jsonl", [
        json.dumps({"problem": "Compute 1/2.", "solution": "\\frac{1}{2}", "level": 3}),
    ])
    rows = load_jsonl(path, question_key="problem", answer_key="solution")
    assert rows == [{"question": "Compute 1/2.", "answer": "\\frac{1}{2}"}]


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(path)


@pytest.mark.parametrize("bad_row, what", [
    ('{"question": "q", "answer": ', "bad JSON"),
    ('["q", "a"]', "expected a JSON object"),
    ('{"question": "q"}', "missing key 'answer'"),
    ('{"question": "q", "answer": 7}', "'answer' must be a string"),
    ('{"question": null, "answer": "7"}', "'question' must be a string"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad_row, what):
    good = json.dumps({"question": "q", "answer": "a"})
    path = write(tmp_path / "d.jsonl", [good, "", bad_row, good])  # the bad row is on line 3
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    assert f"d.jsonl:3: {what}" in str(err.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert load_jsonl(path) == []
