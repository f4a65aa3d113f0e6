"""The controller's checkpoint state (storage/run_state.py ControllerState): one writer in the
package (the ledger builds it), one reader (state.h5's `load`, which checks it), its fields named
nowhere else; and what it checks on load."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import h5py
import numpy as np
import pytest

from areal_hpc.storage.run_state import CheckpointError, ControllerState

ROOT = Path(__file__).resolve().parents[2]
# field names that are also metric keys or words of their own elsewhere ("version", ...)
GENERIC = {"version", "accepted", "rejected", "dropped_stale", "lost_stale"}


def _state(**changes) -> ControllerState:
    s = ControllerState(version=3, cursor_consumed=9, accepted=5, rejected=1, dropped_stale=0,
                        generated_tokens=400, rollout_rows=12,
                        buffer_rows=np.array([8, 9, 10, 11]), buffer_group_ends=np.array([2, 4]),
                        inflight_prompt_ids=np.array([7, 8]),
                        inflight_dataset_index=np.array([1, 2]),
                        partial_prompt_ids=np.array([8]), partial_first_row=np.array([6]),
                        partial_rows=np.array([2]), lost_stale=1)
    return s.replace(**changes)


def _round_trip(tmp_path, state: ControllerState) -> ControllerState:
    with h5py.File(tmp_path / "s.h5", "w") as f:
        state.save(f.create_group("controller"))
    with h5py.File(tmp_path / "s.h5", "r") as f:
        return ControllerState.load("s.h5", f["controller"])


def test_round_trip_and_groups(tmp_path):
    s = _state()
    back = _round_trip(tmp_path, s)
    assert back.as_lists() == s.as_lists()
    assert [g.tolist() for g in back.groups()] == [[8, 9], [10, 11]]
    old = _round_trip(tmp_path, _state(lost_stale=None, **{k: np.zeros(0, np.int64) for k in
                                                           ControllerState.PARTIAL}))
    assert old.lost_stale is None and len(old.partial_rows) == 0


@pytest.mark.parametrize("changes, reason", [
    ({"rollout_rows": 10}, "buffer_rows beyond its rollout_rows (10)"),
    ({"buffer_group_ends": np.array([3, 2])}, "do not cut buffer_rows"),
    ({"buffer_group_ends": np.array([2, 3])}, "do not cut buffer_rows"),
    ({"inflight_dataset_index": np.array([1])}, "differ in length"),
    ({"partial_prompt_ids": np.array([5])}, "prompts not in flight"),
    ({"partial_first_row": np.array([11])}, "rows beyond its rollout_rows"),
    ({"partial_rows": np.array([0])}, "partial groups"),
])
def test_load_refuses_a_state_that_breaks_an_invariant(tmp_path, changes, reason):
    with pytest.raises(CheckpointError, match="s.h5: controller") as exc:
        _round_trip(tmp_path, _state(**changes))
    assert reason in str(exc.value)


def test_load_refuses_wrong_types(tmp_path):
    with h5py.File(tmp_path / "s.h5", "w") as f:
        _state().save(f.create_group("controller"))
        del f["controller/partial_rows"]
    with h5py.File(tmp_path / "s.h5", "r") as f, \
            pytest.raises(CheckpointError, match="three arrays of one length"):
        ControllerState.load("s.h5", f["controller"])
    with h5py.File(tmp_path / "s.h5", "a") as f:
        del f["controller/buffer_rows"]
        f["controller"].create_dataset("buffer_rows", data=np.array([8.0, 9.0]))
    with h5py.File(tmp_path / "s.h5", "r") as f, \
            pytest.raises(CheckpointError, match="buffer_rows is not a 1-D integer array"):
        ControllerState.load("s.h5", f["controller"])


def _uses(path: Path, fields: set[str]) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Constant) and n.value in fields:
            out.append(f"{n.lineno}: {n.value!r}")
        if isinstance(n, ast.Call):
            name = getattr(n.func, "id", None) or getattr(n.func, "attr", None)
            if name == "ControllerState" or (name == "load" and "ControllerState" in
                                             ast.unparse(n.func)):
                out.append(f"{n.lineno}: {name}(")
    return out


def test_one_writer_one_reader_and_the_fields_named_once():
    """In the package, only run_state.py names the fields (as strings: save and load) and reads
    a state; only the ledger builds one. Everyone else uses the record's attributes."""
    fields = {f.name for f in dataclasses.fields(ControllerState)} - GENERIC
    found = {}
    for path in (ROOT / "areal_hpc").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel != "areal_hpc/storage/run_state.py" and (hits := _uses(path, fields)):
            found[rel] = hits
    assert [h.split(": ")[1] for h in found.pop("areal_hpc/rollout/ledger.py")] \
        == ["ControllerState("]
    assert found == {}
    assert _uses(ROOT / "tests/storage/test_run_state.py", {"buffer_rows"})   # the check sees
