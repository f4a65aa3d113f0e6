"""tools/prepare_data.py: the public layouts become rows the run's loaders read."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_hpc.data.prepare import BadRow, convert, detect
from areal_hpc.data.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]


def _parquet(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _jsonl(rows, path):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_parquet_becomes_question_and_final_answer(tmp_path):
    src = _parquet([{"question": "Tom has 2+3 apples?", "answer": "2+3=5\n#### 5"},
                    {"question": "Big?", "answer": "so\n#### 1,000"}], tmp_path / "g.parquet")
    out = convert(src, str(tmp_path / "g.jsonl"))
    assert out == {"layout": "gsm8k", "kind": "math", "rows": 2, "skipped": 0, "bad": []}
    rows = load_prompts(str(tmp_path / "g.jsonl"))
    assert [(r["question"], r["reference"]) for r in rows] == [("Tom has 2+3 apples?", "5"), ("Big?", "1,000")]
    first = json.loads((tmp_path / "g.jsonl").read_text().splitlines()[0])
    assert first["solution"] == "2+3=5\n#### 5"        # the worked solution is kept beside


def test_math_takes_the_answer_field_or_the_last_box_of_the_solution(tmp_path):
    src = _jsonl([{"problem": "p1", "solution": "x \\boxed{1} then \\boxed{\\frac{1}{2}}", "level": "L5"},
                  {"Problem": "aime", "Answer": 204},                         # AIME: capitals, int
                  {"problem": "p3", "answer": "\\sqrt{2}", "solution": "\\boxed{wrong}"}],
                 tmp_path / "m.jsonl")
    convert(src, str(tmp_path / "out.jsonl"), layout="math")
    rows = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["question"], r["answer"]) for r in rows] == [
        ("p1", "\\frac{1}{2}"), ("aime", "204"), ("p3", "\\sqrt{2}")]
    assert rows[0]["level"] == "L5" and "Answer" not in rows[1] and "Problem" not in rows[1]


def test_apps_and_livecodebench_become_stdin_tests(tmp_path):
    apps = _jsonl([{"question": "echo", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]}),
                    "difficulty": "intro"}], tmp_path / "apps.jsonl")
    convert(apps, str(tmp_path / "a.jsonl"))
    assert load_prompts(str(tmp_path / "a.jsonl"), "code", "prompt", "tests")[0]["reference"] == [
        {"input": "1\n", "output": "1\n"}]
    lcb = _parquet([{"question_content": "sum", "private_test_cases": "eJz_not_unpickled",
                     "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}])}],
                   tmp_path / "lcb.parquet")
    out = convert(lcb, str(tmp_path / "l.jsonl"))
    assert out["layout"] == "livecodebench" and out["kind"] == "code"
    row = json.loads((tmp_path / "l.jsonl").read_text())
    assert row["tests"] == [{"input": "1 2\n", "output": "3\n"}] and "private_test_cases" not in row


def test_a_bad_row_stops_naming_row_and_field_or_is_skipped_and_counted(tmp_path):
    src = _parquet([{"question": "ok", "input_output": json.dumps({"inputs": ["1"], "outputs": ["1"]})},
                    {"question": "call", "input_output": json.dumps({"fn_name": "f", "inputs": [], "outputs": []})},
                    {"question": "empty", "input_output": ""}], tmp_path / "apps.parquet")
    dst = tmp_path / "apps.jsonl"
    with pytest.raises(BadRow, match=r"apps\.parquet\[1\]: 'input_output': call-based tests"):
        convert(src, str(dst))
    assert not dst.exists() and not list(tmp_path.glob("apps.jsonl.tmp*"))   # nothing partial
    out = convert(src, str(dst), skip_bad=True)
    assert out["rows"] == 1 and out["skipped"] == 2
    assert out["bad"][1].startswith(f"{src}[2]: 'input_output' is a string but not JSON")
    with pytest.raises(BadRow, match=r"m\.jsonl:2: 'solution' has no \\boxed\{\} answer"):
        convert(_jsonl([{"problem": "a", "answer": "1"}, {"problem": "b", "solution": "no box"}],
                       tmp_path / "m.jsonl"), str(tmp_path / "m_out.jsonl"), layout="math")
    with pytest.raises(BadRow, match=r"g\.jsonl:1: 'answer' has no '####' final answer"):
        convert(_jsonl([{"question": "a", "answer": "7"}], tmp_path / "g.jsonl"), str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match=r"no known layout has the fields \['text'\]"):
        detect({"text": "x"})


def test_the_command_line_prints_one_line_and_exits_2_on_error(tmp_path):
    src = _jsonl([{"question": "q", "answer": "w\n#### 3"}], tmp_path / "g.jsonl")
    ok = subprocess.run([sys.executable, str(ROOT / "tools/prepare_data.py"), src, str(tmp_path / "o.jsonl")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "wrote 1 rows" in ok.stdout and "layout gsm8k, data.kind=math" in ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "tools/prepare_data.py"), str(tmp_path / "nope.parquet"),
                          str(tmp_path / "o2.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: dataset file not found: {str(tmp_path / 'nope.parquet')!r}"]
