"""weight_publisher.join_gather: a TP peer drains the stage's gathering iterator to the end (every
gather is a collective its sender waits on) and counts what it gathered; on CUDA it also waits for
the device every bucket (not testable here: on CPU gloo's gathers are blocking)."""
import torch

from areal_hpc.train.weight_publisher import join_gather


def test_join_gather_drains_every_tensor_and_counts_bytes():
    taken = []

    def stage():
        for i in range(5):
            taken.append(i)
            yield f"w{i}", torch.zeros(10 * (i + 1), dtype=torch.bfloat16)

    assert join_gather(stage(), bound_bytes=32) == sum(20 * (i + 1) for i in range(5))
    assert taken == [0, 1, 2, 3, 4]
