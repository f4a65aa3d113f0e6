"""A rank of areal_hpc.main's start, run under mpiexec by tests/test_main.py: the config's input
paths are not checked (none exist), and with `placement` the placement verdict is the one given
(every rank gets it, as gather_and_check shares it); everything else is the real start."""
import sys

from areal_hpc import main, preflight

case, *overrides = sys.argv[1:]
preflight.check_inputs = lambda cfg: None
if case == "placement":
    verdict = ["n1: GPU 0 is given to rank 0 and rank 1", "n1: GPU 1 is given to rank 0 and rank 1"]
    preflight.gather_and_check = lambda *a, **k: (None, None, verdict)
sys.exit(main.main(["configs/tiny_cpu.yaml", "model.path=absent", *overrides]))
