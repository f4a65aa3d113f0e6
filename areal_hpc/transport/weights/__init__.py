"""Trainer → generator weight path: bucket plan, per-stage senders, disk fallback, handshake.

The weight group is {one sender per pipeline stage} ∪ {every vLLM worker of every generator}, a
stateless torch.distributed group (NCCL on GPU, gloo on CPU) beside Megatron's groups and vLLM's
own. Ranks: stage s's sender (the trainer rank with dp = tp = 0 on stage s) is rank s; generator
g's engine spans [pp + g * engine_tp, pp + (g + 1) * engine_tp). The receiver half lives inside
vLLM's worker (`areal_hpc.rollout.vllm_ext.WeightSyncExtension.recv_weights`).

The plan of an update is `[(root, bucket), ...]`: every stage's HF tensors, bucketed per stage
(`plan_buckets`), stage 0's buckets first; `root` is the sending stage. It is computed once per
run (shapes never change) and travels in the MPI weight notice. For each bucket, its stage's
sender packs the bucket's tensors, in order, into ONE flat buffer of the bucket's dtype and
broadcasts it; every other group member receives it (other stages' senders drop it) and cuts it
back into the named tensors. One collective per bucket keeps the latency of hundreds of small
tensors (norms, biases) out of the update; a sender holds at most about two buckets beyond its
own shards (`broadcast_stage` pulls tensors lazily from a TP-gathering iterator and packs bucket
k+1 while bucket k is on the wire; receivers load bucket k while bucket k+1 arrives), so no
process ever holds the model twice, and no stage funnels through another.

Bounded time: the group is created with a timeout that applies to its joining and to every
collective, and every member waits for each bucket on the host against it (`finish`: on NCCL a
work's `wait()` does not block the host, so a dead peer would otherwise hold the device until
the watchdog ends the process); past it the member aborts the group and raises `WireTimeout`,
and the update goes out again over the group's next generation. Generators acknowledge each
update over MPI (`AckTracker`), and a missing or wrong acknowledgement becomes a
`WeightSyncError` naming the generator rank and host.

The concerns live in their own modules, and everything is importable from here:

    plan.py       the pure plan: buckets per stage, dtypes, sizes
    broadcast.py  the weight group and a stage sender's broadcast
    disk.py       the disk fallback: versioned safetensors directories
    acks.py       the generators' acknowledgements, `WeightSyncError`

The trainer side of one update (who sends, who only gathers, who waits for acknowledgements) is
`areal_hpc.train.weight_publisher.WeightPublisher`.
"""

from .acks import AckTracker, WeightSyncError
from .broadcast import (BroadcastStats, WeightGroupAddress, WireTimeout, broadcast_stage,
                        broadcast_weights, close_weight_group, finish, init_sender_group,
                        init_weight_group)
from .disk import prune_versions, version_dir, write_stage
from .plan import (Bucket, Plan, TensorSpec, bucket_dtype, bucket_numel, dtype_from_str,
                   dtype_to_str, plan_buckets, plan_bytes, plan_stages, spec_numel)

__all__ = [
    "AckTracker", "WeightSyncError",
    "BroadcastStats", "broadcast_stage", "broadcast_weights", "close_weight_group",
    "finish", "init_sender_group", "WireTimeout",
    "init_weight_group", "WeightGroupAddress",
    "prune_versions", "version_dir", "write_stage",
    "Bucket", "Plan", "TensorSpec", "bucket_dtype", "bucket_numel", "dtype_from_str",
    "dtype_to_str", "plan_buckets", "plan_bytes", "plan_stages", "spec_numel",
]
