"""Bad configs, model directories and datasets: each is refused by load() / check_inputs() with one
ConfigError line naming the key, file or row, before any rank starts (issue 13)."""
import json
import re
import shutil
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from areal_hpc.config import RANGES, ConfigError, RunConfig, load
from areal_hpc.preflight import check_inputs
from tests.config.conftest import TINY_HF, write_model_dir

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.path=m", "data.train_path=t.jsonl"]


def _refused(match: str, fn, *args):
    with pytest.raises(ConfigError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert re.search(match, msg), f"{match!r} not in {msg!r}"
    return msg


OVERRIDES = [
    # the audit's cases
    (["rollout.top_p=0"], r"'rollout\.top_p': must be > 0, got 0"),
    (["rollout.top_p=1.5"], r"'rollout\.top_p': must be <= 1"),
    (["checkpoint.signals=[KILL]"], r"checkpoint\.signals.*SIGKILL.*cannot be caught"),
    (["checkpoint.signals=[USR1,STOP]"], r"checkpoint\.signals.*SIGSTOP.*cannot be caught"),
    (["data.prompt_template='Q: {questoin}'"], r"data\.prompt_template.*unknown field \{questoin\}"),
    (["data.prompt_template='{question'"], r"data\.prompt_template.*expected '\}'"),
    (["data.prompt_template='}{question}'"], r"data\.prompt_template.*Single '\}'"),
    (["data.eval_limit=-1"], r"'data\.eval_limit': must be >= 0, got -1"),
    (["topology.n_generators=100000"], r"'topology\.n_generators': must be <= 65536"),
    (["data.eval_samples=0"], r"'data\.eval_samples': must be >= 1, got 0"),
    # the trust boundary's second round (issue 27, item 7)
    (["name=/etc/areal"], r"'name': must be a folder name inside output_dir"),
    (["name=../../elsewhere"], r"'name': must be a folder name inside output_dir"),
    (["name=runs/../.."], r"'name': must be a folder name inside output_dir"),
    (["name=''"], r"'name': must be a folder name inside output_dir"),
    (["rollout.max_new_tokens=512", "rollout.max_model_len=512"],
     r"'rollout\.max_new_tokens': 512 leaves no room for a prompt in rollout\.max_model_len = 512"),
    (["reward.workers=100000"], r"'reward\.workers': must be in \[1, 512\]"),
    (["reward.math_timeout_s=1e9"], r"'reward\.math_timeout_s': must be in \(0, 3600\] seconds"),
    (["reward.fn_timeout_s=inf"], r"'reward\.fn_timeout_s': must be in \(0, 3600\] seconds"),
    (["name=${oc.env:HOME}"], r"'name': an environment interpolation .* would be written, resolved"),
    (["data.system_prompt=${oc.env:HOME}"], r"'data\.system_prompt': an environment interpolation"),
    # every config number that becomes part of a reward: finite and within ±1e6 (issue: trust
    # boundary, third round, item 2): a typo of 1e300 is one line at load, not an inf in the log
    (["reward.weight=1e300"], r"'reward\.weight'"),     # no such key: the weights are per function
    (["reward.functions=[{fn: f.py:f, weight: 1e300}]"],
     r"'reward\.functions\[0\]\.weight': must be <= 1000000, got 1e\+300 \(a reward term"),
    (["reward.functions=[{fn: f.py:f}, {fn: g.py:g, weight: -1e7}]"],
     r"'reward\.functions\[1\]\.weight': must be >= -1000000, got -10000000"),
    (["reward.functions=[{fn: f.py:f, weight: .nan}]"],
     r"'reward\.functions\[0\]\.weight': must be a finite number, got nan"),
    (["reward.functions=[{fn: f.py:f, weight: .inf}]"],
     r"'reward\.functions\[0\]\.weight': must be a finite number, got inf"),
    (["reward.functions=[{fn: f.py:f, weight: -.inf}]"],
     r"'reward\.functions\[0\]\.weight': must be a finite number, got -inf"),
    (["train.reward_bias=1e300"], r"'train\.reward_bias': must be <= 1000000"),
    (["train.reward_bias=inf"], r"'train\.reward_bias': must be a finite number"),
    (["train.reward_scaling=1e300"], r"'train\.reward_scaling': must be <= 1000000"),
    (["train.reward_scaling=nan"], r"'train\.reward_scaling': must be a finite number"),
    (["train.reward_clip=1e39"], r"'train\.reward_clip': must be <= 1000000"),
    # others
    (["checkpoint.signals=[USR9]"], r"checkpoint\.signals.*unknown signal 'USR9'"),
    (["checkpoint.signals=[_IGN]"], r"checkpoint\.signals.*unknown signal"),
    (["checkpoint.signals=[SEGV]"], r"checkpoint\.signals.*SIGSEGV"),
    (["checkpoint.signals=[CHLD]"], r"checkpoint\.signals.*SIGCHLD"),
    (["data.prompt_template='{}'"], r"data\.prompt_template.*positional"),
    (["data.prompt_template='{0}'"], r"data\.prompt_template.*unknown field \{0\}"),
    (["data.prompt_template='{question:d}'"], r"data\.prompt_template.*format spec"),
    (["data.prompt_template='{question!x}'"], r"data\.prompt_template.*conversion"),
    (["data.prompt_template='{question[0]}'"], r"data\.prompt_template.*unknown field"),
    (["data.prompt_template='{question:{question}}'"], r"data\.prompt_template.*nested"),
    (["data.prompt_template=no field here"], r"data\.prompt_template.*no field"),
    (["data.kind=code", "data.prompt_template='{prompt}'"], r"data\.prompt_template.*data\.kind=code"),
    (["topology.n_trainers=0"], r"'topology\.n_trainers': must be >= 1"),
    (["topology.tp=0"], r"'topology\.tp': must be >= 1"),
    (["train.lr=nan"], r"'train\.lr': must be a finite number, got nan"),
    (["train.lr=inf"], r"'train\.lr': must be a finite number"),
    (["train.min_lr=-1e-6"], r"'train\.min_lr': must be >= 0"),
    (["rollout.temperature=0.001"], r"'rollout\.temperature': must be >= 0\.01"),
    (["rollout.temperature=3"], r"'rollout\.temperature': must be <= 2"),
    (["rollout.gpu_memory_utilization=1.5"], r"gpu_memory_utilization': must be <= 1"),
    (["rollout.kv_cache_gib=0"], r"'rollout\.kv_cache_gib': must be >= 1"),
    (["rollout.heartbeat_s=-1"], r"'rollout\.heartbeat_s': must be >= 0\.001"),
    (["rollout.collective_timeout_s=0"], r"'rollout\.collective_timeout_s': must be >= 0\.001"),
    (["weights.timeout_s=inf"], r"'weights\.timeout_s': must be a finite number"),
    (["weights.join_timeout_s=1e12"], r"'weights\.join_timeout_s': must be <="),
    (["weights.bucket_mb=0"], r"'weights\.bucket_mb': must be >= 1"),
    (["train.adam_beta2=1.0"], r"'train\.adam_beta2': must be < 1"),
    (["train.eps_clip=0"], r"'train\.eps_clip': must be > 0"),
    (["train.dual_clip=1.0"], r"'train\.dual_clip': must be > 1"),
    (["train.behav_imp_weight_cap=0.5"], r"'train\.behav_imp_weight_cap': must be >= 1"),
    (["train.reward_bias=nan"], r"'train\.reward_bias': must be a finite number"),
    (["train.seed=-1"], r"'train\.seed': must be >= 0"),
    (["checkpoint.keep=0"], r"'checkpoint\.keep': must be >= 1"),
    (["topology.gpu_mem_gib=-1"], r"'topology\.gpu_mem_gib': must be >= 0"),
    (["topology.trainer_cpus=0-x"], r"topology\.trainer_cpus: '0-x' is not a CPU number or range"),
    (["topology.generator_cpus=3-1"], r"topology\.generator_cpus: '3-1' is not a CPU range"),
    # override syntax
    (["train.lr=[1"], r"'train\.lr': override 'train\.lr=\[1' is not a valid YAML value"),
    (["train.lr={"], r"'train\.lr': override"),
    (["train.total_steps"], r"override must be key=value"),
    (["=3"], r"override must be key=value"),
    (["train.total_steps=1.5"], r"train\.total_steps"),
    (["name=${nope}"], r"name"),
    (["rollout=3"], r"'rollout': must be a mapping of rollout\.\* keys, got 3"),
]


@pytest.mark.parametrize("overrides,match", OVERRIDES, ids=[" ".join(o) for o, _ in OVERRIDES])
def test_bad_override(overrides, match):
    _refused(match, load, None, BASE + overrides)


YAMLS = [
    ("model: {path: m\ndata: {train_path: t}\n", r"c\.yaml:\d+: bad YAML"),
    ("model: {path: m}\nmodel: {path: n}\ndata: {train_path: t}\n", r"c\.yaml:2: bad YAML: found duplicate key model"),
    ("model:\n  path: m\n  dtype: float32\n  path: n\ndata: {train_path: t}\n", r"c\.yaml:4: .*duplicate key path"),
    ("model: {path: m}\ndata: {train_path: t}\nname: \xe9t\xe9\n".encode("latin-1"), r"c\.yaml:3: not UTF-8"),
    ("- model\n- data\n", r"c\.yaml: expected a mapping.*got a list"),
    ("model: {path: m}\ndata: {train_path: t}\ndata: {prompt_template: 'x'}\n", r"c\.yaml:3: .*duplicate key data"),
    ("model: {path: m}\n\tdata: {train_path: t}\n", r"c\.yaml:\d+: bad YAML"),
    ("model: {path: m}\ndata: {train_path: t}\ntrain: 5\n", r"'train': must be a mapping"),
    ("model: {path: m}\ndata: {train_path: t, prompt_template: 'Q: {questoin}'}\n", r"data\.prompt_template.*questoin"),
]


@pytest.mark.parametrize("text,match", YAMLS)
def test_bad_yaml_file(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    _refused(match, load, p)


def _model(tmp_path, edit=None, **hf):
    d = write_model_dir(tmp_path / "model", {k: v for k, v in {**TINY_HF, **hf}.items() if v is not None})
    if edit:
        edit(d)
    return d


def _paths_cfg(model, data, *extra):
    return load(None, [f"model.path={model}", f"data.train_path={data}",
                       f"output_dir={Path(model).parent}/runs", *extra])


MODELS = [
    (dict(model_type="llama"), (), r"config\.json: model_type 'llama' is not supported"),
    (dict(architectures=["LlamaForCausalLM"]), (), r"config\.json: architectures .* not supported"),
    (dict(hidden_size=None), (), r"config\.json: key 'hidden_size' missing"),
    (dict(num_hidden_layers=0), (), r"config\.json: key 'num_hidden_layers' must be a positive"),
    (dict(max_position_embeddings=None), (), r"config\.json: key 'max_position_embeddings' missing"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), (), r"rope scaling 'yarn'"),
    (dict(hidden_act="gelu"), (), r"hidden_act 'gelu'"),
    (dict(use_sliding_window=True), (), r"use_sliding_window"),
    (dict(num_key_value_heads=3), (), r"num_key_value_heads.*must divide"),
    (dict(vocab_size=16), (), r"tokenizer in .* has 23 tokens but .*vocab_size = 16"),
    ({}, ("rollout.max_model_len=1024",), r"'rollout\.max_model_len': 1024 exceeds max_position_embeddings = 512"),
    ({}, ("topology.n_trainers=3", "topology.pp=3"), r"'topology\.pp': num_hidden_layers = 2"),
    ({}, ("topology.n_trainers=3", "topology.tp=3", "train.sequence_parallel=false"), r"'topology\.tp': num_attention_heads = 4"),
    ({}, ("rollout.engine_tp=3",), r"'rollout\.engine_tp'"),
    ({}, ("train.recompute_granularity=full", "train.recompute_method=block",
          "train.recompute_num_layers=3"), r"'train\.recompute_num_layers': 3 exceeds the 2 layers"),
]


@pytest.mark.parametrize("hf,extra,match", MODELS, ids=[m for _, _, m in MODELS])
def test_bad_model_dir(tmp_path, datasets, hf, extra, match):
    _refused(match, check_inputs, _paths_cfg(_model(tmp_path, **hf), datasets["math"], *extra))


def _rm(*names):
    def edit(d):
        for n in names:
            (d / n).unlink(missing_ok=True)
    return edit


def _write(name, data):
    def edit(d):
        (d / name).write_bytes(data)
    return edit


MODEL_FILES = [
    (_write("config.json", b'{\n  "model_type": "qwen2",\n  "hidden_size": 128\n  "vocab_size": 64\n}\n'),
     r"config\.json:4:3: bad JSON: Expecting ',' delimiter"),
    (_write("config.json", b'{"model_type": "qwen2", "name": "\xff"}'), r"config\.json:1: not UTF-8"),
    (_write("config.json", b"[1, 2]"), r"config\.json: expected a JSON object, got list"),
    (_rm("model.safetensors"), r"no \*\.safetensors weights in"),
    (_write("model.safetensors.index.json", b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'),
     r"index\.json names model-00001-of-00002\.safetensors, which is missing"),
    (_rm("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"),
     r"'model\.path': no tokenizer in .*tokenizer\.json"),
    (_write("tokenizer.json", b"{not json"), r"'model\.path': the tokenizer in .* does not load"),
]


@pytest.mark.parametrize("edit,match", MODEL_FILES, ids=[m for _, m in MODEL_FILES])
def test_broken_model_files(tmp_path, datasets, edit, match):
    _refused(match, check_inputs, _paths_cfg(_model(tmp_path, edit), datasets["math"]))


DATA = [
    ("math", b'{"question": "1+1=", "answer": "2"}\n{"question": "2+2=" "answer": "4"}\n',
     r"data\.train_path.*d\.jsonl:2: bad JSON"),
    ("math", b'{"question": "1+1=", "answer": "2"}\n\n{"question": "2+2="}\n', r"d\.jsonl:3: missing key 'answer'"),
    ("math", b'{"question": "1+1=", "answer": "2"}\n{"question": "\xff", "answer": "4"}\n',
     r"data\.train_path.*d\.jsonl:2: not UTF-8 text"),
    ("math", b'{"question": "1+1=", "answer": 2}\n', r"d\.jsonl:1: 'answer' must be a string"),
    ("math", b'[1, 2]\n', r"d\.jsonl:1: expected a JSON object"),
    ("math", b"[" * 100000 + b"\n", r"d\.jsonl:1: bad JSON"),
    ("math", b"\n\n", r"holds no rows"),
    ("code", b'{"question": "p", "answer": {"fn_name": "f", "inputs": [], "outputs": []}}\n',
     r"d\.jsonl:1: .*call-based"),
    ("code", b'{"question": "p", "answer": []}\n', r"d\.jsonl:1: .*no tests"),
]


@pytest.mark.parametrize("kind,data,match", DATA, ids=[m for _, _, m in DATA])
def test_bad_dataset(model_dir, tmp_path, kind, data, match):
    p = tmp_path / "d.jsonl"
    p.write_bytes(data)
    cfg = _paths_cfg(model_dir, p, f"data.kind={kind}", f"output_dir={tmp_path}/runs")
    _refused(match, check_inputs, cfg)
    eval_cfg = load(None, [f"model.path={model_dir}", f"data.train_path={p}", f"data.eval_path={p}",
                           f"data.kind={kind}", f"output_dir={tmp_path}/runs"])
    _refused(match.replace("data\\.train_path", "data\\.(train|eval)_path"), check_inputs, eval_cfg)


def test_good_inputs_pass(model_dir, datasets, tmp_path):
    check_inputs(_paths_cfg(model_dir, datasets["math"], f"data.eval_path={datasets['math']}",
                           "data.prompt_template='Q: {question}\\nA: \\boxed{{}}'"))
    check_inputs(_paths_cfg(model_dir, datasets["code"], "data.kind=code", "data.question_key=prompt",
                           "data.answer_key=tests"))


def _numeric_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            yield from _numeric_keys(t, f"{prefix}{f.name}.")
        elif {int, float} & set(typing.get_args(t) or (t,)):
            yield prefix + f.name


def test_every_numeric_key_has_a_range():
    keys = [k for k in _numeric_keys(RunConfig) if not k.startswith("reward.")]
    assert sorted(set(keys) - set(RANGES)) == []
    assert sorted(set(RANGES) - set(keys)) == []


def test_shipped_recipes_fit_their_models():
    from areal_hpc.preflight import check_model_config
    for recipe, model in (("qwen2_5_1_5b_math", "DeepSeek-R1-Distill-Qwen-1.5B"),
                          ("qwen2_5_7b_math", "DeepSeek-R1-Distill-Qwen-7B"),
                          ("qwen2_5_32b_math", "DeepSeek-R1-Distill-Qwen-32B")):
        path = ROOT / "configs/models" / model / "config.json"
        check_model_config(load(ROOT / f"configs/{recipe}.yaml"), json.loads(path.read_text()), str(path))


def test_tiny_recipe_passes_check_inputs(model_dir, datasets):
    """The tiny recipe as shipped, on a model directory like the one make_tiny_model.py writes."""
    cfg = load(ROOT / "configs/tiny_cpu.yaml",
               [f"model.path={model_dir}", f"data.train_path={datasets['math']}",
                f"data.eval_path={datasets['math']}", "output_dir=/nonexistent-areal-test"])
    check_inputs(cfg)


def test_tokenizer_missing_entirely(tmp_path, datasets):
    d = _model(tmp_path)
    for p in list(d.iterdir()):
        if p.name not in ("config.json", "model.safetensors"):
            p.unlink() if p.is_file() else shutil.rmtree(p)
    _refused(r"'model\.path': no tokenizer in", check_inputs, _paths_cfg(d, datasets["math"]))


def test_first_prompt_must_tokenize_and_fit(model_dir, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "hi?", "answer": "1"}) + "\n")   # not in the alphabet
    _refused(r"'model\.path': the tokenizer in .* turns the first prompt 'hi\?' into no tokens",
             check_inputs, _paths_cfg(model_dir, p))
    p.write_text(json.dumps({"question": "1+" * 200, "answer": "1"}) + "\n")
    _refused(r"'rollout\.max_model_len': the first prompt is 400 tokens, no room to generate in 256",
             check_inputs, _paths_cfg(model_dir, p, "rollout.max_model_len=256", "rollout.max_new_tokens=16"))


def test_every_prompt_must_fit_and_a_huge_one_is_not_tokenized(model_dir, tmp_path):
    """A later row too long for rollout.max_model_len would end the generator mid-run (vLLM
    refuses it): named before any rank starts; a question of megabytes is refused untokenized."""
    p = tmp_path / "d.jsonl"
    rows = [{"question": "1+1", "answer": "2"}] * 3 + [{"question": "1+" * 200, "answer": "1"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(r"'data\.train_path': row 3: its prompt is 400 tokens, no room to generate in "
             r"rollout\.max_model_len = 256", check_inputs,
             _paths_cfg(model_dir, p, "rollout.max_model_len=256", "rollout.max_new_tokens=16"))
    rows[3] = {"question": "1" * (8 << 20), "answer": "1"}
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(r"'data\.train_path': row 3: the question is 8388608 characters, over 32 per token "
             r"of rollout\.max_model_len = 256 \(not tokenized\)", check_inputs,
             _paths_cfg(model_dir, p, "rollout.max_model_len=256", "rollout.max_new_tokens=16"))


def test_an_answer_that_is_a_solution_is_refused(model_dir, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n"
                 + json.dumps({"question": "1+2", "answer": "3 " * 600}) + "\n")
    _refused(r"'data\.train_path': row 1: its answer is 1200 characters \(at most 1000",
             check_inputs, _paths_cfg(model_dir, p))


def test_reward_numbers_at_the_bound_load(tmp_path):
    cfg = load(None, BASE + ["reward.functions=[{fn: f.py:f, weight: 1e6}, {fn: g.py:g, weight: -1e6}]",
                             "train.reward_bias=-1e6", "train.reward_scaling=1e6", "train.reward_clip=1e6"])
    assert [f.weight for f in cfg.reward.functions] == [1e6, -1e6]
    p = tmp_path / "c.yaml"         # the same typo in a YAML file
    p.write_text("model: {path: m}\ndata: {train_path: t}\n"
                 "reward: {functions: [{fn: f.py:f, weight: 1.0e+300}]}\n")
    _refused(r"'reward\.functions\[0\]\.weight': must be <= 1000000", load, p)
