"""Planning models of a run, without running it.

- `memory` (re-exported here, as the module `areal_hpc.plan` was before): the per-GPU memory
  model and the preflight `check_fits` every launcher calls.
- `throughput`: a discrete-event simulation of the asynchronous RL pipeline (generators, the
  controller's staleness bound, the trainer and its weight updates): steps/hour, busy and idle
  fractions, staleness, the async/sync speedup and a search over device splits and η.

    python -m areal_hpc.plan memory CONFIG [key=value ...] [--gpu-mem 80GiB]
    python -m areal_hpc.plan throughput CONFIG [key=value ...] [--from-run DIR] [--search]
"""
from __future__ import annotations

from .memory import (  # noqa: F401  (the API of `areal_hpc.plan` before the package split)
    Arch, Plan, RankEstimate, Term, check_fits, estimate, generator_estimate,
    kv_bytes_per_token, layer_activation_bytes, mask_score_bytes, model_config_path,
    read_arch, trainer_estimates, varlen_kernel)
from .memory_cli import parse_mem, render  # noqa: F401


def __getattr__(name: str):
    # The CLI lives in __main__.py; imported lazily so `python -m areal_hpc.plan` does not find
    # it already imported (runpy would warn).
    if name == "main":
        from .__main__ import main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
