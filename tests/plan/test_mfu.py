"""One definition of MFU in the project: the planner's (`budget.pack_flops`, `budget.mfu`: what
topology.mfu means to `estimate_time`) and tools/gpu_check.py's reporting path (`step_mfu` over
the pack it trained) give the same number for one config. Pure arithmetic, no GPU."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.plan import budget
from tests.plan.test_memory_terms import SMALL, small_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def _pack(n: int, prompt: int, out: int) -> list[dict]:
    return [{"prompt_tokens": np.zeros(prompt, np.int64), "output_tokens": np.zeros(out, np.int64)}
            for _ in range(n)]


def test_gpu_check_reports_the_mfu_the_planner_assumes(tmp_path):
    # full recompute and a π_prox pass: every FLOP the step runs counts, in both
    cfg = small_config(tmp_path, "topology.device=cuda", "topology.gpu=h200", "topology.mfu=0.4",
                       "model.dtype=bfloat16", "train.ppo_minibatches=4", "train.recompute_granularity=full",
                       "train.recompute_method=uniform", "train.recompute_num_layers=1")
    est = budget.estimate_time(cfg, gen_tok_s=1000.0)
    prompt, out = budget.lengths(cfg)
    seqs = _pack(cfg.train.batch_prompts * cfg.rollout.group_size, int(prompt), int(out))
    dims = json.loads((Path(cfg.model.path) / "config.json").read_text())
    gpu = budget.GPUS["h200"]
    tflops, measured = gpu_check.step_mfu(dims, cfg.train, seqs, est.train_s, gpu)
    assert tflops * 1e12 * est.train_s == pytest.approx(est.flops.total, rel=1e-12)
    assert measured == pytest.approx(cfg.topology.mfu, rel=1e-12)
    assert measured == pytest.approx(budget.mfu(est.flops, est.train_s, gpu), rel=1e-12)
    # no GPU to take a peak of (the CPU dry run): TFLOP/s only
    assert gpu_check.step_mfu(dims, cfg.train, seqs, est.train_s, None) == (tflops, None)


def test_the_output_layer_counts_four_forwards():
    """By hand for a pack of unequal sequences, π_prox = behaviour, no recompute (check 3's
    case): layers 3 forwards, the output layer 4 (8 V h per output token: train/logprobs.py
    recomputes each chunk's logits in backward), causal attention 2 s^2 heads head_dim per layer
    and sequence, forward."""
    from areal_hpc.config import TrainConfig

    h, f, L, heads, kv, V = 64, 128, 2, 4, 2, 128
    hd = h // heads
    layer = (heads + 2 * kv) * hd * h + (heads + 2 * kv) * hd + heads * hd * h + 3 * f * h
    seqs = _pack(1, 3, 5) + _pack(1, 10, 30)
    lens, n_out = [8, 40], 35
    want = (3 * (2 * L * layer * sum(lens) + 2 * heads * hd * L * sum(s * s for s in lens))
            + 4 * 2 * V * h * n_out)
    tflops, mfu = gpu_check.step_mfu(SMALL, TrainConfig(prox="behaviour"), seqs, 1.0, budget.GPUS["a100"])
    assert tflops * 1e12 == want
    assert mfu == want / 312e12


def test_gpu_is_one_of_the_planners_and_refused_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--gpu", "x100", "--out", str(tmp_path / "r.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gpu: unknown GPU 'x100'; one of h100, h200"), err
    assert not (tmp_path / "r.txt").exists()
    r = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--gpu" in r.stdout, r.stderr
