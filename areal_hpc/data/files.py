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

Untrusted input, read within bounds: every file is opened only if it is a regular file (a FIFO,
a device or a directory in its place is refused, never waited on: `open_regular`), and no row
over `MAX_ROW_BYTES` is turned into Python objects: a jsonl line is read at most that far; a
parquet row group whose metadata says it decompresses beyond that a row, or more than
`BOMB_RATIO` times its compressed size past one row's cap, is refused unread; a table's row
over it is refused from its Arrow size, before conversion. MemoryError while reading names the
file (and the rows).

A key may be dotted to reach into nested fields, e.g. ``reward_model.ground_truth`` (verl's
parquet layout): `field(row, key)` resolves it; `iter_rows` checks `required_keys` that way.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
# One row's bytes (a jsonl line; a table row's Arrow size): a code row's tests may be large, but
# more is refused before parsing. The question itself is capped relative to the model's length by
# the preflight (data/prompts.py `too_many_chars`).
MAX_ROW_BYTES = 64 << 20
BOMB_RATIO = 100        # a parquet row group past one row's cap that decompresses more: refused
BATCH_ROWS = 4096
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


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str | None:
    """What a file of `st_mode` `mode` is, in words, when it is not a regular file (None when it is)."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, what: str = "dataset file",
                 max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (of at most `max_bytes`).
    A FIFO, a device, a socket or a directory is refused without waiting on it (stat first, then
    opened without blocking and checked again on the descriptor, in case it was swapped).
    Raises FileNotFoundError, or ValueError naming the file and what it is."""
    path = os.fspath(path)
    try:
        kind = file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path!r}") from None
    if kind is None:
        f = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC), "rb")
        st = os.fstat(f.fileno())
        kind = file_kind(st.st_mode)
        if kind is None and (max_bytes is None or st.st_size <= max_bytes):
            return f
        f.close()
        if kind is None:
            raise ValueError(f"{path}: {st.st_size} bytes, over the {max_bytes} a {what} may hold "
                             "(refused unread)")
    raise ValueError(f"{path}: {kind}, not a regular file (a {what} must be one)")


def irregular(folder: str | os.PathLike) -> str | None:
    """"PATH: what it is" for the first entry of `folder` that is neither a regular file nor a
    folder (symlinks followed; a dangling one included), None when there is none."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError as exc:
            return f"{entry.path}: {exc.strerror}"
        kind = file_kind(mode)
        if kind not in (None, "a directory"):
            return f"{entry.path}: {kind}, not a regular file"
    return None


def iter_rows(path: str | os.PathLike, required_keys: tuple[str, ...] = (),
              max_row_bytes: int | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of the dataset at ``path``, in order (module docstring).

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file and the
    row for a row that lacks one of ``required_keys`` or is over `max_row_bytes`, or naming the
    file for one that is not a regular file or that its format cannot read. `max_row_bytes`:
    MAX_ROW_BYTES unless given."""
    path = os.fspath(path)
    max_row_bytes = MAX_ROW_BYTES if max_row_bytes is None else max_row_bytes
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    kind = dataset_format(path)
    if kind == "jsonl":
        for where, obj in iter_objects(path, (), max_row_bytes):
            _require(where, obj, required_keys)
            yield where, obj
        return
    index = 0
    try:
        for start, batch in _batches(path, kind, max_row_bytes):
            big = _first_big_row(batch, max_row_bytes)
            if big is not None:
                raise ValueError(f"{path}[{start + big[0]}]: a row of {big[1]} bytes, over the "
                                 f"{max_row_bytes} a row may hold (refused unconverted)")
            index = start
            for row in batch.to_pylist():
                where = f"{path}[{index}]"
                _require(where, row, required_keys)
                yield where, row
                index += 1
    except MemoryError:
        raise ValueError(f"{path}: out of memory reading it (at row {index})") from None


def _first_big_row(batch, cap: int) -> tuple[int, int] | None:
    """(index, Arrow bytes) of the first row of `batch` (a table or record batch) over `cap`
    bytes, halving the batch where it is over (a slice's size is what it references)."""
    size = batch.nbytes
    if size <= cap or batch.num_rows == 0:
        return None
    if batch.num_rows == 1:
        return 0, size
    half = batch.num_rows // 2
    for offset, part in ((0, batch.slice(0, half)), (half, batch.slice(half))):
        found = _first_big_row(part, cap)
        if found is not None:
            return offset + found[0], found[1]
    return None


def _require(where: str, row: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not has_field(row, key):
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(row)})")


def _batches(path: str, kind: str, cap: int) -> Iterator[tuple[int, object]]:
    """(first row's index, Arrow record batch or table) for the whole dataset."""
    import pyarrow as pa

    try:
        if kind == "hf":
            yield from _hf_batches(path)
            return
        with open_regular(path) as f:
            yield from (_parquet_batches(path, f, cap) if kind == "parquet" else _arrow_batches(f))
    except (MemoryError, FileNotFoundError):
        raise
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable {kind} dataset: {exc}") from None


def _parquet_batches(path: str, f: BinaryIO, cap: int) -> Iterator[tuple[int, object]]:
    """A row group at a time, each after its metadata's sizes: refused unread when it
    decompresses beyond `cap` bytes a row, or past one row's cap to more than BOMB_RATIO times
    its compressed size (a 17 KB file holding a 512 MiB question)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    start = 0
    for g in range(pf.metadata.num_row_groups):
        rg = pf.metadata.row_group(g)
        n, size = rg.num_rows, rg.total_byte_size
        packed = sum(rg.column(j).total_compressed_size for j in range(rg.num_columns))
        if size > max(n, 1) * cap:
            why = f"over the {cap} a row may hold" + (f", for each of its {n} rows" if n > 1 else "")
        elif size > cap and size > BOMB_RATIO * max(packed, 1):
            why = f"over {BOMB_RATIO}x its {packed} bytes and past the {cap} a row may hold"
        else:
            why = None
        if why:
            rows = f"{path}[{start}]" if n == 1 else f"{path}[{start}:{start + n}]"
            raise ValueError(f"{rows}: row group {g} decompresses to {size} bytes, {why}: refused unread")
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g]):
            yield start, batch
            start += batch.num_rows


def _arrow_batches(f: BinaryIO) -> Iterator[tuple[int, object]]:
    """The record batches of an Arrow IPC file (random access) or stream (HF's caches), mapped
    from the descriptor that was checked (nothing copied)."""
    import pyarrow as pa

    if os.fstat(f.fileno()).st_size == 0:
        raise pa.ArrowInvalid("empty file")
    source = pa.BufferReader(pa.py_buffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
    start = 0
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        batches = pa.ipc.open_stream(source)
    for batch in batches:
        yield start, batch
        start += batch.num_rows


def _hf_batches(path: str) -> Iterator[tuple[int, object]]:
    splits = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits):
        try:
            with open_regular(splits, "dataset_dict.json", 1 << 20) as f:
                names = json.load(f).get("splits", [])
        except (OSError, ValueError, AttributeError):
            names = []
        raise ValueError(f"{path}: an HF DatasetDict with splits {names}: give one split's "
                         f"directory (e.g. {os.path.join(path, names[0] if names else 'train')})")
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise ValueError(f"{path}: a directory, but not one written by HF datasets' save_to_disk "
                         "(no state.json); give a jsonl, parquet or arrow file, or such a directory")
    bad = irregular(path)
    if bad:
        raise ValueError(f"{bad} (in an HF datasets directory, each file must be one)")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: an HF datasets directory, but the `datasets` package is not "
                         "installed (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(path).with_format("arrow")
    except Exception as exc:     # datasets raises its own types for a damaged directory
        raise ValueError(f"{path}: not a readable HF datasets directory: "
                         f"{type(exc).__name__}: {exc}") from None
    for start in range(0, len(ds), BATCH_ROWS):
        yield start, ds[start:start + BATCH_ROWS]     # an Arrow table, memory-mapped


def iter_objects(path: str | os.PathLike, required_keys: tuple[str, ...],
                 max_row_bytes: int | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, obj)`` for every non-blank line of ``path``; ``where`` is ``"path:lineno"``.

    Raises FileNotFoundError if ``path`` does not exist, and ValueError naming the file (not a
    regular file) or the file and the 1-based line number for a line over `max_row_bytes`
    (refused unparsed, no more of it read), not UTF-8 text, not a JSON object or lacking one of
    ``required_keys``.
    """
    path = os.fspath(path)
    max_row_bytes = MAX_ROW_BYTES if max_row_bytes is None else max_row_bytes
    with open_regular(path) as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(max_row_bytes + 1), b""), start=1):
            if len(raw) > max_row_bytes and not (len(raw) == max_row_bytes + 1 and raw.endswith(b"\n")):
                raise ValueError(f"{path}:{lineno}: a line over the {max_row_bytes} bytes a row may "
                                 "hold (refused unparsed)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[bad.start]:02x}: "
                                 f"{bad.reason})") from None
            yield from _parse_line(path, lineno, line, required_keys)


def _parse_line(path: str, lineno: int, line: str, required_keys: tuple[str, ...]):
    if not line.strip():
        return
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: bad JSON: {e.msg}") from e
    except ValueError as e:     # an integer of more digits than Python converts
        raise ValueError(f"{where}: bad JSON: {str(e).split(':')[0]}") from None
    except RecursionError:
        raise ValueError(f"{where}: bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in required_keys:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(obj)})")
    yield where, obj
