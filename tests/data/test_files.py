"""Every dataset format (jsonl, parquet, arrow file and stream, HF save_to_disk) loads the same rows."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_hpc.data.files import dataset_format, field, iter_rows
from areal_hpc.data.prompts import load_prompts

MATH = [{"question": "1+1?", "answer": "2", "level": 1},
        {"question": "2+3?", "answer": "so #### 5", "level": 2},
        {"question": "half?", "answer": "\\frac{1}{2}", "level": 3}]
# A column holds one type: tests as structs (LiveCodeBench's parsed form) or as JSON strings
CODE = [{"prompt": "echo", "tests": [{"input": "a\n", "output": "a\n"}]},
        {"prompt": "cat", "tests": [{"input": "1\n", "output": "1\n"}, {"input": "", "output": ""}]}]
CODE_STR = [{"prompt": "echo", "tests": json.dumps([{"input": "a\n", "output": "a\n"}])},
            {"prompt": "apps", "tests": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}]


def _write(rows, tmp_path, fmt):
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(table, path, row_group_size=2)       # several row groups
        return path
    if fmt in ("arrow-file", "arrow-stream"):
        path = tmp_path / "d.arrow"
        with pa.OSFile(str(path), "wb") as sink:
            new = pa.ipc.new_file if fmt == "arrow-file" else pa.ipc.new_stream
            with new(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=2):
                    writer.write_batch(batch)
        return path
    import datasets
    path = tmp_path / "hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


FORMATS = ["jsonl", "parquet", "arrow-file", "arrow-stream", "hf"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_math_rows(tmp_path, fmt):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rows = load_prompts(str(_write(MATH, tmp_path / "a", fmt)))
    assert rows == load_prompts(str(_write(MATH, tmp_path / "b", "jsonl")))
    assert [r["reference"] for r in rows] == ["2", "5", "\\frac{1}{2}"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_code_and_custom_rows(tmp_path, fmt):
    for n, code in enumerate((CODE, CODE_STR)):
        (tmp_path / f"a{n}").mkdir()
        (tmp_path / f"b{n}").mkdir()
        path, ref = _write(code, tmp_path / f"a{n}", fmt), _write(code, tmp_path / f"b{n}", "jsonl")
        rows = load_prompts(str(path), "code", "prompt", "tests")
        assert rows == load_prompts(str(ref), "code", "prompt", "tests")
        assert rows[n]["reference"][0] == {"input": "a\n" if n == 0 else "1\n",
                                           "output": "a\n" if n == 0 else "1\n"}
    (tmp_path / "c").mkdir()
    custom = load_prompts(str(_write(MATH, tmp_path / "c", fmt)), custom=True)
    assert [r["row"]["level"] for r in custom] == [1, 2, 3]
    assert [r["reference"] for r in custom] == ["2", "5", "\\frac{1}{2}"]


def test_dotted_keys_reach_nested_fields_as_verl_lays_them_out(tmp_path):
    rows = [{"problem": "1+1?", "reward_model": {"ground_truth": "2", "style": "rule"}}]
    path = _write(rows, tmp_path, "parquet")
    got = load_prompts(str(path), question_key="problem", answer_key="reward_model.ground_truth")
    assert got == [{"question": "1+1?", "reward_kind": "math", "reference": "2"}]
    assert field({"a.b": 1, "a": {"b": 2}}, "a.b") == 1      # a key as it is wins
    with pytest.raises(ValueError, match=r"d\.parquet\[0\]: missing key 'reward_model\.score'"):
        load_prompts(str(path), question_key="problem", answer_key="reward_model.score")


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_a_bad_row_is_named_by_its_index(tmp_path, fmt):
    rows = MATH + [{"question": "no answer", "answer": None, "level": 4}]
    path = _write(rows, tmp_path, fmt)
    with pytest.raises(ValueError, match=r"\[3\]: 'answer' must be a string, got NoneType"):
        load_prompts(str(path))


def test_a_datasetdict_directory_names_its_splits(tmp_path):
    import datasets
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH),
                               "test": datasets.Dataset.from_list(MATH[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\].*dd/train"):
        list(iter_rows(tmp_path / "dd"))
    assert len(load_prompts(str(tmp_path / "dd" / "test"))) == 1


def test_unreadable_tables_and_plain_directories_are_one_line_errors(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"x\.parquet: not a readable parquet dataset"):
        list(iter_rows(bad))
    arrow = tmp_path / "x.arrow"
    arrow.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"x\.arrow: not a readable arrow dataset"):
        list(iter_rows(arrow))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one written by HF datasets' save_to_disk"):
        list(iter_rows(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        list(iter_rows(tmp_path / "nope.parquet"))
    assert dataset_format(tmp_path / "a.PARQUET") == "parquet"
    assert dataset_format(tmp_path / "a.json") == "jsonl"
