"""The step-time estimate and its preflight (areal_hpc.plan.budget): pure logic, no GPU."""
import subprocess
import sys
from pathlib import Path

import re

import pytest

from areal_hpc import plan, slurm_job
from areal_hpc.config import ConfigError, load
from areal_hpc.plan import budget
from tests.plan.test_memory_terms import small_config

ROOT = Path(__file__).resolve().parents[2]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"


def _small(tmp_path, *extra):
    """The small Qwen2 of test_plan.py (h 64, ffn 128, 2 layers, 4 heads of 16, 2 kv heads,
    vocab 128): B 8 x n 4 = 32 sequences; prompt 256 - 128 = 128 tokens, output 128 / 2 = 64:
    s = 192; 4 minibatches, so a step makes its π_prox pass (prox recompute)."""
    return small_config(tmp_path, "train.ppo_minibatches=4", *extra)


# By hand. Layer matmuls: qkv (4 + 2 * 2) * 16 = 128 outputs of 64 inputs + its bias, the output
# projection 64 x 64, fc1 (2 x 128) and fc2 (128) x 64.
LAYER = 128 * 64 + 128 + 64 * 64 + 3 * 128 * 64          # 36992
T, N, S = 32 * 192, 32 * 64, 192                          # tokens, output tokens, sequence length
ATTN = 2 * S * S * 4 * 16 * 2 * 32                        # 2 s^2 heads head_dim layers, 32 sequences
LAYERS_FWD = 2 * 2 * LAYER * T + ATTN                     # 909,115,392 + 301,989,888
HEAD_FWD = 2 * 128 * 64 * N                               # log-probs at the output positions only


def test_flops_by_hand(tmp_path):
    assert (LAYER, ATTN, LAYERS_FWD, HEAD_FWD) == (36992, 301_989_888, 1_211_105_280, 33_554_432)
    cfg = _small(tmp_path)                                # prox recompute, no activation recompute
    fl = budget.step_flops(cfg, plan.read_arch(cfg))
    assert (fl.tokens, fl.out_tokens) == (T, N)
    assert fl.train == 3 * LAYERS_FWD + 4 * HEAD_FWD == 3_767_533_568
    assert fl.recompute == 0
    # π_prox: a forward over 3 of the 4 minibatches (the first one's is its training forward)
    assert fl.prox == 0.75 * (LAYERS_FWD + HEAD_FWD) == 933_494_784
    assert fl.total == 4_701_028_352
    assert fl.attention == 3.75 * ATTN                    # 3 (train) + 3/4 (π_prox)
    # no π_prox pass with one minibatch (the training forward's log-probs are π_prox's) nor for
    # naive PPO (π_prox = π_behav)
    for extra in (("train.ppo_minibatches=1",), ("train.off_policy=naive",)):
        one = _small(tmp_path, *extra)
        fl1 = budget.step_flops(one, plan.read_arch(one))
        assert (fl1.prox, fl1.total, fl1.attention) == (0, 3 * LAYERS_FWD + 4 * HEAD_FWD, 3 * ATTN), extra
    # full recompute: one more forward of every layer; selective: of core attention only
    full = _small(tmp_path, "train.recompute_granularity=full", "train.recompute_method=uniform",
                  "train.recompute_num_layers=1")
    assert budget.step_flops(full, plan.read_arch(full)).total == 4_701_028_352 + LAYERS_FWD == 5_912_133_632
    sel = _small(tmp_path, "train.recompute_granularity=selective", "train.prox=loglinear")
    fl = budget.step_flops(sel, plan.read_arch(sel))
    assert (fl.prox, fl.recompute, fl.total) == (0, ATTN, 3 * LAYERS_FWD + 4 * HEAD_FWD + ATTN)
    # block recompute of 1 of the stage's 2 layers: half a forward more
    blk = _small(tmp_path, "train.recompute_granularity=full", "train.recompute_method=block",
                 "train.recompute_num_layers=1")
    assert budget.step_flops(blk, plan.read_arch(blk)).recompute == LAYERS_FWD / 2
    # --out-len 32: s = 160
    fl = budget.step_flops(cfg, plan.read_arch(cfg), out_len=32)
    assert (fl.tokens, fl.out_tokens) == (32 * 160, 32 * 32)


def test_seconds_at_the_stated_mfu(tmp_path):
    cfg = _small(tmp_path, "topology.device=cuda", "topology.n_trainers=2", "topology.mfu=0.5",
                 "topology.gpu=a100", "model.dtype=bfloat16")
    est = budget.estimate_time(cfg, gen_tok_s=1000.0)
    assert est.gpu.bf16_flops == 312e12
    assert est.train_s == pytest.approx(4_701_028_352 / (2 * 312e12 * 0.5), rel=1e-12)
    p = 2 * 128 * 64 + 2 * LAYER + 2 * 2 * 64 + 64           # embedding, output layer, layers + norms, final norm
    assert est.update_s == pytest.approx(2 * p / 20e9 + 2.0)  # throughput.py's broadcast constants
    assert est.ckpt_bytes == 14 * p and est.ckpt_s == pytest.approx(2 * 14 * p / 5e9)
    assert est.gen_s == pytest.approx(N / (1 * 1000.0))
    # the CLI flags win over the config's keys
    h = budget.estimate_time(cfg, gpu="H100", mfu=0.25, gen_tok_s=1000.0)
    assert h.train_s == pytest.approx(4_701_028_352 / (2 * 989e12 * 0.25), rel=1e-12)
    with pytest.raises(ConfigError, match="'topology.gpu': unknown GPU 'v100'"):
        budget.estimate_time(_small(tmp_path, "topology.gpu=v100"))


def _lines():
    out = []
    return out, out.append


def test_32b_step_cannot_fit_the_scripts_lead_and_is_refused_naming_the_keys():
    cfg = load(R32, ["topology.gpu=h100", "checkpoint.signal_lead_s=1200", "checkpoint.time_limit_s=86400"])
    est = budget.estimate_time(cfg)
    assert est.step_s + est.ckpt_s > 1200
    with pytest.raises(ConfigError) as err:
        budget.check_time(cfg, env={})
    line = str(err.value)
    assert "\n" not in line and line.startswith("checkpoint.signal_lead_s: a step (")
    assert f">= {int(est.step_s + est.ckpt_s) + 1}" in line
    for key in ("topology.gpu=h100", "topology.mfu=0.35", "train.batch_prompts", "rollout.group_size"):
        assert key in line
    # a lead that holds it, and a cadence that fits the limit: silent
    ok = load(R32, ["topology.gpu=h100", "checkpoint.signal_lead_s=9000", "checkpoint.time_limit_s=86400",
                    "checkpoint.every_steps=2"])
    got, warn = _lines()
    assert budget.check_time(ok, env={}, warn=warn) is not None and got == []
    # ten 2.1-hour steps between checkpoints in a 20-hour attempt: no timed checkpoint ever, refused
    slow = load(R32, ["topology.gpu=h100", "checkpoint.signal_lead_s=9000", "checkpoint.time_limit_s=72000",
                      "checkpoint.every_steps=10"])
    with pytest.raises(ConfigError) as err:
        budget.check_time(slow, env={}, warn=warn)
    line = str(err.value)
    assert "\n" not in line and line.startswith("checkpoint.every_steps=10: 10 steps take ")
    assert "more than the time limit" in line and "lower checkpoint.every_steps to <= 9" in line
    # five of them: over half the attempt, a warning
    half = load(R32, ["topology.gpu=h100", "checkpoint.signal_lead_s=9000", "checkpoint.time_limit_s=72000",
                      "checkpoint.every_steps=5"])
    budget.check_time(half, env={}, warn=warn)
    assert len(got) == 1 and got[0].startswith("checkpoint.every_steps=5: 5 steps take ")
    assert "over half of the time limit" in got[0] and "lower checkpoint.every_steps to <= 4" in got[0]


def test_skipped_on_cpu_without_a_gpu_name_or_without_a_clock():
    assert budget.check_time(load(ROOT / "configs/tiny_cpu.yaml"), env={}) is None
    assert budget.check_time(load(R32, ["topology.gpu=''"]), env={}) is None
    got, warn = _lines()
    assert budget.check_time(load(R32, ["topology.gpu=h100"]), env={}, warn=warn) is not None and got == []


def test_time_command_prints_the_assumptions(capsys):
    assert plan.main(["time", str(R32), "--gpu", "h100", "--mfu", "0.35"]) == 0
    out = capsys.readouterr().out
    assert "H100 SXM" in out and "MFU 0.35" in out and "trainer step" in out and "assumptions" in out
    assert plan.main(["time", str(R32), "--gpu", "h100", "--signal-lead", "1200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint.signal_lead_s: a step")
    assert plan.main(["time", str(R32), "topology.gpu=''"]) == 2
    assert "--gpu" in capsys.readouterr().err


def test_launch_env_refuses_a_step_longer_than_the_lead():
    r = subprocess.run([sys.executable, "-m", "areal_hpc.launch.env", str(R32), "topology.gpu=h100",
                        "checkpoint.signal_lead_s=1200"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.signal_lead_s: a step"), lines
    assert r.stdout == ""


def test_1_5b_recipe_fits_its_batch_scripts_lead():
    cfg = load(ROOT / "configs/qwen2_5_1_5b_math.yaml", ["checkpoint.time_limit_s=86400"])
    lead = slurm_job.lead_from_script((ROOT / "slurm/areal_1_5b.sh").read_text(), ["USR1"])
    est = budget.estimate_time(cfg)
    assert cfg.topology.gpu == "h100" and est.step_s + est.ckpt_s < lead
    got, warn = _lines()
    assert budget.check_time(load(ROOT / "configs/qwen2_5_1_5b_math.yaml",
                                  [f"checkpoint.signal_lead_s={lead}", "checkpoint.time_limit_s=86400"]),
                             env={}, warn=warn) is not None and got == []


@pytest.mark.parametrize("name", ["areal_1_5b.sh", "areal_7b.sh", "areal_32b.sh"])
def test_each_gpu_recipe_fits_its_own_batch_scripts_clock(name):
    """The preflight accepts every shipped recipe as its batch script submits it: the USR1 lead
    holds a step and its checkpoint, and checkpoint.every_steps x step fits --time."""
    text = (ROOT / "slurm" / name).read_text()
    config = re.search(r"slurm/job\.sh (configs/\S+\.yaml)", text).group(1)
    lead = slurm_job.lead_from_script(text, ["USR1", "TERM"])
    limit = slurm_job.parse_slurm_time(re.search(r"--time=(\S+)", text).group(1))
    cfg = load(ROOT / config, [f"checkpoint.signal_lead_s={lead}", f"checkpoint.time_limit_s={limit}"])
    got, warn = _lines()
    assert budget.check_time(cfg, env={}, warn=warn) is not None and got == []
