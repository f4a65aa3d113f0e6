"""Property tests over the config schema (issue 13): overrides drawn around every key's bounds
(valid and invalid values, wrong types) are either refused with one ConfigError line, or pass
`load()` + `check_inputs()` and then also work in the code that consumes them at rank start:
Topology sizing, the memory plan, the prompt template on the dataset rows, the eval slice,
vLLM's SamplingParams, timeouts, seeds and signal handlers. reward.* keys are not drawn (their
checks are maintained separately)."""
import datetime
import math
import random
import signal
import threading
import typing
from dataclasses import fields, is_dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from areal_hpc.config import RANGES, ConfigError, RunConfig, load
from areal_hpc.preflight import check_inputs

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


def _types(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            yield from _types(t, f"{prefix}{f.name}.")
        else:
            args = set(typing.get_args(t) or (t,))
            if {int, float} & args:
                yield prefix + f.name, float if float in args else int


TYPES = dict(_types(RunConfig))
JUNK = st.sampled_from(["abc", "[1", "null", "true", "''", "1.5", "{a: 1}", "${nope}"])


def _number(key):
    """Half the draws inside the key's range, a quarter on or around its bounds and other edges
    (0, -1, 2**31, nan, inf, ...), a quarter of the wrong type."""
    typ, r = TYPES[key], RANGES[key]
    edges = [0, 1, -1, 2, 3, 4, 8, 100, 1000, 65536, 65537, 2**31 - 1, 2**31, 10**12]
    for b in (r.lo, r.hi):
        if b is not None:
            edges += [b, b - 1, b + 1] if typ is int else [b, b - 1e-6, b + 1e-6, b * 0.999, b * 1.001]
    lo = r.lo if r.lo is not None else -1e6
    hi = r.hi if r.hi is not None else lo + 1e6
    if typ is int:
        edges = [int(e) for e in edges if float(e).is_integer()]
        inside = st.integers(int(lo), int(min(hi, lo + 2000)))
        return st.one_of(inside, inside, st.sampled_from(edges), JUNK).map(str)
    edges += [0.5, 1e-3, 1e-9, 0.01, 2.0, 5.0, 1e7, -0.0, math.nan, math.inf, -math.inf]
    inside = st.floats(lo, min(hi, lo + 1e4), exclude_min=r.lo_open, exclude_max=r.hi_open)
    return st.one_of(inside, inside, st.sampled_from(edges) | st.floats(), JUNK).map(
        lambda v: v if isinstance(v, str) else repr(v))


def _quoted(text):
    return "'" + text.replace("'", "''") + "'"


TEMPLATES = st.sampled_from([
    "{question}", "Q: {question} A:", "{question}\\n\\boxed{{}}", "{questoin}", "{question",
    "}{question}", "{}", "{0}", "{question:d}", "{question!r}", "{question:>10}", "{question:{question}}",
    "{question[0]}", "{question.upper}", "{{}}{question}", "plain", "{question!x}", "{{question}}",
]) | st.text(alphabet="{}q!:x ", max_size=10).map(lambda t: t.replace("q", "question"))
SIGNALS = st.lists(st.sampled_from(["USR1", "USR2", "TERM", "INT", "HUP", "XCPU", "RTMIN", "KILL",
                                    "STOP", "SEGV", "CHLD", "USR9", "_IGN", "sigterm"]),
                   max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
OTHER = {
    "data.prompt_template": TEMPLATES.map(_quoted),
    "checkpoint.signals": SIGNALS,
    "train.recompute_granularity": st.sampled_from(["null", "selective", "full", "half"]),
    "train.recompute_method": st.sampled_from(["null", "uniform", "block"]),
    "train.sequence_parallel": st.sampled_from(["true", "false"]),
    "topology.device": st.sampled_from(["cpu", "cuda"]),
    "data.kind": st.sampled_from(["math", "code"]),
}
KEYS = sorted(k for k in RANGES if not k.startswith("reward.")) + sorted(OTHER)


def _value(key):
    return OTHER[key] if key in OTHER else _number(key)


OVERRIDES = st.lists(st.sampled_from(KEYS), max_size=4, unique=True).flatmap(
    lambda ks: st.tuples(*[_value(k) for k in ks]).map(lambda vs: [f"{k}={v}" for k, v in zip(ks, vs)]))


def _base(model_dir, datasets, tmp_path, overrides):
    kind = next((o.split("=", 1)[1] for o in overrides if o.startswith("data.kind=")), "math")
    keys = ["data.question_key=prompt", "data.answer_key=tests"] if kind == "code" else []
    return [f"model.path={model_dir}", f"data.train_path={datasets[kind]}",
            f"data.eval_path={datasets[kind]}", f"output_dir={tmp_path}/runs", *keys, *overrides]


@settings(max_examples=150, **SETTINGS)
@given(overrides=OVERRIDES)
def test_load_raises_only_config_errors(overrides):
    try:
        load(None, ["model.path=m", "data.train_path=t.jsonl", *overrides])
    except ConfigError as exc:
        assert "\n" not in str(exc)


@pytest.fixture(scope="module")
def sampling_params():
    # Quiet while importing only: vLLM processes started later in this session (other tests'
    # engines) read the variable at their own start.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import SamplingParams     # slow (~10 s): once per module
    return SamplingParams


def _consume(cfg: RunConfig, SamplingParams) -> None:
    """What rank start-up does with the values (without MPI, torch or an engine)."""
    from areal_hpc import plan
    from areal_hpc.data.prompts import load_prompts
    from areal_hpc.topology import GENERATOR, TRAINER, Topology, check_world

    t, r, d = cfg.topology, cfg.rollout, cfg.data
    # Topology sizing
    world = t.n_trainers + t.n_generators
    check_world(t, world)
    dp = t.n_trainers // (t.tp * t.pp)
    assert dp >= 1 and dp * t.tp * t.pp == t.n_trainers
    for rank in {0, t.n_trainers - 1, t.n_trainers, world - 1}:
        role = TRAINER if rank < t.n_trainers else GENERATOR
        topo = Topology(cfg=t, world=None, role_comm=None, rank=rank, role=role,
                        role_rank=rank if role == TRAINER else rank - t.n_trainers,
                        controller_addr="", trainer_port=0, weight_port=0, local_rank=0,
                        hosts=[], engine_tp=r.engine_tp)
        assert len(topo.generator_ranks) == t.n_generators
        if role == GENERATOR:
            assert t.pp <= topo.weight_group_rank < topo.weight_group_size
    # Memory plan (check_fits itself is skipped on cpu): the estimate must compute
    p = plan.estimate(cfg)
    p.error()
    plan.estimate(cfg, gpu_mem_gib=80.0).error()
    # Data: every row formats; the eval slice is non-empty and sampled at least once
    keys = (d.kind, d.question_key, d.answer_key)
    for path in (d.train_path, d.eval_path):
        for row in load_prompts(path, *keys):
            assert cfg.data.prompt_template.format(question=row["question"])
    eval_rows = load_prompts(d.eval_path, *keys)
    if d.eval_limit:
        eval_rows = eval_rows[: d.eval_limit]
    assert eval_rows and d.eval_samples >= 1
    random.Random(d.seed).shuffle(list(range(3)))
    # Sampling: vLLM takes the values as they are (no clamping: the trainer scores with them)
    sp = SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
                        logprobs=0)
    assert sp.temperature == r.temperature and sp.top_p == r.top_p
    assert r.max_model_len <= cfg.train.max_tokens_per_mb
    if r.kv_cache_gib is not None:
        assert int(r.kv_cache_gib * 2**30) > 0
    assert cfg.weights.bucket_mb << 20 > 0
    # Timeouts: torch.distributed takes timedeltas, threading waits take seconds
    for s in (r.heartbeat_s, r.generator_timeout_s, r.collective_timeout_s,
              cfg.weights.timeout_s, cfg.weights.join_timeout_s):
        assert datetime.timedelta(seconds=s) > datetime.timedelta(0) and s <= threading.TIMEOUT_MAX
    # Seeds: vLLM gets train.seed + rank, numpy seeds must be < 2**32
    import numpy as np
    np.random.default_rng(cfg.train.seed + world)
    np.random.RandomState(cfg.train.seed + world)
    # Preemption signals: installable
    for name in cfg.checkpoint.signals:
        num = getattr(signal, f"SIG{name}")
        old = signal.signal(num, lambda *a: None)
        signal.signal(num, old)
    # Checkpoint cadence, logging
    assert cfg.checkpoint.keep >= 1
    if cfg.checkpoint.every_steps:
        _ = cfg.train.total_steps % cfg.checkpoint.every_steps


@settings(max_examples=120, **SETTINGS)
@given(overrides=OVERRIDES)
def test_valid_configs_work_where_they_are_used(model_dir, datasets, tmp_path, sampling_params, overrides):
    try:
        cfg = load(None, _base(model_dir, datasets, tmp_path, overrides))
        check_inputs(cfg)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        event("refused")
        return
    event("accepted")
    _consume(cfg, sampling_params)
