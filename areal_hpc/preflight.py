"""Every start-up check, in one place. Each refuses with one `ConfigError` line naming the key,
file or row, before any rank spends node time:

- `launcher(config, overrides)`: what every launcher (mpiexec, the slurm/ batch scripts through
  `launch/env.py`, submitit) runs on the submitting host: the config (schema, ranges and
  cross-field rules: config/rules.py), every rank's memory estimate against its GPU (plan/memory.py)
  and each node's host memory against topology.host_mem_gib (plan/host_memory.py),
  a step and its checkpoint against the preemption signal's lead (plan/budget.py), the installed
  torch / vLLM / Megatron releases, the tiny model built if the config names it, the inputs
  (`check_inputs`), the run directory's file system and free space (storage/disk.py), and the
  sandbox for code rewards.
- `rank(config, overrides)`: what each rank runs on its own node (the files may live on a
  filesystem the login node does not see): the config, the inputs, the releases.
- `generator_node(cfg)`: what a generator checks on its node before its engine and reward
  workers start (the sandbox).

`check_inputs` reads the model directory cheaply (config.json, weight index, tokenizer: no
weights), imports the user's reward functions and parses every dataset row.

Inputs are untrusted and read within bounds, so that a bad one is one line, never a hang or a
silent kill: every file it opens (dataset, model config, tokenizer files, chat template) must be
a regular file (a FIFO, a device or a directory in its place is refused unopened or opened without
blocking); each is capped before parsing (config.json MAX_CONFIG_BYTES, the weight index and the
tokenizer's files MAX_MODEL_FILE_BYTES, a chat template file MAX_TEMPLATE_BYTES, a dataset row
MAX_ROW_BYTES: data/files.py); a question over MAX_CHARS_PER_TOKEN characters per token of
rollout.max_model_len is refused before it is rendered or tokenized; every prompt's rendering
(the chat template's loops) is bounded by TEMPLATE_TIMEOUT_S of wall time; the run directory is
output_dir/name itself, not a symlink to elsewhere (storage/run_dir.py `place`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import checked, determinism
from .config import MAX_CONFIG_BYTES, ConfigError, RunConfig, load, read_utf8
from .config.rules import require
from .cpus import bind_rank, check_cpus
from .data.files import irregular
from .data.prompts import (RenderTimeout, load_prompts_of, prompt_ids, read_chat_template, reset_row, too_long,
                           too_many_chars)
from .env import base as env_base
from .env import runner as env_runner
from .launch.placement import gather_and_check, p2p_hidden
from .plan import Arch, check_fits, read_arch
from .plan.budget import check_time
from .plan.host_memory import check_host_fits
from .reward import custom
from .reward.sandbox import Sandbox, SandboxUnavailable, check_available
from .storage import disk
from .storage.checkpoint import find_latest
from .storage.run_dir import RunDir, is_complete, place
from .versions import check_versions

TINY_MODEL = Path("models/tiny")
# The models the project builds itself when a config names them and they are not there yet:
# path -> areal_hpc/tiny_model.py arguments.
BUILT_MODELS = {TINY_MODEL: [], Path("models/tiny_answer"): ["--format", "answer"],
                Path("models/tiny_tool"): ["--format", "tool"],
                Path("models/tiny_native"): ["--format", "native"]}

log = logging.getLogger(__name__)
DRY_RUN_ENV = "AREAL_DRY_RUN"     # slurm/job.sh --dry-run: placement only (the disk check warns)


def ensure_tiny_model(cfg: RunConfig) -> None:
    """Build the tiny model (or its "Answer: N" variant) that the config names, once."""
    for path, args in BUILT_MODELS.items():
        if Path(cfg.model.path).resolve() == path.resolve() and not (path / "config.json").exists():
            print(f"[launch] building the tiny model in {path} (once, a few minutes)",
                  file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "areal_hpc.tiny_model", "--out", str(path), *args],
                           check=True, stdout=sys.stderr)


def launcher(config: str, overrides: list[str]) -> RunConfig:
    """Load and validate the config, check that every rank's memory estimate fits its GPU
    (`areal_hpc.plan.check_fits`; before the paths, which a login node may not have) and that a
    step and its checkpoint fit the preemption signal's lead (`areal_hpc.plan.budget`), build the
    tiny model if needed, check the input paths. Raises ConfigError with a message that names
    the key."""
    cfg = load(config, overrides)
    check_fits(cfg)
    check_host_fits(cfg)  # each node's host memory against topology.host_mem_gib (plan/host_memory.py)
    check_time(cfg)  # topology.gpu set: a step + its checkpoint within the signal's lead (else a warning)
    check_versions(cfg.topology.device)  # VersionMismatch: installed torch/vLLM/Megatron differ
    ensure_tiny_model(cfg)
    check_inputs(cfg)
    # the run dir's file system said (HDF5 locking); room for its checkpoints (storage/disk.py)
    disk.check_start(cfg, read_arch(cfg).total_params, dry_run=os.environ.get(DRY_RUN_ENV) == "1")
    generator_node(cfg)  # data.kind=code: refuse where code cannot be sandboxed (or warn if unsafe)
    if cfg.deterministic:
        print(f"[launch] {determinism.summary(cfg.topology.device)}", file=sys.stderr, flush=True)
    return cfg


def rank(config: str, overrides: list[str]) -> RunConfig:
    """The checks a rank runs on its own node: the config, its inputs, this node's releases."""
    cfg = load(config, overrides)
    check_inputs(cfg)
    check_versions(cfg.topology.device)  # this node's torch / vLLM / Megatron releases
    return cfg


class Refused(ConfigError):
    """A start refused after MPI started, with one line. `every_rank`: every rank reached the
    same verdict (rank 0 says it; all exit 2 together, MPI finalized); else only this rank
    did (it says it; its exit ends the job)."""

    def __init__(self, message: str, every_rank: bool = True):
        super().__init__(message)
        self.every_rank = every_rank


TRAIN, EXPORT, DONE = "train", "export", "done"


def what_to_run(cfg: RunConfig) -> tuple[str, str | None]:
    """(TRAIN, EXPORT or DONE, what rank 0 says of it). A rerun of a finished run (resume auto)
    starts nothing: DONE; EXPORT where it was trained and checkpointed but its policy/ export
    is missing or incomplete (the trainer ranks export it from the final checkpoint)."""
    if cfg.checkpoint.resume != "auto":
        return TRAIN, None
    found = find_latest(cfg.run_dir, check_crc=False)
    if not found or found[1]["step"] < cfg.train.total_steps:
        return TRAIN, None
    step, where = found[1]["step"], found[0]
    if is_complete(RunDir(cfg.run_dir).policy, step):
        return DONE, (f"run {cfg.name} is already complete ({step} steps, {where}); raise "
                      f"train.total_steps to continue it, or choose another name=...")
    return EXPORT, (f"run {cfg.name} is complete ({step} steps, {where}) but its policy/ export "
                    f"is missing or incomplete: exporting it only")


def placed(cfg: RunConfig, topo, world) -> list[int] | None:
    """The checks made once MPI has started, before torch or vLLM touch a device: every rank's
    GPUs (CUDA_VISIBLE_DEVICES narrowed to its own), cores and interface, checked together on
    rank 0 (a wrong layout refuses the start on every rank), then this rank's CPUs checked and
    bound. Returns the CPUs it is bound to (None: not bound). Raises Refused."""
    _, placements, problems = gather_and_check(world, cfg.topology, cfg.rollout.engine_tp,
                                               topo.rank, topo.role, topo.controller_addr)
    for line in p2p_hidden(placements) if placements else ():     # rank 0
        log.warning("placement: %s", line)
    if problems:
        more = (f" (and {len(problems) - 1} more; slurm/job.sh --dry-run prints the table)"
                if len(problems) > 1 else "")
        raise Refused(f"placement: {problems[0]}{more}")
    try:
        check_cpus(cfg.topology)
        return bind_rank(cfg.topology, topo.role, topo.local_rank, topo.local_size)
    except ValueError as exc:
        raise Refused(f"rank {topo.rank} on {topo.hosts[topo.rank]}: {exc}",
                      every_rank=False) from None


def generator_node(cfg: RunConfig) -> None:
    """On a generator's node, before its children start (areal_hpc.main, before the generator):
    code rewards need the sandbox (or the unsafe opt-out), and so does the Python tool
    (env.fn=python, which has no opt-out: without it every episode's reset would fail, a
    whole run of failed groups instead of one line at the start); an environment is built and
    reset on the first training row in its child."""
    try:
        check_available(cfg)
    except SandboxUnavailable as exc:
        raise ConfigError(f"config key 'data.kind': {exc}") from None
    if cfg.env.fn and env_base.full_spec(cfg.env.fn) == env_base.BUILTINS["python"]:
        ok, why = Sandbox.available()
        if not ok:
            raise ConfigError(f"config key 'env.fn': the Python tool runs model-written code in the "
                              f"code sandbox, which cannot be set up on this node: {why}")
    if cfg.env.fn and cfg.data.train_path:   # built and reset on a real row, in its own child
        try:
            first = load_prompts_of(cfg, cfg.data.train_path, limit=1)
            env_runner.check_reset(cfg.env, reset_row(first[0]))
        except env_base.EnvConfigError as exc:
            raise ConfigError(str(exc)) from None
        except (ValueError, OSError, IndexError) as exc:
            raise ConfigError(f"config key 'data.train_path': {_one_line(exc)}") from None


def check_inputs(cfg: RunConfig) -> None:
    """Inputs that must exist before any rank starts work (clear message, not a deep traceback):
    the model directory, the run's name, the user's reward functions, every dataset row."""
    try:
        place(cfg.output_dir, cfg.name)
    except ValueError as exc:
        raise ConfigError(f"config key 'name': {_one_line(exc)}") from None
    model = Path(cfg.model.path)
    if not (model / "config.json").exists():
        hint = " (build the tiny one with: python tools/make_tiny_model.py --out models/tiny)"
        raise ConfigError(f"config key 'model.path': no HF model at {model} (config.json missing){hint}")
    log = RunDir(cfg.run_dir).rollouts
    if log.exists() and cfg.checkpoint.resume == "never":
        raise ConfigError(f"config key 'name': run {cfg.name!r} already has {log}; choose another "
                          f"name=..., remove {cfg.run_dir}, or resume it with checkpoint.resume=auto")
    try:        # the user's reward functions import, and take (completion, reference, row)
        custom.check(cfg)
    except custom.RewardFnError as exc:
        raise ConfigError(str(exc)) from None
    check_env(cfg)
    sample, datasets = None, {}
    for key, value in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if value is None:
            continue
        if not Path(value).exists():
            raise ConfigError(f"config key '{key}': file not found: {value}")
        try:    # every row parsed now, so a bad line stops the job before any rank starts
            rows = load_prompts_of(cfg, value)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"config key '{key}': {_one_line(exc)}") from None
        except MemoryError:
            raise ConfigError(f"config key '{key}': out of memory reading {value}") from None
        if not rows:
            raise ConfigError(f"config key '{key}': {value} holds no rows")
        problem = too_many_chars(rows, cfg.rollout.max_model_len)   # before any row is tokenized
        if problem:
            raise ConfigError(f"config key '{key}': {problem} (drop such rows or raise "
                              "rollout.max_model_len)")
        from .reward.math import MAX_ANSWER_CHARS  # math_verify, sympy: heavy, for math only
        long_ref = next((i for i, r in enumerate(rows) if r["reward_kind"] == "math"
                         and isinstance(r["reference"], str)
                         and len(r["reference"]) > MAX_ANSWER_CHARS), None)
        if long_ref is not None:    # the reward would parse it with sympy for every sample
            raise ConfigError(f"config key '{key}': row {long_ref}: its answer is "
                              f"{len(rows[long_ref]['reference'])} characters (at most "
                              f"{MAX_ANSWER_CHARS}: an answer, not a solution)")
        if key == "data.train_path":
            sample = rows[0]
        datasets[key] = rows
    check_model_dir(cfg, sample, datasets)


def check_env(cfg: RunConfig) -> None:
    """The env section (multi-turn episodes): its keys, and its environment imported in a child
    of its own, bounded."""
    try:
        env_base.validate(cfg.env)
        env_runner.check(cfg.env)
    except env_base.EnvConfigError as exc:
        raise ConfigError(str(exc)) from None


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


# What the trainer converts (train/hf_convert.py: Qwen2 <-> Megatron GPTModel).
SUPPORTED_MODEL_TYPES = ("qwen2",)
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)


def read_json(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """A JSON file (a regular file of at most `max_bytes`); anything else, unreadable, non-UTF-8
    or bad JSON is one ConfigError line naming file and line."""
    text = read_utf8(path, "it", max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: bad JSON: {exc.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: bad JSON: nested too deeply") from None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_model_config(cfg: RunConfig, hf: Any, source: str) -> None:
    """`hf` (a config.json) describes a model the trainer converts and vLLM serves with this
    config's parallelism and lengths."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    mt, archs = hf.get("model_type"), hf.get("architectures")
    supported = (f"supported: model_type {', '.join(SUPPORTED_MODEL_TYPES)} "
                 f"({', '.join(SUPPORTED_ARCHITECTURES)})")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {mt!r} is not supported ({supported})")
    if archs is not None and not (isinstance(archs, list)
                                  and any(a in SUPPORTED_ARCHITECTURES for a in archs)):
        raise ConfigError(f"{source}: architectures {archs!r} is not supported ({supported})")
    arch = Arch.from_hf(hf, source)
    mpe = hf.get("max_position_embeddings")
    if not _positive_int(mpe):
        raise ConfigError(f"{source}: key 'max_position_embeddings' "
                          + ("missing" if mpe is None else f"must be a positive integer, got {mpe!r}"))
    eps = hf.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise ConfigError(f"{source}: key 'rms_norm_eps' must be a number in (0, 1), got {eps!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window", False):
        raise ConfigError(f"{source}: use_sliding_window is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: rope_parameters / rope_scaling must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{source}: rope scaling {rope_type!r} is not supported (default only)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (0 < theta < math.inf):
        raise ConfigError(f"{source}: key 'rope_theta' must be a positive number, got {theta!r}")
    if not isinstance(hf.get("tie_word_embeddings", False), bool):
        raise ConfigError(f"{source}: key 'tie_word_embeddings' must be true or false")
    t, r, tr = cfg.topology, cfg.rollout, cfg.train
    require(r.max_model_len <= mpe, "rollout.max_model_len",
           f"{r.max_model_len} exceeds max_position_embeddings = {mpe} of {source} (vLLM refuses it)")
    require(arch.layers % t.pp == 0, "topology.pp",
           f"num_hidden_layers = {arch.layers} of {source} do not split over pp = {t.pp} stages")
    for what, n in (("num_attention_heads", arch.heads), ("num_key_value_heads", arch.kv_heads),
                    ("vocab_size", arch.vocab)):
        require(n % t.tp == 0, "topology.tp", f"{what} = {n} of {source} is not divisible by tp = {t.tp}")
    etp = r.engine_tp
    require(arch.heads % etp == 0 and (arch.kv_heads % etp == 0 or etp % arch.kv_heads == 0),
           "rollout.engine_tp", f"vLLM splits num_attention_heads = {arch.heads} and "
           f"num_key_value_heads = {arch.kv_heads} of {source} over engine_tp = {etp}: they must divide")
    if tr.recompute_num_layers is not None:
        per_stage = arch.layers // t.pp
        require(tr.recompute_num_layers <= per_stage, "train.recompute_num_layers",
               f"{tr.recompute_num_layers} exceeds the {per_stage} layers of a pipeline stage")


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
# The model directory's files that are parsed at start-up (config, index, the tokenizer's files,
# templates), by suffix: capped before parsing. Weights are only listed, never read here.
PARSED_SUFFIXES = (".json", ".txt", ".jinja", ".model", ".tiktoken")
MAX_MODEL_FILE_BYTES = 256 << 20    # the largest shipped tokenizer.json is tens of MiB
MAX_INDEX_BYTES = 64 << 20          # model.safetensors.index.json (a 32B model's: under 100 KiB)
TEMPLATE_TIMEOUT_S = 5.0            # one prompt's rendering (microseconds for a sane template)


def check_model_files(model: Path) -> None:
    """Every file of the model directory (and of its additional_chat_templates/, which the
    tokenizer reads too) is a regular file, and each that is parsed is at most
    MAX_MODEL_FILE_BYTES: a FIFO there would hang the tokenizer's load, a huge one exhaust memory."""
    for folder in (model, model / "additional_chat_templates"):
        if not folder.is_dir():
            continue
        bad = irregular(folder)     # (the tokenizer's own reads follow this check, by path)
        if bad:
            raise ConfigError(f"config key 'model.path': {bad}")
        for f in sorted(folder.iterdir()):
            size = f.stat().st_size if f.suffix in PARSED_SUFFIXES and f.is_file() else 0
            if size > MAX_MODEL_FILE_BYTES:
                raise ConfigError(f"config key 'model.path': {f}: {size} bytes, over the "
                                  f"{MAX_MODEL_FILE_BYTES} a model's config or tokenizer file may hold")


@contextmanager
def bounded_rendering(seconds: float | None = None):
    """Yields `prompt_ids` with every call bounded to `seconds` (TEMPLATE_TIMEOUT_S) of wall time
    (a chat template whose loops run for minutes): SIGALRM raises RenderTimeout in the rendering;
    the caller's handler and timer are put back after. Outside the main thread (no signals)
    unbounded."""
    seconds = TEMPLATE_TIMEOUT_S if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread():
        yield prompt_ids
        return

    def on_alarm(signum, frame):
        raise RenderTimeout(f"rendering its prompt took over {seconds:g} s")

    def ids(tokenizer, d, question):
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return prompt_ids(tokenizer, d, question)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    handler = signal.signal(signal.SIGALRM, on_alarm)
    timer, start = signal.setitimer(signal.ITIMER_REAL, 0), time.monotonic()
    try:
        yield ids
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if handler is None else handler)
        if timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, max(timer[0] - (time.monotonic() - start), 1e-3), timer[1])


def check_model_dir(cfg: RunConfig, sample: dict | None = None,
                    datasets: dict[str, list[dict]] | None = None) -> None:
    """The model directory, cheaply (no weights read): its files' types and sizes, config.json,
    weight files, tokenizer (which must turn `sample`, a dataset row in `data.prompt_template`,
    into at least one token, and every row of `datasets`, {config key: rows}, into a prompt that
    fits rollout.max_model_len, each rendered within TEMPLATE_TIMEOUT_S). The tokenizer's part
    is skipped where the same inputs passed it before (checked.py)."""
    model = Path(cfg.model.path)
    check_model_files(model)
    path = model / "config.json"
    hf = read_json(path)
    check_model_config(cfg, hf, str(path))
    index = model / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, MAX_INDEX_BYTES)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no 'weight_map' object")
        for shard in sorted(set(map(str, weight_map.values()))):
            if not (model / shard).is_file():
                raise ConfigError(f"config key 'model.path': {index} names {shard}, which is missing")
    elif not any(model.glob("*.safetensors")):
        raise ConfigError(f"config key 'model.path': no *.safetensors weights in {model}")
    if not any((model / f).is_file() for f in TOKENIZER_FILES):
        # (transformers 5 would build an empty Qwen2 tokenizer without complaint)
        raise ConfigError(f"config key 'model.path': no tokenizer in {model} (none of "
                          f"{', '.join(TOKENIZER_FILES)})")
    if cfg.data.chat and cfg.data.chat_template:
        try:
            read_chat_template(cfg.data.chat_template)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"config key 'data.chat_template': {_one_line(exc)}") from None
    digest = checked.key(cfg)
    if checked.passed(digest):      # these inputs passed the rest before (checked.py)
        return
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    except Exception as exc:    # noqa: BLE001 - whatever transformers raises, one line
        raise ConfigError(f"config key 'model.path': the tokenizer in {model} does not load: "
                          f"{type(exc).__name__}: {_one_line(exc)}") from None
    if len(tokenizer) > hf["vocab_size"]:
        raise ConfigError(f"config key 'model.path': the tokenizer in {model} has {len(tokenizer)} "
                          f"tokens but {path} vocab_size = {hf['vocab_size']}")
    if cfg.data.chat and not (cfg.data.chat_template or getattr(tokenizer, "chat_template", None)):
        raise ConfigError(f"config key 'data.chat': the tokenizer in {model} has no chat template; "
                          f"give one in data.chat_template (a Jinja template or its file)")
    if cfg.env.tool_parser:
        check_tool_calling(cfg, tokenizer)
    with bounded_rendering() as ids:
        try:
            _check_prompts(cfg, tokenizer, ids, sample, datasets or {})
        except RenderTimeout as exc:
            raise ConfigError(f"config key '{template_key(cfg)}': {exc} (the chat template's loops must "
                              "end within seconds)") from None
    checked.remember(digest)


def check_tool_calling(cfg: RunConfig, tokenizer) -> None:
    """Native tool calling (env.tool_parser): vLLM's parsers of those names, and a chat template
    that declares the tools and renders an assistant turn's text as it is, tool results after
    it (imports vLLM's parsers: seconds, only for such a run)."""
    from .env.tool_calls import ToolCalling
    try:
        calling = ToolCalling(tokenizer, cfg.env, read_chat_template(cfg.data.chat_template))
        calling.observation(["a result"], None)
    except env_base.EnvConfigError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:    # noqa: BLE001 - a template that fails, one line
        raise ConfigError(f"config key '{template_key(cfg)}': native tool calling: "
                          f"{type(exc).__name__}: {_one_line(exc)}") from None


def template_key(cfg: RunConfig) -> str:
    """The key to name for a prompt that does not render: the chat template's, or the model's."""
    return "data.chat_template" if cfg.data.chat and cfg.data.chat_template else "model.path"


def _check_prompts(cfg: RunConfig, tokenizer, ids, sample: dict | None, datasets: dict[str, list[dict]]):
    model = cfg.model.path
    if sample is not None:
        text = cfg.data.prompt_template.format(question=sample["question"])
        try:
            first = ids(tokenizer, cfg.data, sample["question"])
        except RenderTimeout as exc:
            raise RenderTimeout(f"the first prompt: {exc}") from None
        except Exception as exc:    # noqa: BLE001
            key = "data.chat_template" if cfg.data.chat else "model.path"
            raise ConfigError(f"config key '{key}': the tokenizer in {model} fails on the first "
                              f"prompt: {type(exc).__name__}: {_one_line(exc)}") from None
        if not first:
            raise ConfigError(f"config key 'model.path': the tokenizer in {model} turns the first "
                              f"prompt {text[:60]!r} into no tokens")
        if len(first) >= cfg.rollout.max_model_len:
            raise ConfigError(f"config key 'rollout.max_model_len': the first prompt is {len(first)} "
                              f"tokens, no room to generate in {cfg.rollout.max_model_len}")
    for key, rows in datasets.items():
        try:
            problem = too_long(tokenizer, cfg.data, rows, cfg.rollout.max_model_len, ids)
        except RenderTimeout as exc:
            raise RenderTimeout(f"{key}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"config key '{template_key(cfg)}': {key}: {exc}") from None
        if problem:
            raise ConfigError(f"config key '{key}': {problem} (drop such rows or raise "
                              "rollout.max_model_len)")
