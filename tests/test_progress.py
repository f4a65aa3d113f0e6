"""The per-step line (areal_hpc/progress.py): what a user watching the job reads."""
from areal_hpc.progress import Progress

STEP = {"step": 6, "reward": 0.25, "accuracy": 0.5, "response_len": 12.0, "staleness_max": 2,
        "staleness_mean": 1.5, "dropped_stale": 0, "gen_tok_per_s": 100.0, "loss": 0.1,
        "grad_norm": 1.0, "ess": 0.9, "wait_s": 0.5, "seconds": 2.0, "weight_sync_s": 0.1}


def test_the_line_names_restarted_engines_once_there_are_any(capsys):
    p = Progress(total_steps=10)
    p.step({**STEP, "engine_restarts": 0, "generators_live": 2})
    p.step({**STEP, "step": 7, "engine_restarts": 2, "generators_live": 2})
    p.close()
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert first.startswith("step    7 |") and "engines" not in first
    assert second.startswith("step    8 |") and second.endswith("| engines restarted 2, generators live 2")
