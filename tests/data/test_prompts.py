import json

import pytest

from areal_hpc.data.prompts import load_prompts


def test_math_rows(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"question": "1+2=", "answer": "so #### 3"}) + "\n")
    assert load_prompts(str(p)) == [{"question": "1+2=", "reward_kind": "math", "reference": "3"}]


def test_code_rows(tmp_path):
    p = tmp_path / "c.jsonl"
    tests = [{"input": "1 2\n", "output": "3\n"}]
    p.write_text(json.dumps({"prompt": "add two ints", "tests": tests}) + "\n")
    rows = load_prompts(str(p), "code", "prompt", "tests")
    assert rows == [{"question": "add two ints", "reward_kind": "code", "reference": tests}]


def test_wrong_format_names_the_line_and_unknown_kind(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1"):
        load_prompts(str(p), "code", "question", "answer")
    with pytest.raises(ValueError, match="unknown dataset kind"):
        load_prompts(str(p), "poetry")


def test_custom_rewards_keep_the_whole_row_and_need_only_the_question(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"question": "1+2=", "answer": "work\\n#### 3", "level": 2}\n{"question": "x?"}\n')
    rows = load_prompts(str(p), custom=True)
    assert rows == [{"question": "1+2=", "reward_kind": "custom", "reference": "3",
                     "row": {"question": "1+2=", "answer": "work\n#### 3", "level": 2}},
                    {"question": "x?", "reward_kind": "custom", "reference": None, "row": {"question": "x?"}}]
    p.write_text('{"prompt": "x?"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: missing key 'question'"):
        load_prompts(str(p), custom=True)
