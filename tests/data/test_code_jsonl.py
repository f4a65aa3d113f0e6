import json

import pytest

from areal_hpc.data.code_jsonl import load_code_jsonl

TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_livecodebench_style_tests_as_a_list_or_a_json_string(tmp_path):
    path = write(tmp_path / "lcb.jsonl", [
        {"prompt": "Add two numbers.", "tests": TESTS, "difficulty": "easy"},
        "",
        {"prompt": "Again.", "tests": json.dumps(TESTS[:1])},
    ])
    assert load_code_jsonl(path) == [
        {"prompt": "Add two numbers.", "tests": TESTS},
        {"prompt": "Again.", "tests": TESTS[:1]},
    ]


def test_apps_input_output_string(tmp_path):
    io = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    path = write(tmp_path / "apps.jsonl", [
        {"question": "Add two numbers.", "input_output": json.dumps(io), "difficulty": "intro"},
        {"question": "Same, not a string.", "input_output": io},
    ])
    rows = load_code_jsonl(path, prompt_key="question", tests_key="input_output")
    assert rows == [{"prompt": "Add two numbers.", "tests": TESTS},
                    {"prompt": "Same, not a string.", "tests": TESTS}]


def test_extra_test_fields_are_dropped(tmp_path):
    path = write(tmp_path / "d.jsonl", [
        {"prompt": "p", "tests": [{"input": "1", "output": "1", "testtype": "stdin"}]}])
    assert load_code_jsonl(path) == [{"prompt": "p", "tests": [{"input": "1", "output": "1"}]}]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_code_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("bad_row, what", [
    ('{"prompt": "p", "tests": ', "bad JSON"),
    ('["p"]', "expected a JSON object, got list"),
    ('{"tests": []}', "missing key 'prompt'"),
    ('{"prompt": "p"}', "missing key 'tests'"),
    ('{"prompt": 3, "tests": [{"input": "", "output": ""}]}',
     "'prompt' must be a string, got int"),
    ('{"prompt": "p", "tests": []}', "'tests': no tests"),
    ('{"prompt": "p", "tests": "[{\\"input\\": "}', "'tests' is a string but not JSON"),
    ('{"prompt": "p", "tests": 5}',
     "'tests' must be a list of tests or an APPS input_output object, got int"),
    ('{"prompt": "p", "tests": [3]}', "'tests'[0]: expected an object, got int"),
    ('{"prompt": "p", "tests": [{"input": "1"}]}',
     "'tests'[0]['output'] must be a string, got nothing"),
    ('{"prompt": "p", "tests": [{"input": 1, "output": "1"}]}',
     "'tests'[0]['input'] must be a string, got int"),
    ('{"prompt": "p", "tests": {"inputs": ["1"]}}',
     "'tests': expected keys 'inputs' and 'outputs' (keys: ['inputs'])"),
    ('{"prompt": "p", "tests": {"inputs": ["1", "2"], "outputs": ["1"]}}',
     "'tests': 2 inputs but 1 outputs"),
    ('{"prompt": "p", "tests": {"inputs": "1", "outputs": "1"}}',
     "'tests': 'inputs' and 'outputs' must be lists"),
    ('{"prompt": "p", "tests": {"fn_name": "f", "inputs": [[1]], "outputs": [1]}}',
     "'tests': call-based tests (fn_name) are not supported"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad_row, what):
    good = json.dumps({"prompt": "p", "tests": TESTS})
    path = write(tmp_path / "d.jsonl", [good, "", bad_row, good])  # the bad row is on line 3
    with pytest.raises(ValueError) as err:
        load_code_jsonl(path)
    assert f"d.jsonl:3: {what}" in str(err.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert load_code_jsonl(path) == []
