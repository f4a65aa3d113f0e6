"""RunDir: the run directory's file names and its housekeeping across attempts."""
import ast
import json
import re
from pathlib import Path

import pytest

from areal_hpc.storage.checkpoint import step_dir
from areal_hpc.storage.run_dir import RunDir, RunFileError
from areal_hpc.transport.messages import GeneratorStats
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


def test_a_diagnostic_with_nothing_to_measure_is_written_as_null(tmp_path):
    """NaN (a step with no forward pass) and inf go to metrics.jsonl as null: standard JSON
    that every reader takes, never a NaN token; a resume's rewrite keeps them null."""
    run = RunDir(tmp_path)
    run.append_metrics({"step": 0, "ess": float("nan"), "loss": float("inf"), "reward": 0.5})
    run.append_metrics({"step": 1, "ess": 0.9})
    assert "NaN" not in run.metrics.read_text() and "Infinity" not in run.metrics.read_text()
    assert run.read_metrics()[0] == {"step": 0, "ess": None, "loss": None, "reward": 0.5}
    run.truncate_metrics(1)
    assert json.loads(run.metrics.read_text()) == {"step": 0, "ess": None, "loss": None, "reward": 0.5}


def test_metrics_are_read_here_with_the_bad_line_named(tmp_path):
    run = RunDir(tmp_path)
    assert run.metrics_records() == [] and run.metrics_by_step() == {}
    run.metrics.write_text('{"step": 0, "loss": 1}\n\n{"step": 1, "loss": 2}\n{"step": 1, "loss": 3}\n')
    assert run.metrics_records() == [(1, {"step": 0, "loss": 1}), (3, {"step": 1, "loss": 2}),
                                     (4, {"step": 1, "loss": 3})]
    assert run.metrics_by_step()[1]["loss"] == 3                # the last line of a step wins
    for text, where in (('{"step": 0}\n{"step": 1, "los', ":2: not a JSON line"),
                        ('{"step": 0}\n[1, 2]\n', ":2: not a metrics record"),
                        ('{"step": -1}\n', ":1: not a metrics record"),
                        ('{"step": true}\n', ":1: not a metrics record")):
        run.metrics.write_text(text)
        with pytest.raises(RunFileError, match=re.escape(str(run.metrics) + where)):
            run.read_metrics()
    run.metrics.write_bytes(b"\xff\xfe")
    with pytest.raises(RunFileError, match="unreadable"):
        run.read_metrics()


def test_generator_stats_round_trip_and_older_files_read(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_generators() == []
    st = [GeneratorStats(rank=r, tokens=10 * r, seconds={"busy": 1.0, "idle": 1.0}, version=2,
                         reward={"calls": 3}, engine_s=0.5) for r in (1, 2)]
    run.write_generators(st)
    assert run.read_generators() == st
    # a file from before stale_aborted and engine_s were recorded
    run.generators.write_text(json.dumps([{"rank": 1, "tokens": 5, "seconds": {"busy": 1.0},
                                           "version": 0, "reward": {}}]))
    assert run.read_generators()[0].engine_s == 0.0
    for bad in ('{"rank": 1}', '[{"rank": 1}]', '[{"rank": 1, "tokens": 5, "seconds": {}, '
                '"version": 0, "reward": {}, "surprise": 1}]', "[1, "):
        run.generators.write_text(bad)
        with pytest.raises(RunFileError, match=re.escape(str(run.generators)) + ": not a readable"):
            run.read_generators()


def _path_uses(tree: ast.AST, names: set[str], consts: set[str]) -> list[int]:
    """Lines where code builds a path to one of the files (`x / "metrics.jsonl"`, open("…")) or
    takes run_dir's name constant for it."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if any(isinstance(s, ast.Constant) and s.value in consts for s in (node.left, node.right)):
                hits.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
            if node.args and isinstance(node.args[0], ast.Constant) and \
                    any(c in str(node.args[0].value) for c in consts):
                hits.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            hits.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
            hits.append(node.lineno)
    return hits


def test_the_run_files_have_one_reader_and_one_writer():
    """metrics.jsonl, eval.json and generators.json are opened in storage/run_dir.py only: the
    rest of the package (and the tools) ask RunDir."""
    root = Path(__file__).resolve().parents[2]
    names, consts = {"METRICS", "EVALS", "GENERATORS"}, {"metrics.jsonl", "eval.json", "generators.json"}
    found = {}
    for path in [*(root / "areal_hpc").rglob("*.py"), *(root / "tools").glob("*.py")]:
        if path.name == "run_dir.py" and path.parent.name == "storage":
            continue
        hits = _path_uses(ast.parse(path.read_text()), names, consts)
        if hits:
            found[str(path.relative_to(root))] = hits
    assert found == {}
    assert _path_uses(ast.parse('p = d / "metrics.jsonl"\nopen("eval.json")\nrun_files.GENERATORS'),
                      names, consts) == [1, 2, 3]         # the check sees each kind of use


# -- where the run directory is ------------------------------------------------------------------
def test_the_run_directory_is_its_own_folder_of_output_dir(tmp_path):
    import os

    from areal_hpc.storage.run_dir import place
    out = tmp_path / "runs"
    assert place(out, "r") == out / "r"                          # nothing there yet
    (out / "r" / "checkpoints").mkdir(parents=True)
    (out / "r" / "rollouts.h5").write_bytes(b"")
    assert place(out, "r") == out / "r"
    (tmp_path / "elsewhere").mkdir()
    (out / "away").symlink_to(tmp_path / "elsewhere")
    (out / "twin").symlink_to(out / "r")
    (out / "loop").symlink_to(out / "loop")
    os.mkfifo(out / "fifo")
    (out / "file").write_text("x")
    (out / "f" / "checkpoints").mkdir(parents=True)
    (out / "f" / "config.yaml").mkdir()
    os.mkfifo(out / "f" / "rollouts.h5")
    for name, match in (("away", r"away: resolves to .*elsewhere, not a folder of its own in output_dir"),
                        ("twin", r"twin: resolves to .*runs/r, not a folder of its own"),
                        ("loop", r"loop: does not resolve"),
                        ("fifo", r"fifo: a FIFO, not a directory"),
                        ("file", r"file: a regular file, not a directory"),
                        ("f", r"f/config\.yaml: a directory, not a regular file")):
        with pytest.raises(ValueError, match=match):
            place(out, name)
    (out / "f" / "config.yaml").rmdir()
    with pytest.raises(ValueError, match=r"f/rollouts\.h5: a FIFO, not a regular file"):
        place(out, "f")
    linked = tmp_path / "linked"
    linked.symlink_to(out)                                       # output_dir itself may be a link
    assert place(linked, "r") == linked / "r"
