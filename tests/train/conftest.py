import pytest
import torch
import torch.distributed as dist

from areal_hpc.topology import free_port


@pytest.fixture(scope="session")
def megatron_ws1():
    """Megatron's parallel state is process-global: initialise it once (tp = pp = 1)."""
    from megatron.core import parallel_state

    from areal_hpc.train.megatron_model import init_megatron_parallel

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1, "these tests expect a single-process default group"
    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(tp=1, pp=1, seed=0, backend="gloo")
