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
import re
import os
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema import (CheckpointConfig, ConfigError, DataConfig, ModelConfig, RewardConfig,
                     RewardFnConfig, RolloutConfig, RunConfig, TopologyConfig, TrainConfig,
                     WeightSyncConfig)
from .rules import CHOICES, OFF_POLICY_OBJECTIVES, RANGES, validate

__all__ = ["load", "to_yaml", "to_dict", "validate", "ConfigError", "RunConfig", "ModelConfig",
           "DataConfig", "TopologyConfig", "RolloutConfig", "RewardConfig", "RewardFnConfig",
           "TrainConfig", "WeightSyncConfig", "CheckpointConfig", "RANGES", "CHOICES",
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


def _read_utf8(path: Path, what: str) -> str:
    """A file's text; unreadable or non-UTF-8 is one ConfigError line naming file and line."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc.strerror})") from None
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
    text = _read_utf8(path, "the config file")
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


def _check_env_interpolations(tree, prefix: str = "") -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _check_env_interpolations(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_env_interpolations(v, f"{prefix[:-1]}[{i}].")
    elif isinstance(tree, str) and "oc.env" in tree and prefix[:-1] not in ENV_KEYS \
            and not re.fullmatch(r"reward\.functions\[\d+\]\.fn", prefix[:-1]):
        raise ConfigError(f"config key '{prefix[:-1]}': an environment interpolation ({tree}) would "
                          "be written, resolved, into config.yaml, the rollout log and every "
                          f"checkpoint; only {', '.join(ENV_KEYS)} (and reward.functions[i].fn) "
                          "may use one")


def load(yaml_path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Schema ← YAML ← `key=value` overrides; validated; returns a RunConfig object."""
    schema = OmegaConf.structured(RunConfig)
    try:
        layers = [schema]
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            layers.append(_read_yaml(path))
        layers.append(_read_overrides(list(overrides)))
        for layer in layers[1:]:
            for key, why in REMOVED_KEYS.items():
                if key in layer:
                    del layer[key]
                    logging.getLogger(__name__).warning(
                        "config key '%s' is no longer used (%s); ignored", key, why)
        for layer in layers[1:]:
            _check_env_interpolations(OmegaConf.to_container(layer, resolve=False))
        for layer in layers[1:]:    # OmegaConf's merge error for these names no key
            for key, value in OmegaConf.to_container(layer, resolve=False).items():
                if key in schema and OmegaConf.is_dict(schema[key]) and not isinstance(value, dict):
                    raise ConfigError(f"config key '{key}': must be a mapping of {key}.* keys, "
                                      f"got {value!r}")
        merged = OmegaConf.merge(*layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config key '{missing[0]}' is required but not set")
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(cfg)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
