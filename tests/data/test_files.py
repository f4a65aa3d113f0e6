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


# -- untrusted files, read within bounds ---------------------------------------------------------
def test_only_regular_files_are_opened_and_a_fifo_is_never_waited_on(tmp_path):
    import os
    import socket

    from areal_hpc.data.files import irregular, open_regular
    os.mkfifo(tmp_path / "f.jsonl")
    (tmp_path / "d.jsonl").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.jsonl"))
    try:
        for name, kind in (("f.jsonl", "a FIFO"), ("s.jsonl", "a socket")):
            with pytest.raises(ValueError, match=rf"{name}: {kind}, not a regular file"):
                open_regular(tmp_path / name)
            with pytest.raises(ValueError, match=rf"{name}: {kind}"):
                list(iter_rows(tmp_path / name))
        with pytest.raises(ValueError, match=r"/dev/null: a character device, not a regular file"):
            open_regular("/dev/null")
        with pytest.raises(ValueError, match=r"d\.jsonl: a directory"):
            open_regular(tmp_path / "d.jsonl")
        (tmp_path / "ok.jsonl").write_text("{}\n")
        with pytest.raises(ValueError, match=r"ok\.jsonl: 3 bytes, over the 2 a x may hold"):
            open_regular(tmp_path / "ok.jsonl", "x", 2)
        with open_regular(tmp_path / "ok.jsonl", "x", 3) as f:
            assert f.read() == b"{}\n"
        assert irregular(tmp_path) == f"{tmp_path}/f.jsonl: a FIFO, not a regular file"
    finally:
        sock.close()


def test_a_jsonl_line_over_the_row_cap_is_named_and_not_read_further(tmp_path):
    path = tmp_path / "d.jsonl"
    fits = json.dumps({"question": "1" * 80, "answer": "2"})
    path.write_text(fits + "\n" + fits + "x" * 10_000 + "\n")
    got = iter_rows(path, max_row_bytes=len(fits))
    assert next(got)[0] == f"{path}:1"                              # a line of exactly the cap
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: a line over the {len(fits)} bytes a row may hold"):
        next(got)
    path.write_bytes(b'{"question": "1", "answer": "2"}\n{"question": "\xff"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0xff"):
        list(iter_rows(path))
    path.write_text('{"question": "1", "answer": "2"}\n{"question": ' + "1" * 5000 + "}\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: bad JSON: Exceeds the limit \(4300 digits\)"):
        list(iter_rows(path))


def _random_text(n: int) -> str:
    import random
    rng = random.Random(n)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


@pytest.mark.parametrize("fmt", ["parquet", "arrow-file", "arrow-stream", "hf"])
def test_a_table_row_over_the_cap_is_named_before_it_is_converted(tmp_path, fmt):
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(100)]
    rows[57] = {"question": _random_text(300_000), "answer": "1"}       # barely compressible
    path = _write(rows, tmp_path, fmt)
    with pytest.raises(ValueError, match=r"\[57\]: a row of \d+ bytes, over the 200000 a row may hold"):
        list(iter_rows(path, max_row_bytes=200_000))
    assert len(list(iter_rows(path, max_row_bytes=400_000))) == 100


def test_a_parquet_row_group_past_the_cap_is_refused_from_its_metadata(tmp_path):
    rows = [{"question": "1+1", "answer": "2"}] * 9 + [{"question": "0" * 3_000_000, "answer": "1"}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5, compression="zstd")
    with pytest.raises(ValueError, match=r"d\.parquet\[5:10\]: row group 1 decompresses to \d+ bytes, "
                                         r"over 100x its \d+ bytes and past the 1000000 a row may hold"):
        list(iter_rows(path, max_row_bytes=1_000_000))
    with pytest.raises(ValueError, match=r"d\.parquet\[5:10\]: row group 1 .* over the 100000 a row may "
                                         r"hold, for each of its 5 rows"):
        list(iter_rows(path, max_row_bytes=100_000))


def test_an_hf_directory_with_a_fifo_inside_is_refused(tmp_path):
    import os
    path = _write(MATH, tmp_path, "hf")
    os.mkfifo(path / "extra.arrow")
    with pytest.raises(ValueError, match=r"extra\.arrow: a FIFO, not a regular file \(in an HF datasets"):
        list(iter_rows(path))


# Reads a parquet file in a child with the given row cap; prints the refusal and the peak RSS
# (VmHWM: this process image's own, where ru_maxrss would carry the parent's over from the fork).
PEAK = """
import json, re, sys
from areal_hpc.data.files import iter_rows
try:
    n, refused = len(list(iter_rows(sys.argv[1], max_row_bytes=int(sys.argv[2])))), None
except ValueError as exc:
    n, refused = 0, str(exc)
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
print(json.dumps({"rows": n, "refused": refused, "peak": peak}))
"""


def test_a_compression_bomb_is_refused_before_it_takes_memory(tmp_path):
    """A 64 MiB question in a few KiB: refused with the peak memory of a reader that read nothing,
    where reading it takes at least its size (the same child, a cap that lets it through)."""
    import subprocess
    import sys
    from pathlib import Path
    size = 64 << 20
    offsets = pa.array([0, size], pa.int32()).buffers()[1]
    table = pa.table({"question": pa.StringArray.from_buffers(1, offsets, pa.py_buffer(bytes(size))),
                      "answer": ["1"]})
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, path, compression="zstd")
    del table
    assert path.stat().st_size < (64 << 10)
    root = Path(__file__).resolve().parents[2]

    def child(cap):
        out = subprocess.run([sys.executable, "-c", PEAK, str(path), str(cap)], cwd=root, timeout=600,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    refused, read = child(1 << 20), child(128 << 20)
    assert "bomb.parquet[0]: row group 0 decompresses to" in refused["refused"] and refused["rows"] == 0
    assert read["refused"] is None and read["rows"] == 1
    assert read["peak"] - refused["peak"] > size
