"""The Python tool's cost per cell: the live interpreter per episode (env/interpreter.py) against
the replay it replaced (a fresh sandbox per turn that first reran every earlier block, kept here
as the baseline), side by side and interleaved, over 8-turn episodes; two kinds of cell: trivial,
and ~22 ms of CPU each. Results: BENCHMARKS.md "The Python tool".

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_python_tool.py [repeats, default 3]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_hpc.env.python_tool import PythonTool  # noqa: E402
from areal_hpc.reward.sandbox import Sandbox  # noqa: E402

_REPLAY = '''import contextlib as _c, io as _io, sys as _s
_g = {"__name__": "__main__"}
with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):
    for _b in %r:
        try:
            exec(compile(_b, "<earlier cell>", "exec"), _g)
        except BaseException:
            pass
exec(compile(%r, "<cell>", "exec"), _g)
'''
def program(blocks):
    return blocks[-1] if len(blocks) == 1 else _REPLAY % (blocks[:-1], blocks[-1])

TURNS, REPEATS = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 3
KINDS = {"trivial": lambda n: f"x{n} = {n}\nprint(x{n})",
         "work": lambda n: f"import math\nx{n} = sum(math.sqrt(i) for i in range(300000))\nprint(round(x{n}))"}

def old_episode(cells):
    blocks, per = [], []
    for c in cells:
        blocks.append(c)
        t = time.perf_counter()
        res = Sandbox().run(program(blocks), b"", timeout_s=60, memory_mb=512)
        per.append(time.perf_counter() - t)
        assert res.ok, res
    return per

def live_episode(cells):
    env = PythonTool(timeout_s=60)
    env.reset({"question": "q", "answer": "1"})
    per = []
    for c in cells:
        t = time.perf_counter()
        s = env.step(f"```python\n{c}\n```", [1])
        per.append(time.perf_counter() - t)
        assert s.tool.error is None, s
    env.close()
    return per

Sandbox.available()
for kind, make in KINDS.items():
    cells = [make(n) for n in range(TURNS)]
    old, live = [], []
    for _ in range(REPEATS):            # interleaved: the same load on both
        old.append(old_episode(cells))
        live.append(live_episode(cells))
    o = [statistics.median(r[i] for r in old) for i in range(TURNS)]
    v = [statistics.median(r[i] for r in live) for i in range(TURNS)]
    print(f"{kind}: per-turn median seconds over {REPEATS} episodes")
    print("  turn   " + " ".join(f"{i+1:>7}" for i in range(TURNS)))
    print("  replay " + " ".join(f"{x:7.3f}" for x in o))
    print("  live   " + " ".join(f"{x:7.3f}" for x in v))
    print(f"  episode total: replay {sum(o):.3f} s, live {sum(v):.3f} s, ratio {sum(o)/sum(v):.1f}x; "
          f"per cell: replay {sum(o)/TURNS*1000:.0f} ms, live {sum(v)/TURNS*1000:.0f} ms "
          f"(live, turns 2-8: {sum(v[1:])/(TURNS-1)*1000:.1f} ms)")
