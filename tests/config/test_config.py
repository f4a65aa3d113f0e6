import textwrap

import pytest

from areal_hpc.config import ConfigError, RunConfig, load, to_yaml
from areal_hpc.preflight import check_inputs


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


BASE = """
model: {path: m}
data: {train_path: t.jsonl}
"""


def test_load_yaml_and_overrides(tmp_path):
    cfg = load(_yaml(tmp_path, BASE), ["train.total_steps=7", "rollout.max_staleness=3"])
    assert isinstance(cfg, RunConfig)
    assert cfg.train.total_steps == 7 and cfg.rollout.max_staleness == 3
    assert cfg.model.path == "m" and cfg.rollout.group_size == 4


def test_unknown_key_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.totl_steps"):
        load(_yaml(tmp_path, BASE), ["train.totl_steps=7"])
    with pytest.raises(ConfigError, match=r"rollout\.bogus"):
        load(_yaml(tmp_path, BASE + "rollout: {bogus: 1}\n"))


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.total_steps"):
        load(_yaml(tmp_path, BASE), ["train.total_steps=many"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        load(_yaml(tmp_path, BASE + "rollout: {temperature: hot}\n"))


def test_missing_required_and_semantic_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path"):
        load(_yaml(tmp_path, "data: {train_path: t.jsonl}\n"))
    with pytest.raises(ConfigError, match=r"topology\.n_trainers.*multiple of tp\*pp = 2"):
        load(_yaml(tmp_path, BASE), ["topology.n_trainers=3", "topology.tp=2"])
    with pytest.raises(ConfigError, match=r"topology\.weight_backend"):
        load(_yaml(tmp_path, BASE), ["topology.weight_backend=mpi"])
    with pytest.raises(ConfigError, match="key=value"):
        load(_yaml(tmp_path, BASE), ["train.total_steps"])
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"rollout\.generator_timeout_s.*two heartbeats"):
        load(_yaml(tmp_path, BASE), ["rollout.heartbeat_s=10", "rollout.generator_timeout_s=15"])



def test_rank_0_waits_out_a_generator_stalled_in_a_weight_receive(tmp_path):
    """Under broadcast with engine restarts on, rank 0 gives up on a generator silent for
    rollout.generator_timeout_s; the generator finds its own engine stalled in a weight receive
    only after weights.timeout_s + rollout.engine_stall_s (+ 30 s to say so). A shorter
    generator_timeout_s would end the job where the engine would have been restarted."""
    cfg = load(_yaml(tmp_path, BASE))
    assert cfg.rollout.generator_timeout_s >= cfg.weights.timeout_s + cfg.rollout.engine_stall_s + 30
    with pytest.raises(ConfigError, match=r"rollout\.generator_timeout_s': must be >= weights"
                                          r"\.timeout_s \+ rollout\.engine_stall_s \+ 30 = 930 s"):
        load(_yaml(tmp_path, BASE), ["rollout.generator_timeout_s=900"])
    for fine in (["rollout.engine_restarts=0"], ["weights.mode=disk"],
                 ["weights.timeout_s=500", "rollout.engine_stall_s=370"]):
        load(_yaml(tmp_path, BASE), ["rollout.generator_timeout_s=900", *fine])

def test_roundtrip_yaml(tmp_path):
    cfg = load(_yaml(tmp_path, BASE), ["name=x"])
    again = load(_yaml(tmp_path, to_yaml(cfg)))
    assert again == cfg


def test_check_inputs_missing_model(tmp_path):
    cfg = load(_yaml(tmp_path, BASE), [f"model.path={tmp_path}/no_model"])
    with pytest.raises(ConfigError, match=r"model\.path.*no HF model"):
        check_inputs(cfg)


def test_shipped_recipes_load():
    for name in ("tiny_cpu", "qwen2_5_1_5b_math", "qwen2_5_7b_math", "qwen2_5_32b_math",
                 "qwen2_5_7b_tool"):
        cfg = load(f"configs/{name}.yaml")
        assert cfg.train.total_steps >= 1


def test_check_inputs_names_the_bad_jsonl_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n\n{"question": "2+2="}\n')
    cfg = load(_yaml(tmp_path, BASE), [f"model.path={model}", f"data.train_path={data}",
                                       f"output_dir={tmp_path}/runs"])
    with pytest.raises(ConfigError, match=r"data\.train_path.*train\.jsonl:3.*answer"):
        check_inputs(cfg)
    data.write_text("")
    with pytest.raises(ConfigError, match="holds no rows"):
        check_inputs(cfg)


def test_check_inputs_names_the_bad_parquet_row_and_the_dotted_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1=", "reward_model": {"ground_truth": "2"}},
                                         {"problem": "2+2=", "reward_model": {"ground_truth": None}}]), data)
    cfg = load(_yaml(tmp_path, BASE), [f"model.path={model}", f"data.train_path={data}",
                                       f"output_dir={tmp_path}/runs", "data.question_key=problem",
                                       "data.answer_key=reward_model.ground_truth"])
    with pytest.raises(ConfigError, match=r"data\.train_path.*train\.parquet\[1\]: "
                                          r"'reward_model\.ground_truth' must be a string, got NoneType"):
        check_inputs(cfg)


def test_engine_tp_sizes_the_weight_group(tmp_path):
    from areal_hpc.topology import GENERATOR, Topology

    assert load(_yaml(tmp_path, BASE)).rollout.engine_tp == 1
    with pytest.raises(ConfigError, match=r"rollout\.engine_tp.*>= 1, got 0"):
        load(_yaml(tmp_path, BASE), ["rollout.engine_tp=0"])
    cfg = load(_yaml(tmp_path, BASE), ["rollout.engine_tp=4", "topology.pp=2",
                                       "topology.n_trainers=2", "topology.n_generators=3"])
    # Stage senders are ranks 0, 1; generator g's four vLLM workers are 2 + 4g .. 2 + 4g + 3.
    topo = Topology(cfg=cfg.topology, world=None, role_comm=None, rank=4, role=GENERATOR,
                    role_rank=2, controller_addr="", trainer_port=0, weight_port=0, local_rank=0,
                    hosts=[], engine_tp=cfg.rollout.engine_tp)
    assert topo.weight_group_size == 2 + 3 * 4 and topo.weight_group_rank == 2 + 2 * 4


def test_a_removed_key_of_an_old_run_config_is_ignored_with_a_warning(tmp_path, caplog):
    cfg = load(_yaml(tmp_path, BASE + "log_every: 5\n"), ["log_every=2"])
    assert not hasattr(cfg, "log_every")
    assert "config key 'log_every' is no longer used" in caplog.text


def _enumerations(cls=None, prefix=""):
    """(key, choices) of every schema field typed with a Literal (None among the choices of an
    Optional one)."""
    import dataclasses
    import typing

    from areal_hpc.config import RunConfig
    cls = cls or RunConfig
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(hint):
            yield from _enumerations(hint, key + ".")
            continue
        args = typing.get_args(hint)
        if typing.get_origin(hint) is typing.Union and type(None) in args:
            inner = [a for a in args if a is not type(None)]
            if len(inner) == 1 and typing.get_origin(inner[0]) is typing.Literal:
                yield key, (None, *typing.get_args(inner[0]))
        elif typing.get_origin(hint) is typing.Literal:
            yield key, args


def test_every_enumeration_is_checked_by_the_schema(tmp_path):
    """Each key typed with a Literal: its default is one of its choices, any choice loads, and
    any other value is refused in one line naming the key and every choice."""
    import re

    from areal_hpc.config.rules import _get
    found = dict(_enumerations())
    assert {"model.dtype", "train.prox", "train.off_policy", "rollout.stale_policy", "weights.mode",
            "train.recompute_granularity", "checkpoint.resume"} <= set(found)
    assert len(found) >= 17
    base = load(_yaml(tmp_path, BASE))
    for key, choices in found.items():
        assert _get(base, key) in choices, key
        names = ", ".join(repr(c) for c in choices if c is not None)
        with pytest.raises(ConfigError) as err:
            load(_yaml(tmp_path, BASE), [f"{key}=bogus"])
        assert re.fullmatch(rf"config key '{re.escape(key)}': Invalid value 'bogus', expected one of "
                            rf"\[{re.escape(names)}\]", str(err.value)), str(err.value)
    ok = load(_yaml(tmp_path, BASE), ["train.prox=loglinear", "rollout.stale_policy=drop"])
    assert (ok.train.prox, ok.rollout.stale_policy) == ("loglinear", "drop")
    assert type(ok.train.prox) is str


# -- the interpolation rule, on the resolved config ----------------------------------------------
SECRET = "areal-test-secret-7f3a"
ENV_ROUTES = [
    (["data.system_prompt=${oc.env:AREAL_TEST_SECRET}"], "data.system_prompt"),
    (["data.system_prompt='x ${oc.env:AREAL_TEST_SECRET,none} y'"], "data.system_prompt"),
    (["name=env", "data.system_prompt=${oc.${name}:AREAL_TEST_SECRET}"], "data.system_prompt"),
    (["name=env", "data.system_prompt=${oc.decode:'\\${oc.${name}:AREAL_TEST_SECRET}'}"], "data.system_prompt"),
    (["model.path=${oc.env:AREAL_TEST_SECRET}", "data.system_prompt=${model.path}"], "data.system_prompt"),
    (["model.path=${oc.env:AREAL_TEST_SECRET}", "name=${model.path}"], "name"),
    (["model.path=${oc.env:AREAL_TEST_SECRET}", "data.system_prompt=${oc.select:model.path}"],
     "data.system_prompt"),
    (["model.path=${oc.env:AREAL_TEST_SECRET}", "data.assistant_prefix=${oc.deprecated:model.path}"],
     "data.assistant_prefix"),
    (["train.seed=${oc.env:AREAL_TEST_SECRET}"], "train.seed"),
    (["checkpoint.signals=[USR1,'${oc.env:AREAL_TEST_SECRET}']"], r"checkpoint.signals[1]"),
]


@pytest.mark.parametrize("overrides,key", ENV_ROUTES, ids=[" ".join(o) for o, _ in ENV_ROUTES])
@pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning")      # oc.deprecated's own
def test_no_route_gets_an_environment_value_into_a_key_that_is_not_a_path(monkeypatch, overrides, key):
    from omegaconf import OmegaConf
    monkeypatch.setenv("AREAL_TEST_SECRET", SECRET)
    with pytest.raises(ConfigError) as info:
        load(None, ["model.path=m", "data.train_path=t.jsonl", *overrides])
    msg = str(info.value)
    assert msg.startswith(f"config key '{key}': an environment interpolation") and "\n" not in msg, msg
    assert SECRET not in msg
    assert OmegaConf.create({"a": "${oc.env:AREAL_TEST_SECRET}"}).a == SECRET     # oc.env put back


def test_paths_may_still_come_from_the_environment_and_copy_each_other(monkeypatch):
    monkeypatch.setenv("AREAL_TEST_SCRATCH", "/scratch/me")
    cfg = load(None, ["model.path=${oc.env:AREAL_TEST_SCRATCH}/m", "data.train_path=${model.path}/t.jsonl",
                      "data.eval_path=${oc.env:AREAL_TEST_NOT_SET,/data/e.jsonl}",
                      "output_dir=${oc.env:AREAL_TEST_SCRATCH}/runs", "data.system_prompt=${name}"])
    assert (cfg.model.path, cfg.data.train_path) == ("/scratch/me/m", "/scratch/me/m/t.jsonl")
    assert (cfg.data.eval_path, cfg.output_dir, cfg.data.system_prompt) == ("/data/e.jsonl", "/scratch/me/runs", "run")
    assert "/scratch/me/m" in to_yaml(cfg)


# -- run names -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,why", [(".", "output_dir itself"), ("a/b", "a path, not a name"),
                                      ("-rf", "a leading '-'"), ("x" * 300, "over 255 bytes")])
def test_a_run_name_is_a_plain_name(name, why):
    with pytest.raises(ConfigError) as info:
        load(None, ["model.path=m", "data.train_path=t.jsonl", f"name={name}"])
    msg = str(info.value)
    assert msg.startswith("config key 'name': must be a") and why in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text", ['name: ".."\n', 'name: ""\n', 'name: "a\\0b"\n', 'name: "a\\x01b"\n',
                                  'name: "a\\tb"\n'])
def test_a_run_name_from_yaml_is_a_plain_name_too(tmp_path, text):
    with pytest.raises(ConfigError, match=r"^config key 'name': must be a (plain )?folder name inside output_dir"):
        load(_yaml(tmp_path, BASE + text))


def test_a_config_file_that_is_not_a_regular_file_is_one_line(tmp_path):
    import os
    os.mkfifo(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match=r"c\.yaml: cannot read the config file: a FIFO, not a regular file"):
        load(tmp_path / "c.yaml")
    (tmp_path / "big.yaml").write_text(BASE + "#" * (1 << 20))
    with pytest.raises(ConfigError, match=r"big\.yaml: cannot read the config file: over 1048576 bytes"):
        load(tmp_path / "big.yaml")
