"""Dataset rows from the files users have: jsonl, parquet, arrow, or a local HF `datasets` directory.

`iter_rows(path, required_keys)` yields ``(where, row)`` for every row, ``row`` a dict of Python
values, whatever the format:

- ``*.parquet``: read with pyarrow, a batch at a time;
- ``*.arrow`` / ``*.feather`` / ``*.ipc``: an Arrow IPC file or stream (HF `datasets` caches and
  `save_to_disk` shards are streams);
- a directory written by HF `datasets`' ``save_to_disk`` (it holds ``state.json``), read with
  ``datasets.load_from_disk``, memory-mapped, from local disk only (nothing is ever fetched from a
  hub). A ``DatasetDict`` directory (``dataset_dict.json``) is refused with its splits named: the
  path must be one split's directory, e.g. ``gsm8k/train``;
- anything else: jsonl, one JSON object per line (data/jsonl.py).

``where`` names the row for error messages: ``path:LINE`` (1-based line) for jsonl,
``path[INDEX]`` (0-based row index, as ``dataset[INDEX]`` reads it) for the tables.

A key may be dotted to reach into nested fields, e.g. ``reward_model.ground_truth`` (verl's
parquet layout): `field(row, key)` resolves it; `iter_rows` checks `required_keys` that way.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_MISSING = object()     # no default given
_ABSENT = object()      # has_field's default


def field(row: dict, key: str, default=_MISSING):
    """``row[key]``, or with a dotted key the nested field (``a.b`` is ``row["a"]["b"]``); a key
    present as it is wins over its dotted reading. Raises KeyError naming the key when absent and
    no default is given."""
    if key in row:
        return row[key]
    if "." in key:
        value = row
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            return value
    if default is _MISSING:
        raise KeyError(key)
    return default


def has_field(row: dict, key: str) -> bool:
    return field(row, key, _ABSENT) is not _ABSENT


def dataset_format(path: str | os.PathLike) -> str:
    """"jsonl", "parquet", "arrow" or "hf" (a `save_to_disk` directory), by the path's suffix
    (or it being a directory)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "hf"
    return TABLE_SUFFIXES.get(os.path.splitext(path)[1].lower(), "jsonl")


def iter_rows(path: str | os.PathLike, required_keys: tuple[str, ...] = ()) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of the dataset at ``path``, in order (module docstring).

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    row for a row that lacks one of ``required_keys``, or naming the file for one that its format
    cannot read."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    kind = dataset_format(path)
    if kind == "jsonl":
        for where, obj in iter_objects(path, ()):
            _require(where, obj, required_keys)
            yield where, obj
        return
    index = 0
    for batch in _batches(path, kind):
        for row in batch:
            where = f"{path}[{index}]"
            _require(where, row, required_keys)
            yield where, row
            index += 1


def _require(where: str, row: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not has_field(row, key):
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(row)})")


def _batches(path: str, kind: str) -> Iterator[list[dict]]:
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq
            for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                yield batch.to_pylist()
        elif kind == "arrow":
            yield from _arrow_batches(path)
        else:
            yield from _hf_batches(path)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: not a readable {kind} dataset: {exc}") from None


def _arrow_batches(path: str) -> Iterator[list[dict]]:
    """The rows of an Arrow IPC file (random access) or stream (HF's caches), a record batch at
    a time, converted while the file is mapped."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            for batch in pa.ipc.open_stream(source):
                yield batch.to_pylist()
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i).to_pylist()


def _hf_batches(path: str) -> Iterator[list[dict]]:
    splits = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits):
        try:
            with open(splits, encoding="utf-8") as f:
                names = json.load(f).get("splits", [])
        except (OSError, ValueError, AttributeError):
            names = []
        raise ValueError(f"{path}: an HF DatasetDict with splits {names}: give one split's "
                         f"directory (e.g. {os.path.join(path, names[0] if names else 'train')})")
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise ValueError(f"{path}: a directory, but not one written by HF datasets' save_to_disk "
                         "(no state.json); give a jsonl, parquet or arrow file, or such a directory")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: an HF datasets directory, but the `datasets` package is not "
                         "installed (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:     # datasets raises its own types for a damaged directory
        raise ValueError(f"{path}: not a readable HF datasets directory: "
                         f"{type(exc).__name__}: {exc}") from None
    for start in range(0, len(ds), 4096):
        batch = ds[start:start + 4096]          # column -> values
        cols = list(batch)
        yield [dict(zip(cols, values)) for values in zip(*(batch[c] for c in cols))]


def iter_objects(path: str | os.PathLike, required_keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(where, obj)`` for every non-blank line of ``path``; ``where`` is ``"path:lineno"``.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    1-based line number for a line that is not UTF-8 text, not a JSON object or lacks one of
    ``required_keys``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                yield from _parse_line(path, lineno, line, required_keys)
    except UnicodeDecodeError as e:
        # Text mode decodes ahead of the line it hands out: find the line in the bytes.
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    raise ValueError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[bad.start]:02x}: "
                                     f"{bad.reason})") from None
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None


def _parse_line(path: str, lineno: int, line: str, required_keys: tuple[str, ...]):
    if not line.strip():
        return
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: bad JSON: {e.msg}") from e
    except RecursionError:
        raise ValueError(f"{where}: bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in required_keys:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(obj)})")
    yield where, obj
