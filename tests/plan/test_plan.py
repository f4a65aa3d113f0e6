"""The per-GPU memory model and its preflight (areal_hpc.plan): pure logic, no Megatron start."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc import plan
from areal_hpc.config import ConfigError, load

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [ROOT / f"configs/qwen2_5_{m}_math.yaml" for m in ("1_5b", "7b", "32b")]
GiB = 2**30

# A small Qwen2, by hand: h 64, ffn 128, 2 layers, 4 heads of 16, 2 kv heads, vocab 128, untied.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
EMB = 128 * 64
LAYER = (4 + 2 * 2) * 16 * 64 + (4 + 2 * 2) * 16 + 64 * 64 + 3 * 128 * 64 + 2 * 64  # qkv+bias, o, mlp, norms


def _model_dir(tmp_path, hf=SMALL, text=None) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(text if text is not None else json.dumps(hf))
    return d


def _small(tmp_path, *extra, hf=SMALL):
    return load(None, [f"model.path={_model_dir(tmp_path, hf)}", "data.train_path=x.jsonl",
                       "train.max_tokens_per_mb=512", "rollout.max_model_len=256", *extra])


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_fit_their_gpus_and_print_tables(recipe, capsys):
    assert plan.main(["memory", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "trainer rank" in out and "generator rank" in out and "fits in 80 GiB" in out
    cfg = load(recipe)
    assert cfg.topology.gpu_mem_gib == 80 and cfg.topology.device == "cuda"
    plan.check_fits(cfg)                                    # what the launchers run
    est = plan.estimate(cfg)
    assert len(est.trainer) == cfg.topology.pp
    assert all(st.total < 80 * GiB for st in est.trainer) and est.generator.total < 80 * GiB


def test_huge_micro_batch_on_32b_is_refused_naming_the_largest_term(capsys):
    args = ["memory", str(RECIPES[2]), "train.max_tokens_per_mb=262144"]
    assert plan.main(args) == 2
    line = _one_line_error(capsys)
    est = plan.estimate(load(RECIPES[2], args[2:]))
    worst = est.worst_stage()
    big = worst.largest()
    assert line == f"error: {est.error()}"
    assert line.startswith(f"error: trainer stage 0 needs {worst.total / GiB:.1f} GiB of 80 GiB: "
                           f"{big.name} {big.bytes / GiB:.1f} GiB (shrink with ")
    assert big.name == "activations" and "train.max_tokens_per_mb" in line
    with pytest.raises(ConfigError, match="^trainer stage 0 needs"):
        plan.check_fits(load(RECIPES[2], args[2:]))


def test_mask_attention_at_30720_is_refused_naming_attention(capsys):
    assert plan.main(["memory", str(RECIPES[0]), "train.attention=mask"]) == 2
    line = _one_line_error(capsys)
    assert "attention" in line.split(":", 2)[2] and "train.attention=varlen" in line
    est = plan.estimate(load(RECIPES[0], ["train.attention=mask"]))
    scores = est.worst_stage().term("attention scores").bytes
    # 14 layers x 2 in flight are recomputed, but one layer's [12 heads, S, S] softmax (4 B) and
    # its bf16 copy are alive during its backward anyway
    assert scores >= 12 * 30720**2 * 6


def test_broken_or_incomplete_config_json_is_one_line_naming_file_and_key(tmp_path, capsys):
    d = _model_dir(tmp_path, text="{not json")
    args = ["memory", str(RECIPES[0]), f"model.path={d}"]
    assert plan.main(args) == 2
    line = _one_line_error(capsys)
    assert str(d / "config.json") in line
    _model_dir(tmp_path, {k: v for k, v in SMALL.items() if k != "hidden_size"})
    assert plan.main(args) == 2
    line = _one_line_error(capsys)
    assert str(d / "config.json") in line and "'hidden_size'" in line and "missing" in line


def test_model_config_resolution(tmp_path):
    # the model's own config.json wins; else configs/models/<basename>; else an error
    own = _model_dir(tmp_path)
    assert plan.model_config_path(str(own)) == own / "config.json"
    shipped = plan.model_config_path("/nowhere/DeepSeek-R1-Distill-Qwen-7B")
    assert shipped == ROOT / "configs/models/DeepSeek-R1-Distill-Qwen-7B/config.json"
    with pytest.raises(ConfigError, match="model.path"):
        plan.model_config_path("/nowhere/NoSuchModel")


def test_shipped_model_configs_are_what_the_trainer_builds():
    from areal_hpc.train.hf_convert import gpt_model_kwargs, megatron_config_kwargs

    expect = {"1.5B": (1536, 8960, 28, 12, 2, 151936, 1.78e9), "7B": (3584, 18944, 28, 28, 4, 152064, 7.62e9),
              "32B": (5120, 27648, 64, 40, 8, 152064, 32.76e9)}
    for size, (h, ffn, layers, nh, ng, vocab, n) in expect.items():
        path = ROOT / f"configs/models/DeepSeek-R1-Distill-Qwen-{size}/config.json"
        hf = json.loads(path.read_text())
        arch = plan.Arch.from_hf(hf, str(path))
        assert (arch.hidden, arch.ffn, arch.layers, arch.heads, arch.kv_heads, arch.vocab) == (h, ffn, layers, nh, ng, vocab)
        assert not arch.tied and abs(arch.total_params - n) < 0.01e9
        mc = megatron_config_kwargs(hf)
        assert (mc["hidden_size"], mc["ffn_hidden_size"], mc["num_query_groups"], mc["kv_channels"]) == \
            (h, ffn, ng, arch.head_dim)
        assert gpt_model_kwargs(hf)["vocab_size"] == arch.vocab    # no padding in the trainer


def test_cpu_configs_and_zero_gpu_mem_are_not_blocked(tmp_path, capsys):
    tiny = load(ROOT / "configs/tiny_cpu.yaml")
    plan.check_fits(tiny)       # models/tiny need not exist yet: nothing is read on CPU
    huge = load(RECIPES[2], ["train.max_tokens_per_mb=262144", "topology.gpu_mem_gib=0"])
    plan.check_fits(huge)
    # `plan memory` on a CPU config prints the table without a verdict, or against --gpu-mem
    d = _model_dir(tmp_path)
    assert plan.main(["memory", str(ROOT / "configs/tiny_cpu.yaml"), f"model.path={d}"]) == 0
    out = capsys.readouterr().out
    assert "trainer rank" in out and "no GPU memory to compare" in out
    assert plan.main(["memory", str(ROOT / "configs/tiny_cpu.yaml"), f"model.path={d}", "--gpu-mem", "0.001GiB"]) == 2
    assert " needs " in _one_line_error(capsys)


def test_param_bytes_by_hand(tmp_path):
    n = 2 * EMB + 2 * LAYER + 64                              # + final norm
    cfg = _small(tmp_path, "model.dtype=float32")
    est = plan.estimate(cfg)
    assert est.arch.total_params == n
    (st,) = est.trainer
    assert st.term("params").bytes == 4 * n
    assert st.term("grads").bytes == 4 * n
    assert st.term("optimizer state").bytes == 8 * n        # Adam m, v (params are the fp32 ones)
    # bf16, pp 2, dp 2, distributed optimizer: stage 0 = embedding + 1 layer, stage 1 = 1 layer
    # + final norm + output layer; 2 + 4 B per param, 12 / dp B of main weights and Adam state
    cfg = _small(tmp_path, "model.dtype=bfloat16", "topology.pp=2", "topology.n_trainers=4",
                 "train.distributed_optimizer=true", "topology.device=cuda")
    s0, s1 = plan.estimate(cfg).trainer
    assert s0.term("params").bytes == 2 * (EMB + LAYER)
    assert s1.term("grads").bytes == 4 * (LAYER + 64 + EMB)
    assert s0.term("optimizer state").bytes == 12 * (EMB + LAYER) / 2
    # tied embeddings with pp > 1: the last stage holds a copy
    tied = _small(tmp_path, "topology.pp=2", "topology.n_trainers=2", hf={**SMALL, "tie_word_embeddings": True})
    assert plan.estimate(tied).trainer[1].term("params").bytes == 4 * (LAYER + 64 + EMB)
    tied1 = _small(tmp_path, hf={**SMALL, "tie_word_embeddings": True})
    assert plan.estimate(tied1).trainer[0].term("params").bytes == 4 * (EMB + 2 * LAYER + 64)


def test_activation_shapes_equal_the_measured_saved_tensors():
    # h 256, 4 heads of 64, 2 kv heads, ffn 704: bytes per token and layer the real Megatron layer
    # saves for backward on CPU (tools/bench_memory.py --saved, 1024 tokens in 4 sequences)
    arch = plan.Arch.from_hf(dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=704, vocab_size=1000, num_hidden_layers=2))
    kernel = plan.varlen_kernel("cpu", "float32")
    assert kernel == "sdpa_per_sequence"
    assert plan.layer_activation_bytes(arch, 4, 1, False, "varlen", kernel) == 26904
    assert plan.layer_activation_bytes(arch, 2, 1, False, "varlen", kernel) == 15512
    assert plan.layer_activation_bytes(arch, 4, 1, False, "mask", kernel) + \
        plan.mask_score_bytes(arch, 4, 1, 1024) / 1024 == 41736
    assert plan.layer_activation_bytes(arch, 2, 1, False, "mask", kernel) + \
        plan.mask_score_bytes(arch, 2, 1, 1024) / 1024 == 39304


def test_recompute_and_sequence_parallel_shrink_activations(tmp_path):
    base = ["model.dtype=bfloat16", "topology.device=cuda", "topology.tp=2", "topology.n_trainers=2",
            "train.max_tokens_per_mb=4096"]
    act = lambda *x: plan.estimate(_small(tmp_path, *base, *x)).trainer[0].term("activations").bytes  # noqa: E731
    none, sp = act(), act("train.sequence_parallel=true")
    full = act("train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1")
    assert full < sp < none
    # full+uniform keeps each layer's [S, h] input (bf16) besides the last stage's head terms
    head = 8 * 64 * 4096 + 4096 * 64 * 2
    assert full == 2 * 4096 * 64 * 2 + head


def test_layers_must_split_over_pp_and_generator_refusal_names_engine_tp(capsys):
    with pytest.raises(ConfigError, match="topology.pp"):
        plan.estimate(load(RECIPES[0], ["topology.pp=8"]))
    # 32B weights on one GPU per engine leave no room for one 28672-token sequence
    assert plan.main(["memory", str(RECIPES[2]), "rollout.engine_tp=1"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("error: generator:") and "rollout.engine_tp" in line


def test_gpu_mem_parsing():
    assert plan.parse_mem("80GiB") == 80 and plan.parse_mem("141") == 141
    assert plan.parse_mem("80GB") == pytest.approx(80e9 / GiB)
    with pytest.raises(ConfigError, match="--gpu-mem"):
        plan.parse_mem("lots")


def test_gpu_mem_option_anywhere_among_overrides(capsys):
    # 7B with 40960-token packs: 68 GiB on stage 0, which fits a 141 GiB GPU but not a 40 GB one
    assert plan.main(["memory", str(RECIPES[1]), "--gpu-mem", "141GiB", "train.max_tokens_per_mb=40960"]) == 0
    assert "fits in 141 GiB" in capsys.readouterr().out
    assert plan.main(["memory", str(RECIPES[1]), "train.max_tokens_per_mb=40960", "--gpu-mem", "40GB"]) == 2
    assert "of 37.25 GiB" in _one_line_error(capsys)


def test_launch_env_refuses_before_any_path_check():
    r = subprocess.run([sys.executable, "-m", "areal_hpc.launch.env", "configs/qwen2_5_32b_math.yaml",
                        "train.max_tokens_per_mb=262144"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer stage 0 needs "), lines
    assert "activations" in lines[0] and "train.max_tokens_per_mb" in lines[0]
    assert r.stdout == ""
