"""tools/evaluate.py: pass@k arithmetic, and the training job's held-out accuracy reproduced."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.analysis.evaluate import TOLERANCE_SIGMAS, main, pass_at_k, summarise

ROOT = Path(__file__).resolve().parents[2]


def test_pass_at_k():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 1 - 3 / 6          # 1 − C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0                # fewer than k wrong samples
    assert pass_at_k(5, 2, 3) == 1 - 1 / 10         # 1 − C(3,3)/C(5,3)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_summarise():
    got = summarise([1, 0, 4, 2], 4, [1, 4])
    assert got["pass@1"] == (0.25 + 0 + 1 + 0.5) / 4
    assert got["pass@4"] == (1 + 0 + 1 + 1) / 4
    assert got["pass@1_se"] == pytest.approx(np.std([0.25, 0, 1, 0.5], ddof=1) / 2)


def test_bad_inputs_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nomodel"), str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Hugging Face model directory" in err[0]


def _run(args, timeout):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_reproduces_the_training_log(trained_tiny_model, tmp_path):
    """A short job, then evaluate.py on the trained policy with the run's config: its pass@1 must
    match the job's eval.json within sampling noise.

    Tolerance: the two estimates are independent, each with standard error SE over problems
    (measured here from the per-problem pass rates), so their difference has s.d. √2·SE; we allow
    TOLERANCE_SIGMAS = 4 of those (a false failure about once in 16,000 runs)."""
    run = tmp_path / "ev"
    r = _run(["-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml", f"model.path={trained_tiny_model}",
              f"data.train_path={trained_tiny_model}/train.jsonl", f"data.eval_path={trained_tiny_model}/heldout.jsonl",
              f"output_dir={tmp_path}", "name=ev", "train.total_steps=3", "train.batch_prompts=4",
              "data.eval_limit=100", "data.eval_samples=4"], timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    claimed = {e["label"]: e for e in json.loads((run / "eval.json").read_text())}
    # The trained policy only: the initial model goes through the same code (a second engine
    # start would cost a suite near its budget half a minute for no new path).
    for model, label in ((run / "policy", "final"),):
        out = tmp_path / f"{label}.json"
        r = _run(["tools/evaluate.py", str(model), f"{trained_tiny_model}/heldout.jsonl",
                  "--config", str(run / "config.yaml"), "--json", str(out)], timeout=600)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
        res = json.loads(out.read_text())
        assert res["samples"] == claimed[label]["samples"] == 400
        assert res["claimed"]["label"] == label and res["reward_errors"] == 0
        assert res["accuracy"] == res["pass@1"]
        tol = TOLERANCE_SIGMAS * math.sqrt(2) * res["pass@1_se"]
        assert abs(res["pass@1"] - claimed[label]["accuracy"]) <= tol, (label, res, claimed[label])
        assert f"training log ({label}" in r.stdout and "within the sampling tolerance" in r.stdout
