"""python -m areal_hpc.analysis.regenerate: the comparison and the inputs it refuses (the
regeneration itself, on a real run with vLLM: tests/e2e/test_repeat.py)."""
import numpy as np

from areal_hpc.analysis.regenerate import EXIT_BAD_INPUT, compare, first_segment, main


def test_compare_is_bit_for_bit_and_names_the_first_difference():
    t, lp = np.array([5, 6, 7, 8]), np.array([-0.5, -1.0, -0.25, -2.0], np.float32)
    assert compare(t, lp, t.copy(), lp.copy())["first_difference"] is None
    other = t.copy()
    other[2] = 9
    res = compare(t, lp, other, lp)
    assert res["first_difference"] == 2 and res["regenerated"][2] == 9
    nudged = lp.copy()
    nudged[1] = np.nextafter(nudged[1], np.float32(0))          # one ulp: not the same
    assert compare(t, lp, t, nudged)["first_difference"] == 1
    assert compare(t, lp, t[:3], lp[:3])["first_difference"] == 3    # ended early


def test_first_segment_stops_at_the_first_version_change():
    assert first_segment({"versions": np.array([2, 2, 3, 3])}) == (2, 2)
    assert first_segment({"versions": np.array([0, 0, 0])}) == (0, 3)


def test_refuses_what_it_cannot_regenerate(known_log, tmp_path, capsys):
    run = known_log.parent
    assert main([str(run), "0"]) == EXIT_BAD_INPUT                  # no config.yaml beside it
    assert "config.yaml: not found" in capsys.readouterr().err
    (run / "config.yaml").write_text(f"model:\n  path: {tmp_path}\ndata:\n  train_path: x\n")
    assert main([str(run), "99"]) == EXIT_BAD_INPUT
    assert "no row 99 (rows 0-9)" in capsys.readouterr().err
    assert main([str(run), "0"]) == EXIT_BAD_INPUT                  # logged without seeds
    assert "no sampling seed" in capsys.readouterr().err
    assert main([str(tmp_path / "absent"), "0"]) == EXIT_BAD_INPUT
    assert "rollouts.h5: not found" in capsys.readouterr().err
