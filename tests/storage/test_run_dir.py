"""RunDir: the run directory's file names and its housekeeping across attempts."""
import json

from areal_hpc.storage.checkpoint import step_dir
from areal_hpc.storage.run_dir import RunDir
from areal_hpc.storage.tensorboard import SUBDIR


def test_every_file_is_named_in_the_run_dir(tmp_path):
    run = RunDir(tmp_path)
    names = {p.name for p in (run.config, run.rollouts, run.metrics, run.evals, run.generators,
                              run.policy, run.weights, run.checkpoints, run.tensorboard)}
    assert names == {"config.yaml", "rollouts.h5", "metrics.jsonl", "eval.json",
                     "generators.json", "policy", "weights", "checkpoints", "tensorboard"}
    assert step_dir(tmp_path, 3).parent == run.checkpoints      # the checkpoint code agrees
    assert run.tensorboard.name == SUBDIR                        # so does TensorBoard's


def test_attempts_without_a_checkpoint_are_set_aside_numbered(tmp_path):
    run = RunDir(tmp_path)
    assert run.set_aside_attempt() is None                       # nothing written yet
    for k in (1, 2):
        for p in (run.rollouts, run.metrics, run.evals):
            p.write_text(f"attempt {k}")
        run.generators.write_text("kept")                        # not an attempt's file
        assert run.set_aside_attempt() == k
        assert not run.rollouts.exists() and not run.metrics.exists() and not run.evals.exists()
    assert run.attempt_files() == ["eval.attempt-1.json", "eval.attempt-2.json",
                                   "metrics.attempt-1.jsonl", "metrics.attempt-2.jsonl",
                                   "rollouts.attempt-1.h5", "rollouts.attempt-2.h5"]
    assert (tmp_path / "rollouts.attempt-2.h5").read_text() == "attempt 2"
    assert run.generators.read_text() == "kept"


def test_a_resume_keeps_the_metrics_and_evals_of_steps_it_does_not_train_again(tmp_path):
    run = RunDir(tmp_path)
    run.truncate_metrics(3)                                      # no file: nothing to do
    for step in range(6):
        run.append_metrics({"step": step, "loss": step / 10})
    run.truncate_metrics(3)
    assert [json.loads(x)["step"] for x in run.metrics.read_text().splitlines()] == [0, 1, 2]
    assert run.read_evals(up_to_step=3) == []
    evals = [{"label": "initial", "step": 0}, {"label": "step 2", "step": 2},
             {"label": "step 4", "step": 4}, {"label": "final", "step": 2}]
    run.write_evals(evals)
    assert run.read_evals(up_to_step=3) == evals[:2]
