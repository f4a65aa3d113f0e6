"""areal_hpc/train/mcore.py: Megatron imported with its torch.compile decorations deferred to the
first call, which then compiles with the same options, once."""
import subprocess
import sys
from pathlib import Path

import torch

from areal_hpc.train.mcore import deferred

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_call_compiles_with_the_options_once_and_every_call_runs_the_compiled_function():
    compiled = []

    def real(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    @deferred(real)
    def plain(x):
        return x + 1

    @deferred(real)(dynamic=False)
    def with_options(x, y=0):
        """doc"""
        return x * y

    assert compiled == [] and plain.__name__ == "plain" and with_options.__doc__ == "doc"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(2, y=3) == ("compiled", 6)
    assert compiled == [("plain", {}), ("with_options", {"dynamic": False})]


def test_the_real_compile_gives_the_eager_result():
    fn = deferred(torch.compile)(lambda x: torch.nn.functional.gelu(x) * 2, backend="eager")
    x = torch.linspace(-2, 2, 9)
    assert torch.equal(fn(x), torch.nn.functional.gelu(x) * 2)


def test_a_trainer_rank_imports_megatron_without_inductor_and_keeps_deferring():
    code = ("import sys, torch\n"
            "from areal_hpc.train import trainer  # noqa: F401\n"
            "from megatron.core import jit\n"
            "from areal_hpc.train import mcore\n"
            "print('torch._inductor.compile_fx' in sys.modules, torch.compile is mcore._real,\n"
            "      jit.jit_fuser.__qualname__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "deferred.<locals>.compile"], out.stdout
