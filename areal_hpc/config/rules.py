"""What a configuration's values must satisfy: every numeric key's range (`RANGES`) and the
cross-field rules (`validate`); one `ConfigError` line naming the key. An enumeration's choices
are its field's `Literal` type in schema.py, which the schema itself checks on loading."""
from __future__ import annotations

import math
import os
import signal as _signal
import string
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import get_args

from ..cpus import parse_cpus
from ..data.answers import EXTRACTORS   # a pure module (floor 1): the extractors' names, once
from .schema import ConfigError, OffPolicy, RunConfig


# Beyond a generator's own bound on a weight receive: its watch's poll, the kill of the stalled
# engine's processes (up to 10 s) and the heartbeat that says its engine is down.
LOADING_MARGIN_S = 30.0


def receive_bound_s(cfg: RunConfig) -> float:
    """A generator's bound on one weight receive over the weight group: the group's collective
    timeout (weights.timeout_s, a peer that died mid-broadcast) and then one engine stall
    (rollout.engine_stall_s). Its watch finds a stalled engine there, kills it and restarts it."""
    return cfg.weights.timeout_s + cfg.rollout.engine_stall_s


def require(cond: bool, key: str, msg: str) -> None:
    """One config rule: `cond` must hold, else a ConfigError naming `key` (one line)."""
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


INT_MAX = 2**31 - 1          # counts end up in int32 tensors, vLLM / torch arguments
MAX_RANKS = 65536            # ranks of one role (the launcher and Slurm bound the real number)
SEED_MAX = 2**31 - 1         # + rank offsets stays below numpy's 2**32
MAX_TIMEOUT_S = 30 * 86400.0  # torch.distributed / threading timeouts must be finite
MAX_REWARD_WORKERS = 512      # reward processes per generator: more is a typo, not a plan
MAX_REWARD_TIMEOUT_S = 3600.0  # one sample's scoring; the pool restarts a worker past it
# Every config number that becomes part of a reward or its shaping (reward.functions[].weight,
# train.reward_bias / reward_scaling / reward_clip) is finite and at most this in magnitude. With
# a function's value bounded the same (reward/custom.py MAX_ABS_VALUE) a weighted term is at
# most 1e12 and (r + bias) * scaling at most ~1e18 per function: finite in float32 (3.4e38), in
# which the rollout log and the trainer hold rewards. A larger number is a typo, not a weight.
MAX_REWARD_MAGNITUDE = 1e6


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric key; None = unbounded on that side (floats must be finite)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def problem(self, value) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}, got {_num(value)}" + self.why
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return f"must be {'<' if self.hi_open else '<='} {_num(self.hi)}, got {_num(value)}" + self.why
        return None


def _num(x) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:g}"


_COUNT = Range(1, INT_MAX)
_NONNEG = Range(0, INT_MAX)
_TIMEOUT = Range(0.001, MAX_TIMEOUT_S, why=" (seconds)")
_RANKS = Range(1, MAX_RANKS)
_REWARD_NUMBER = Range(-MAX_REWARD_MAGNITUDE, MAX_REWARD_MAGNITUDE,
                       why=" (a reward term; a larger one overflows float32 in the log and the loss)")

# Every int / float key of the schema (reward.* is checked in `validate` itself); optional keys
# are checked when set. tests/config checks that no numeric key is missing here.
RANGES: dict[str, Range] = {
    "env.max_turns": Range(1, 1000),
    "env.max_episode_tokens": Range(2, 1 << 24),
    "env.call_timeout_s": Range(0.01, 3600, why=" (seconds)"),
    "env.start_timeout_s": Range(1, 3600, why=" (seconds)"),
    "env.memory_mb": Range(64, 1 << 20),
    "env.output_bytes": Range(0, 1 << 30),
    "env.max_episodes": Range(1, 4096),
    "data.eval_limit": Range(0, INT_MAX, why=" (0 = all)"),
    "data.eval_samples": Range(1, 65536),
    "data.eval_every_steps": _NONNEG,
    "data.seed": Range(0, SEED_MAX),
    "topology.n_trainers": _RANKS,
    "topology.n_generators": _RANKS,
    "topology.tp": _RANKS,
    "topology.pp": _RANKS,
    "topology.gpu_mem_gib": Range(0, 65536, why=" (0 = no memory preflight)"),
    "topology.host_mem_gib": Range(0, 1 << 24, why=" (GiB of a node; 0 = no host-memory preflight)"),
    "topology.mfu": Range(0, 1, lo_open=True, why=" (model-FLOPs utilisation)"),
    "rollout.group_size": Range(1, 65536),
    "rollout.max_new_tokens": _COUNT,
    # vLLM refuses temperatures above 2 and raises those below 0.01 to 0.01, which would no
    # longer be the temperature the trainer scores the behaviour log-probs with.
    "rollout.temperature": Range(0.01, 2.0, why=" (vLLM samples at temperatures in [0.01, 2])"),
    "rollout.top_p": Range(0, 1, lo_open=True),
    "rollout.max_staleness": _NONNEG,
    "rollout.max_concurrent_prompts": _COUNT,
    "rollout.max_reissues": _NONNEG,
    "rollout.max_model_len": Range(2, INT_MAX),
    "rollout.kv_cache_gib": Range(1, 65536, why=" (or null: vLLM's default)"),
    "rollout.gpu_memory_utilization": Range(0, 1, lo_open=True),
    "rollout.heartbeat_s": _TIMEOUT,
    "rollout.generator_timeout_s": _TIMEOUT,
    "rollout.collective_timeout_s": _TIMEOUT,
    "rollout.engine_restarts": Range(0, 1000, why=" (engine restarts per generator in the window)"),
    "rollout.engine_restart_window_s": _TIMEOUT,
    "rollout.engine_stall_s": _TIMEOUT,
    "rollout.engine_memory_wait_s": _TIMEOUT,
    "rollout.progress_timeout_s": Range(0, MAX_TIMEOUT_S, why=" (seconds; 0 = off)"),
    "rollout.engine_tp": _RANKS,
    "rollout.max_num_seqs": _COUNT,
    "rollout.max_num_batched_tokens": _COUNT,
    "train.total_steps": _COUNT,
    "train.batch_prompts": _COUNT,
    "train.lr": Range(0, 1, lo_open=True),
    "train.lr_warmup_steps": _NONNEG,
    "train.lr_decay_steps": _COUNT,
    "train.min_lr": Range(0, 1),
    "train.weight_decay": Range(0),
    "train.adam_beta1": Range(0, 1, hi_open=True),
    "train.adam_beta2": Range(0, 1, hi_open=True),
    "train.adam_eps": Range(0, 1, lo_open=True),
    "train.clip_grad": Range(0, why=" (0 = no clipping)"),
    "train.ppo_minibatches": _COUNT,
    "train.eps_clip": Range(0, 1, lo_open=True, hi_open=True),
    "train.eps_clip_high": Range(0, lo_open=True),
    "train.dual_clip": Range(1, lo_open=True, why=" (or null: off)"),
    "train.behav_imp_weight_cap": Range(1, why=" (or null: no cap)"),
    "train.behav_clip": Range(0, 1, lo_open=True, hi_open=True),
    "train.behav_imp_weight_floor": Range(0, 1, lo_open=True),
    "train.seq_imp_weight_low": Range(0, 1, lo_open=True),
    "train.seq_imp_weight_high": Range(1),
    "train.behav_kl_coef": Range(0, 10),
    "train.overlong_buffer": _COUNT,
    "train.reward_bias": _REWARD_NUMBER,
    "train.reward_scaling": Range(0, MAX_REWARD_MAGNITUDE, lo_open=True, why=_REWARD_NUMBER.why),
    "train.reward_clip": Range(0, MAX_REWARD_MAGNITUDE, lo_open=True, why=_REWARD_NUMBER.why),
    "train.max_tokens_per_mb": _COUNT,
    "train.logprob_chunk_tokens": _COUNT,
    "train.recompute_num_layers": _COUNT,
    "train.seed": Range(0, SEED_MAX),
    "weights.bucket_mb": Range(1, 65536),
    "weights.timeout_s": _TIMEOUT,
    "weights.join_timeout_s": _TIMEOUT,
    "checkpoint.every_steps": Range(0, INT_MAX, why=" (0 = none on a timer)"),
    "checkpoint.keep": _COUNT,
    "checkpoint.export_chunk_mb": Range(1, 65536),
    "checkpoint.async_max_host_gb": Range(0, 1 << 20, why=" (GiB; 0 = no bound)"),
    "checkpoint.disk_margin_gb": Range(0, 1 << 20, why=" (GiB; or null: no free-space check)"),
    "checkpoint.signal_lead_s": Range(0, MAX_TIMEOUT_S, why=" (seconds; 0 = from the batch script)"),
    "checkpoint.time_limit_s": Range(0, MAX_TIMEOUT_S, why=" (seconds; 0 = from Slurm)"),
}

# train.off_policy's choices (algo/ppo.py OffPolicy says what each does).
OFF_POLICY_OBJECTIVES = get_args(OffPolicy)

# Preemption signals must be catchable (KILL, STOP are not), not synchronous faults (a handler
# that returns re-runs the faulting instruction) and not CHLD (every child process exit sends it).
UNUSABLE_SIGNALS = ("KILL", "STOP", "SEGV", "BUS", "FPE", "ILL", "CHLD")


def _get(cfg: RunConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_ranges(cfg: RunConfig) -> None:
    for key, rng in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        problem = rng.problem(value)
        if problem:
            raise ConfigError(f"config key '{key}': {problem}")


def check_signals(names: list) -> None:
    for name in names:
        require(isinstance(name, str) and f"SIG{name}" in _signal.Signals.__members__,
               "checkpoint.signals", f"unknown signal {name!r} (names without SIG, e.g. USR1, TERM)")
        why = "cannot be caught" if name in ("KILL", "STOP") else "not a notification signal"
        require(name not in UNUSABLE_SIGNALS, "checkpoint.signals",
               f"SIG{name} cannot announce a preemption ({why}); use e.g. USR1 or TERM")


# The fields `data.prompt_template` may use, per data.kind: the controller fills the template with
# `template.format(question=row["question"])` (data/prompts.py `prompt_ids`; for code, the row's
# prompt is its "question").
TEMPLATE_FIELDS = {"math": ("question",), "code": ("question",)}


def check_template(template: str, kind: str, key: str = "data.prompt_template") -> None:
    """The fields of `template` (str.format syntax) must be ones the data kind fills in."""
    fields = TEMPLATE_FIELDS.get(kind, ())
    names = ", ".join("{" + f + "}" for f in fields)
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:   # "Single '}' encountered", "expected '}' before end of string"
        raise ConfigError(f"config key '{key}': {exc} in {template!r} (write literal braces as "
                          f"{{{{ and }}}})") from None
    used = set()
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        require(name in fields, key,
               f"unknown field {{{name}}} in {template!r}: data.kind={kind} fills in {names} "
               f"(write literal braces as {{{{ and }}}})" if name else
               f"positional field {{}} in {template!r}: name it, one of {names}")
        require(conversion in (None, "s", "r", "a"), key, f"bad conversion !{conversion} in {{{name}}}")
        require("{" not in (spec or ""), key, f"nested field in the format spec of {{{name}}}")
        try:
            format("x", spec or "")
        except ValueError as exc:
            raise ConfigError(f"config key '{key}': bad format spec {{{name}:{spec}}}: {exc}") from None
        used.add(name)
    require(bool(used), key, f"{template!r} has no field: every prompt would be the same text "
           f"(use {names})")


# The form of reward.fn and reward.functions[].fn (reward/custom.py imports what they name, at the
# preflight).
SPEC_FORM = "expected 'package.module:function' or 'path/to/file.py:function'"


def split_reward_spec(spec) -> tuple[str, str, bool]:
    """(module or file, function name, is_file) of ``'pkg.mod:fn'`` / ``'path/file.py:fn'``;
    ValueError when `spec` has neither form."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{spec!r}: {SPEC_FORM}")
    where, name = spec.rsplit(":", 1)
    if not where or not name.isidentifier():
        raise ValueError(f"{spec!r}: {SPEC_FORM}")
    return where, name, where.endswith(".py") or os.sep in where or "/" in where


def reward_functions(cfg: RunConfig) -> list[tuple[str, str, float]]:
    """(config key, spec, weight) of each configured reward function: reward.fn, then
    reward.functions."""
    r = cfg.reward
    return ([("reward.fn", r.fn, 1.0)] if r.fn else []) + [
        (f"reward.functions[{i}]", f.fn, f.weight) for i, f in enumerate(r.functions)]


def check_reward_functions(cfg: RunConfig) -> None:
    """Every reward function's spec has its form, and no two share a name (their logged fields
    would collide); whether they import and take the arguments is the preflight's check."""
    names = []
    for key, spec, _ in reward_functions(cfg):
        try:
            names.append(split_reward_spec(spec)[1])
        except ValueError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None
    require(len(set(names)) == len(names), "reward.functions",
           f"two functions share a name ({', '.join(names)}); their logged fields would collide")


def validate(cfg: RunConfig) -> None:
    """Semantic checks that types alone cannot express."""
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    check_ranges(cfg)       # first: the checks below may divide by these
    require(t.n_trainers % (t.tp * t.pp) == 0, "topology.n_trainers",
           f"{t.n_trainers} trainer ranks are not a multiple of tp*pp = {t.tp * t.pp}")
    for key in ("trainer_cpus", "generator_cpus"):
        try:
            parse_cpus(getattr(t, key), f"topology.{key}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    require(r.max_new_tokens < r.max_model_len, "rollout.max_new_tokens",
           f"{r.max_new_tokens} leaves no room for a prompt in rollout.max_model_len = "
           f"{r.max_model_len}")
    require(cfg.env.fn is None or (cfg.env.max_episode_tokens or 0) <= r.max_model_len,
            "env.max_episode_tokens", f"{cfg.env.max_episode_tokens} is past rollout.max_model_len "
            f"= {r.max_model_len}, the longest sequence the engine takes")
    require(cfg.env.tool_parser is None or cfg.data.chat, "env.tool_parser",
            "native tool calling renders the tools and their results with the chat template: "
            "set data.chat=true")
    name = PurePosixPath(cfg.name)
    require(bool(cfg.name) and not name.is_absolute() and ".." not in name.parts
           and "\0" not in cfg.name, "name",
           f"must be a folder name inside output_dir (not absolute, no '..'), got {cfg.name!r}")
    require(r.generator_timeout_s > 2 * r.heartbeat_s, "rollout.generator_timeout_s",
           f"must exceed two heartbeats (2 * rollout.heartbeat_s = {2 * r.heartbeat_s})")
    if cfg.weights.mode == "broadcast" and r.engine_restarts > 0:
        # A generator is silent while it receives weights; rank 0 waits for it no longer than
        # generator_timeout_s, so a shorter one gives up on an engine stalled mid-update (and
        # ends the job) before the generator's own watch would have restarted it.
        least = receive_bound_s(cfg) + LOADING_MARGIN_S
        require(r.generator_timeout_s >= least, "rollout.generator_timeout_s",
               f"must be >= weights.timeout_s + rollout.engine_stall_s + {LOADING_MARGIN_S:g} = "
               f"{least:g} s (a generator whose engine stalls in a weight update finds it only "
               f"then), or lower those, or set rollout.engine_restarts=0, got {r.generator_timeout_s:g}")
    require(1 <= cfg.reward.workers <= MAX_REWARD_WORKERS, "reward.workers",
           f"must be in [1, {MAX_REWARD_WORKERS}] (processes per generator), got {cfg.reward.workers}")
    for key in ("math_timeout_s", "fn_timeout_s"):
        value = getattr(cfg.reward, key)
        require(math.isfinite(value) and 0 < value <= MAX_REWARD_TIMEOUT_S, f"reward.{key}",
               f"must be in (0, {MAX_REWARD_TIMEOUT_S:g}] seconds (one sample's scoring), got {value}")
    require(cfg.reward.extractor in EXTRACTORS, "reward.extractor",
           f"must be one of {', '.join(EXTRACTORS)}, got {cfg.reward.extractor!r}")
    for i, f in enumerate(cfg.reward.functions):
        problem = _REWARD_NUMBER.problem(f.weight)
        require(problem is None, f"reward.functions[{i}].weight", str(problem))
    check_reward_functions(cfg)
    require(tr.max_tokens_per_mb >= r.max_model_len, "train.max_tokens_per_mb",
           f"must hold one whole sequence: >= rollout.max_model_len = {r.max_model_len}")
    require(tr.overlong != "shape" or tr.overlong_buffer < r.max_new_tokens, "train.overlong_buffer",
           f"must be below rollout.max_new_tokens = {r.max_new_tokens} (the ramp ends there)")
    if tr.recompute_granularity == "full":
        require(tr.recompute_method is not None, "train.recompute_method",  # which one: its Literal field
               f"full recompute needs uniform or block, got {tr.recompute_method!r}")
        require(tr.recompute_num_layers is not None and tr.recompute_num_layers >= 1,
               "train.recompute_num_layers", "full recompute needs a layer count >= 1")
    else:
        require(tr.recompute_method is None and tr.recompute_num_layers is None,
               "train.recompute_method", "only with train.recompute_granularity=full")
    require(not tr.sequence_parallel or t.tp > 1, "train.sequence_parallel", "needs topology.tp > 1")
    dp = t.n_trainers // (t.tp * t.pp)
    require(tr.batch_prompts * r.group_size >= tr.ppo_minibatches * dp, "train.ppo_minibatches",
           f"{tr.batch_prompts * r.group_size} sequences per step cannot fill {tr.ppo_minibatches} "
           f"minibatches on each of {dp} data-parallel ranks")
    require(tr.min_lr <= tr.lr, "train.min_lr", f"must be <= train.lr = {tr.lr}, got {tr.min_lr}")
    decay = tr.lr_decay_steps if tr.lr_decay_steps is not None else tr.total_steps * tr.ppo_minibatches
    require(decay > tr.lr_warmup_steps, "train.lr_decay_steps",
           f"must exceed lr_warmup_steps = {tr.lr_warmup_steps} (got {decay} optimizer steps)")
    check_signals(cfg.checkpoint.signals)
    check_template(cfg.data.prompt_template, cfg.data.kind)
