"""The environment interface: what a user implements, in one file, for multi-turn episodes
(docs/environments.md).

An environment is a class named ``path/to/file.py:ClassName`` or ``package.module:ClassName``
(the ``env.fn`` key, like ``reward.fn``), or a built-in by its name (``calculator``, ``python``).
One instance serves one episode; it is built with the keyword arguments of ``env.args``::

    class MyEnv(Environment):
        def reset(self, row: dict) -> str | list[int]:
            ...   # the data row -> the first prompt (text, tokenised once by us, or token ids)
        def step(self, turn_text: str, turn_ids: list[int]) -> Step:
            ...   # the model's turn -> Step(observation, done, reward, tool)

``step`` may also return a tuple ``(observation, done, reward)``. ``Step(discard="why")`` (or
``discard=True``) ends the episode as not the model's doing (a tool server that failed): its
tokens are not trained, and ``env.on_error`` says what that does to its group, as for an
environment that raised, hung or died. ``observation`` is text (the
job's ``env.observation_template`` wraps it, then it is tokenised once), a list of token ids
(appended as they are, between the template's parts), or None (nothing to append). ``reward``: the
episode's reward when ``done``; a number on an earlier turn is a per-turn reward, added to it.

Environments run in a child process of their own (env/runner.py), never in the caller's.
"""
from __future__ import annotations

import importlib
import inspect
import os
import runpy
import string
from dataclasses import dataclass, fields
from typing import Any, Optional, get_args

from ..config.rules import RANGES as CONFIG_RANGES
from ..config.schema import EnvConfig, OnError
from ..reward.custom import RewardFnError, resolve, split_spec

BUILTINS = {"calculator": "areal_hpc.env.calculator:Calculator",
            "python": "areal_hpc.env.python_tool:PythonTool"}
MAX_TOKEN_ID = (1 << 31) - 1
# The tools the built-ins declare for native tool calling (env.tool_parser), as JSON schemas.
BUILTIN_TOOLS = {
    "calculator": [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, "
        "+ - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}],
    "python": [{"type": "function", "function": {
        "name": "python", "description": "Run Python code in a sandbox (no network, no files); "
        "the result is what it prints. Names defined earlier in the episode stay defined.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}}],
}


class EnvConfigError(ValueError):
    """A bad env section or an environment class that cannot be used: one line naming the key."""


@dataclass
class ToolCall:
    """One tool call of an episode, for the rollout log: the tool's name, its arguments (text),
    the size of its output in bytes, its wall-clock seconds, and its error (None = it ran)."""
    name: str
    args: str = ""
    output_bytes: int = 0
    seconds: float = 0.0
    error: Optional[str] = None


@dataclass
class Step:
    """What an environment answers to a turn (or, from ``reset``, the first prompt in
    ``observation``). ``discard``: True or why (text): the episode ends here, discarded, not
    trained. ``error`` and ``cause``: set by the runner only, when the environment failed
    (raised, hung past its bound, died, answered garbage, discarded): the episode ends there,
    discarded for that cause (storage/episode_log.py DISCARD_CAUSES)."""
    observation: Any = None             # str, list[int] or None
    done: bool = False
    reward: Optional[float] = None
    tool: Optional[ToolCall] = None
    discard: Any = None
    error: Optional[str] = None
    cause: Optional[str] = None


class Environment:
    """The base class of environments (subclassing it is optional: any class with ``reset`` and
    ``step`` will do)."""

    def reset(self, row: dict):
        raise NotImplementedError

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        """Called when the episode ends (optional)."""




def from_mapping(section, key: str = "env") -> EnvConfig:
    """An EnvConfig from a mapping (a dict, an OmegaConf section), checked (`validate`)."""
    if section is None:
        section = {}
    if hasattr(section, "items") and not isinstance(section, dict):
        from omegaconf import OmegaConf
        section = OmegaConf.to_container(section, resolve=True)
    if not isinstance(section, dict):
        raise EnvConfigError(f"config key '{key}': expected a mapping, got {type(section).__name__}")
    known = {f.name for f in fields(EnvConfig)}
    for k in section:
        if k not in known:
            raise EnvConfigError(f"config key '{key}.{k}': unknown (known: {', '.join(sorted(known))})")
    cfg = EnvConfig(**section)
    validate(cfg, key)
    return cfg


def _bad(key: str, msg: str) -> EnvConfigError:
    return EnvConfigError(f"config key '{key}': {msg}")


def validate(cfg: EnvConfig, key: str = "env") -> None:
    """Raise EnvConfigError naming the first bad key (syntax only; `runner.check` imports fn)."""
    if cfg.on_error not in get_args(OnError):
        raise _bad(f"{key}.on_error", f"expected one of {', '.join(get_args(OnError))}, got {cfg.on_error!r}")
    if cfg.fn is not None:
        if not isinstance(cfg.fn, str):
            raise _bad(f"{key}.fn", f"expected a string, got {type(cfg.fn).__name__}")
        if cfg.fn not in BUILTINS:
            try:
                split_spec(cfg.fn)
            except RewardFnError as exc:
                raise _bad(f"{key}.fn", f"{exc} or a built-in ({', '.join(BUILTINS)})") from None
    if not isinstance(cfg.args, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                 for k in cfg.args):
        raise _bad(f"{key}.args", "expected a mapping of keyword-argument names to values")
    for name in (k.removeprefix("env.") for k in CONFIG_RANGES if k.startswith("env.")):
        v = getattr(cfg, name)
        if v is None and name == "max_episode_tokens":     # rollout.max_model_len
            continue
        typ = float if name.endswith("_s") else int         # seconds, else counts
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
            raise _bad(f"{key}.{name}", f"expected {typ.__name__}, got {v!r}")
        problem = CONFIG_RANGES[f"env.{name}"].problem(v)
        if problem:
            raise _bad(f"{key}.{name}", problem)
    check_tools(cfg, key)
    if not isinstance(cfg.turn_stop, (list, tuple)):
        raise _bad(f"{key}.turn_stop", f"expected a list of strings or token ids, got {cfg.turn_stop!r}")
    for i, s in enumerate(cfg.turn_stop):
        ok = (isinstance(s, str) and s) or (type(s) is int and 0 <= s <= MAX_TOKEN_ID)
        if not ok:
            raise _bad(f"{key}.turn_stop[{i}]", f"expected a non-empty string or a token id, got {s!r}")
    tpl = cfg.observation_template
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(tpl) if f is not None] \
            if isinstance(tpl, str) else None
    except ValueError as exc:
        raise _bad(f"{key}.observation_template", str(exc)) from None
    if names != ["observation"]:
        raise _bad(f"{key}.observation_template", "expected text with {observation} once and no "
                   f"other field (double other braces), got {tpl!r}")


def declared_tools(cfg: EnvConfig) -> list[dict]:
    """The tools of native tool calling: `env.tools`, else the built-in environment's own."""
    if cfg.tools:
        return [dict(t) for t in cfg.tools]
    return [dict(t) for t in BUILTIN_TOOLS.get(cfg.fn or "", ())]


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_tools(cfg: EnvConfig, key: str = "env") -> None:
    """The native tool-calling keys: every tool a function schema with a unique name, and
    with a parser: an environment, tools, and the plain observation template (the chat
    template renders the results)."""
    if not isinstance(cfg.tools, (list, tuple)):
        raise _bad(f"{key}.tools", f"expected a list of tool schemas, got {cfg.tools!r}")
    for i, t in enumerate(cfg.tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"].isidentifier()
                and isinstance(fn.get("parameters", {}), dict)):
            raise _bad(f"{key}.tools[{i}]", 'expected {"type": "function", "function": {"name": '
                       '<identifier>, "description": ..., "parameters": <JSON schema>}}')
    names = tool_names(list(cfg.tools))
    if len(set(names)) != len(names):
        raise _bad(f"{key}.tools", f"tool names must be unique, got {names}")
    for name in ("tool_parser", "reasoning_parser"):
        v = getattr(cfg, name)
        if v is not None and not (isinstance(v, str) and v):
            raise _bad(f"{key}.{name}", f"expected the name of one of vLLM's parsers, got {v!r}")
    if cfg.tool_parser is None:
        if cfg.tools:
            raise _bad(f"{key}.tools", "tools need env.tool_parser (the model's call format, "
                       "e.g. hermes)")
        return
    if cfg.fn is None:
        raise _bad(f"{key}.tool_parser", "native tool calling needs an environment (env.fn)")
    if not declared_tools(cfg):
        raise _bad(f"{key}.tools", f"env.tool_parser is set but no tool is declared ({cfg.fn} "
                   "declares none)")
    if cfg.observation_template != "{observation}":
        raise _bad(f"{key}.observation_template", "with env.tool_parser the chat template "
                   "renders the tool results: leave it {observation}")


def turn_stops(cfg: EnvConfig) -> tuple[list[str], list[int]]:
    """(stop strings, stop token ids) of ``env.turn_stop``, as an engine's sampling takes them."""
    return ([s for s in cfg.turn_stop if isinstance(s, str)],
            [s for s in cfg.turn_stop if not isinstance(s, str)])


def full_spec(fn: str, base: str | os.PathLike | None = None) -> str:
    """A built-in's spec, or the configured one with a relative file path made absolute."""
    return BUILTINS.get(fn) or resolve(fn, base)


def load_class(spec: str) -> type:
    """The class a spec names (its module imported here). Raises EnvConfigError. Call it in the
    environment's own process (env/runner.py), never in the job's."""
    where, name, is_file = split_spec(spec)
    if is_file and not os.path.isfile(where):
        raise EnvConfigError(f"{spec!r}: no such file {where!r}")
    try:
        names = (runpy.run_path(where, run_name="areal_user_env") if is_file
                 else vars(importlib.import_module(where)))
    except BaseException as exc:    # a module that raises (or exits) while it is imported
        first = (str(exc).strip().splitlines() or [""])[0]
        raise EnvConfigError(f"{spec!r}: cannot import {where!r}: {type(exc).__name__}: {first}") from None
    cls = names.get(name)
    if not inspect.isclass(cls):
        raise EnvConfigError(f"{spec!r}: {name!r} is " + ("missing" if cls is None else
                             f"a {type(cls).__name__}, not a class"))
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))
               or getattr(cls, m) is getattr(Environment, m)]
    if missing:
        raise EnvConfigError(f"{spec!r}: {name} has no {' or '.join(missing)} method")
    return cls
