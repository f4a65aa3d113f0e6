"""tools/bench_ab.py's pure parts: the per-pair ratios A/B, their median and the table."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_ab", ROOT / "tools" / "bench_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(scale: float) -> dict:
    return {"ok": True, "job_s": 100 * scale, "train_wall_s": 80 * scale, "gen_us_tok": 50 * scale,
            "engine_us_tok": 40 * scale, "trained_tok_s": 1000 / scale, "cpu_s": 150 * scale}


def test_ratios_are_a_over_b_per_pair_and_skip_failed_pairs():
    ab = _tool()
    pairs = [(_run(1.1), _run(1.0)), (_run(0.9), _run(1.0)), ({"ok": False, "job_s": 1.0, "cpu_s": 1.0},
                                                             _run(1.0))]
    r = ab.ratios(pairs)
    assert set(r) == set(ab.METRICS)
    assert [round(x, 6) for x in r["gen_us_tok"]] == [1.1, 0.9]
    assert [round(x, 6) for x in r["trained_tok_s"]] == [round(1 / 1.1, 6), round(1 / 0.9, 6)]


def test_table_has_a_row_per_run_the_ratios_and_the_median():
    ab = _tool()
    pairs = [(_run(1.2), _run(1.0)), (_run(1.0), _run(1.0)), (_run(1.1), _run(1.0))]
    text = ab.table(pairs, "head", "base")
    lines = text.splitlines()
    assert lines[0].startswith("| pair | run | job wall s")
    assert sum(1 for ln in lines if "| A head |" in ln) == 3
    assert sum(1 for ln in lines if "| A/B |" in ln) == 4          # 3 pairs + the median
    median = next(ln for ln in lines if ln.startswith("| median"))
    assert median.split(" | ")[2] == "**1.100**"                     # job wall: median of 1.2, 1.0, 1.1


def test_a_failed_run_is_marked_and_gives_no_ratio():
    ab = _tool()
    text = ab.table([({"ok": False, "job_s": 5.0, "cpu_s": 2.0}, _run(1.0))], "head", "base")
    assert "failed" in text
    assert "median" not in text
