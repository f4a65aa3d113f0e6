"""Run configuration: a tree of dataclasses, loaded from YAML with `key=value` overrides.

The schema is schema.py, the values' ranges, choices and cross-field rules rules.py; this file
loads (YAML, overrides, environment interpolations) and serialises. Every field has a simple
type so the whole tree serialises (into the rollout HDF5 attributes and
checkpoint manifests) and back. Unknown keys and wrong types are errors that name the key; they
are raised by `load()` before any rank starts work. Every numeric key has a range (`RANGES`),
checked by `validate()`. No file but the YAML is read here: the model directory, the datasets
and every other start-up check are preflight.py's. Every
refusal is one `ConfigError` line naming the key, file or row.
"""
from __future__ import annotations

import io
import logging
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import OmegaConfBaseException

from .schema import (CheckpointConfig, ConfigError, DataConfig, ModelConfig, RewardConfig,
                     RewardFnConfig, RolloutConfig, RunConfig, TopologyConfig, TrainConfig,
                     WeightSyncConfig)
from .rules import OFF_POLICY_OBJECTIVES, RANGES, validate

__all__ = ["load", "to_yaml", "to_dict", "validate", "ConfigError", "RunConfig", "ModelConfig",
           "DataConfig", "TopologyConfig", "RolloutConfig", "RewardConfig", "RewardFnConfig",
           "TrainConfig", "WeightSyncConfig", "CheckpointConfig", "RANGES",
           "OFF_POLICY_OBJECTIVES"]


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    lines = str(exc).splitlines()
    msg = lines[0] if lines else type(exc).__name__
    return f"config key '{key}': {msg}" if key else msg


def _yaml_problem(exc: yaml.YAMLError, context_line: bool = True) -> tuple[int | None, str]:
    """(1-based line, one-line description) of a PyYAML error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    if problem:
        what = problem
        cmark = getattr(exc, "context_mark", None)
        if context:
            where = (f" at line {cmark.line + 1}" if context_line and cmark is not None
                     and cmark is not mark else "")
            what += f" ({context}{where})"
    else:
        lines = str(exc).splitlines()
        what = lines[0] if lines else type(exc).__name__
    return (mark.line + 1 if mark is not None else None), " ".join(what.split())


# The most the config YAML (and a model's config.json, which the preflight reads with this
# function) may hold before it is parsed.
MAX_CONFIG_BYTES = 1 << 20


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"


def read_utf8(path: Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """A regular file's text, at most `max_bytes`; anything else (a FIFO, a device, a directory:
    opened without blocking, so that none of them hangs), a larger file, unreadable or non-UTF-8
    text is one ConfigError line naming the file (and the line)."""
    try:
        kind = _not_regular(os.stat(path).st_mode)
        if kind is None:    # no wait on a FIFO swapped in since; fstat says what was opened
            with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC), "rb") as f:
                kind = _not_regular(os.fstat(f.fileno()).st_mode)
                raw = f.read(max_bytes + 1) if kind is None else b""
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if kind is not None:
        raise ConfigError(f"{path}: cannot read {what}: {kind}, not a regular file")
    if len(raw) > max_bytes:
        raise ConfigError(f"{path}: cannot read {what}: over {max_bytes} bytes (the cap before parsing)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}: "
                          f"{exc.reason})") from None


def _read_yaml(path: Path):
    """A YAML file as an OmegaConf node; syntax errors, duplicate keys (OmegaConf's loader refuses
    them), text that is not UTF-8 and a top level that is not a mapping are one ConfigError line
    naming the file and line."""
    text = read_utf8(path, "the config file")
    try:
        node = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        line, what = _yaml_problem(exc)
        raise ConfigError(f"{path}:{line}: bad YAML: {what}" if line else
                          f"{path}: bad YAML: {what}") from None
    if not OmegaConf.is_dict(node):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level, "
                          f"got a {type(OmegaConf.to_container(node)).__name__}")
    return node


def _read_overrides(overrides: list[str]):
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(f"override must be key=value, got: {bad[0]!r}")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError:
        for o in overrides:     # name the one that is bad
            try:
                OmegaConf.from_dotlist([o])
            except yaml.YAMLError as exc:
                key = o.split("=", 1)[0]
                raise ConfigError(f"config key '{key}': override {o!r} is not a valid YAML "
                                  f"value: {_yaml_problem(exc, False)[1]}") from None
        raise


# Keys that configs of earlier releases may hold (a run's config.yaml, a checkpoint's): ignored
# with a warning, so that old runs still resume, export and evaluate.
REMOVED_KEYS = {"log_every": "every step is logged to metrics.jsonl"}


# Keys whose value may come from the environment (`${oc.env:SCRATCH}/runs`): paths. Anywhere else
# an environment value would be written, resolved, into config.yaml, the rollout log and every
# checkpoint (a token or password among them).
ENV_KEYS = ("output_dir", "model.path", "data.train_path", "data.eval_path", "data.chat_template",
            "reward.fn")


def _env_allowed(key: str) -> bool:
    return key in ENV_KEYS or re.fullmatch(r"reward\.functions\[\d+\]\.fn", key) is not None


def _leaves(tree, path: tuple = ()):
    """(path, value) of every leaf of a container tree (dicts and lists), a path being its keys."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        yield path, tree
        return
    for k, v in items:
        yield from _leaves(v, (*path, k))


def _key(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def _raw(tree, key: str):
    """The unresolved value at `key` ("a.b[0]") of a container tree ("?" when it has none)."""
    for part in re.findall(r"[^.\[\]]+", key):
        try:
            tree = tree[int(part)] if isinstance(tree, list) else tree[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return "?"
    return tree


def _env_refused(key: str, raw) -> ConfigError:
    return ConfigError(f"config key '{key}': an environment interpolation ({raw}) would be written, "
                       "resolved, into config.yaml, the rollout log and every checkpoint; only "
                       f"{', '.join(ENV_KEYS)} (and reward.functions[i].fn) may use one")


def _check_env_interpolations(merged) -> None:
    """The rule of ENV_KEYS on what the config resolves to, whatever the route: `oc.env` answers
    a marker meanwhile, and a key outside ENV_KEYS whose resolved value holds it (a nested
    resolver name `${oc.${x}:...}`, `oc.decode`, `oc.select`, a copy of an allowed key), or whose
    type refuses it, is refused. Its environment value is never read here."""
    marker = f"areal_env_{secrets.token_hex(8)}"
    raw = OmegaConf.to_container(merged, resolve=False)
    saved = BaseContainer._resolvers["oc.env"]
    try:
        OmegaConf.register_resolver("oc.env", lambda *args, **kwargs: marker, replace=True,
                                    annotation_validation="off")
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        if marker not in str(exc):
            raise
        key = str(getattr(exc, "full_key", None) or "?")
        raise _env_refused(key, _raw(raw, key)) from None
    finally:
        BaseContainer._resolvers["oc.env"] = saved
    for path, value in _leaves(tree):
        key = _key(path)
        if marker in str(value) and not _env_allowed(key):
            raise _env_refused(key, _raw(raw, key))


def load(yaml_path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Schema ← YAML ← `key=value` overrides; validated; returns a RunConfig object."""
    schema = OmegaConf.structured(RunConfig)
    try:
        layers = [schema]
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.exists():
                raise ConfigError(f"config file not found: {path}")
            layers.append(_read_yaml(path))
        layers.append(_read_overrides(list(overrides)))
        for layer in layers[1:]:
            for key, why in REMOVED_KEYS.items():
                if key in layer:
                    del layer[key]
                    logging.getLogger(__name__).warning(
                        "config key '%s' is no longer used (%s); ignored", key, why)
        for layer in layers[1:]:    # OmegaConf's merge error for these names no key
            for key, value in OmegaConf.to_container(layer, resolve=False).items():
                if key in schema and OmegaConf.is_dict(schema[key]) and not isinstance(value, dict):
                    raise ConfigError(f"config key '{key}': must be a mapping of {key}.* keys, "
                                      f"got {value!r}")
        merged = OmegaConf.merge(*layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config key '{missing[0]}' is required but not set")
        _check_env_interpolations(merged)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(cfg)
    _check_name(cfg.name)
    return cfg


NAME_MAX = 255      # bytes of one path component (Linux's NAME_MAX)


def _check_name(name: str) -> None:
    """`name` is one plain folder name: the run lives in output_dir/name, never output_dir itself,
    its parent or a folder further down (storage/run_dir.py `place` checks where it resolves)."""
    why = ("empty" if not name else "output_dir itself" if name == "." else
           "output_dir's parent" if name == ".." else "a path, not a name" if "/" in name else
           "a leading '-' reads as an option" if name.startswith("-") else
           "a control character" if any(ord(c) < 32 or ord(c) == 127 for c in name) else
           f"over {NAME_MAX} bytes" if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX else None)
    if why:
        raise ConfigError(f"config key 'name': must be a plain folder name inside output_dir, got "
                          f"{name[:80]!r} ({why})")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
