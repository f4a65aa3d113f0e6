"""Run under `mpiexec -n 4 python -m mpi4py tests/train/shares_worker.py OUT_DIR`.

Four trainer ranks build Megatron's groups (gloo) for dp2 x tp2, then dp2 x pp2. For each layout
rank 0 splits a batch (`shares.split_batch`, as `Trainer._batch` does) and `GroupScatter` by
data-parallel rank hands each rank its share. Every rank checks its share against the split the
old trainer made on every rank from the whole batch (`old_share`: all ranks can build the batch
from its seed), and writes OUT_DIR/rank<R>.json with the bytes it received."""
import json
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from areal_hpc.algo.packing import balanced_allocate
from areal_hpc.algo.ppo import compute_advantages
from areal_hpc.config import TrainConfig
from areal_hpc.train.shares import split_batch
from areal_hpc.transport import mpi as coll

CFG = TrainConfig(ppo_minibatches=2, adv_norm="batch", prox="loglinear")
GROUP_SIZE = 4
BOUND = 120.0


def make_batch(seed: int = 0, groups: int = 16) -> list[dict]:
    """Trajectories as the controller hands them to the trainer (every field of the contract)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for pid in range(groups):
        prompt = rng.integers(0, 1000, rng.integers(20, 200)).astype(np.int32)
        for k in range(GROUP_SIZE):
            n = int(rng.integers(1, 400))
            seqs.append(dict(
                prompt_id=pid, sample_idx=k, prompt_tokens=prompt,
                output_tokens=rng.integers(0, 1000, n).astype(np.int32),
                behav_logprobs=-rng.random(n).astype(np.float32),
                versions=np.sort(rng.integers(0, 3, n)).astype(np.int32),
                reward=float(rng.integers(0, 2)), finish_reason="stop", generator_rank=4,
                t_submit=1.0, t_first_token=1.5, t_end=2.0, reward_error="", reward_extra={}))
    return seqs


def old_share(seqs: list[dict], dp: int, dp_rank: int) -> tuple[list[list[int]], np.ndarray]:
    """What the trainer computed on every rank before shares were sent: the advantages of the
    whole batch, and this data-parallel rank's indices per minibatch (Actor.plan_step then)."""
    lengths = [len(s["prompt_tokens"]) + len(s["output_tokens"]) for s in seqs]
    n_out = torch.tensor([len(s["output_tokens"]) for s in seqs])
    rewards = torch.tensor([float(s["reward"]) for s in seqs], dtype=torch.float64)
    adv = compute_advantages(rewards, n_out, GROUP_SIZE, CFG.reward_bias, CFG.reward_scaling,
                             CFG.reward_clip, CFG.reward_norm, CFG.adv_norm).numpy()
    out = []
    for mb_ids in balanced_allocate(lengths, sum(lengths), min_groups=CFG.ppo_minibatches):
        mb_lens = [lengths[i] for i in mb_ids]
        shares = balanced_allocate(mb_lens, max(sum(mb_lens), 1), min_groups=dp)
        out.append([mb_ids[j] for j in shares[dp_rank]])
    return out, adv


def main(out_dir: str) -> None:
    from megatron.core import parallel_state

    from areal_hpc.train.layout import ParallelLayout
    from areal_hpc.transport.rendezvous import free_port

    comm = MPI.COMM_WORLD.Dup()
    comm.Set_name("trainer ranks")
    me = comm.Get_rank()
    port = coll.bcast(comm, free_port() if me == 0 else None, timeout_s=BOUND)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me,
                            world_size=comm.Get_size())
    seqs = make_batch()
    report = {"whole_bytes": len(pickle.dumps(seqs, protocol=pickle.HIGHEST_PROTOCOL)),
              "limit": coll.MAX_MESSAGE_BYTES}
    for name, tp, pp in (("dp2xtp2", 2, 1), ("dp2xpp2", 1, 2)):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        layout = ParallelLayout.create(tp, pp, seed=0, backend="gloo")
        route = coll.GroupScatter(comm, layout.dp_rank, timeout_s=BOUND)
        parts = split_batch(seqs, CFG, GROUP_SIZE, layout.dp) if me == 0 else None
        before = coll.TRAFFIC.received_bytes
        share = route.scatter(parts, timeout_s=BOUND, what=f"the batch ({name})")
        received = coll.TRAFFIC.received_bytes - before
        ids, adv = old_share(seqs, layout.dp, layout.dp_rank)
        assert [len(m) for m in share.minibatches] == [len(m) for m in ids], name
        for mb, mb_ids in zip(share.minibatches, ids):
            for got, i in zip(mb, mb_ids):
                assert set(got) == {"prompt_tokens", "output_tokens", "behav_logprobs",
                                    "versions", "advantage"}, sorted(got)
                for key in ("prompt_tokens", "output_tokens", "behav_logprobs", "versions"):
                    assert np.array_equal(got[key], seqs[i][key]), (name, i, key)
                assert got["advantage"] == adv[i] and got["advantage"].dtype == adv.dtype
        rewards = np.array([s["reward"] for s in seqs])
        assert share.n_seqs == len(seqs) and share.reward_mean == float(rewards.mean())
        assert share.adv_abs_mean == float(np.abs(adv).mean())
        report[name] = dict(dp_rank=layout.dp_rank, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank,
                            received=received,
                            # on rank 0: the bytes of each data-parallel rank's share, as sent
                            part_bytes=[len(coll._dumps(p)) for p in parts] if me == 0 else None,
                            seq_ids=sorted(i for m in ids for i in m))
        route.free()
    with open(os.path.join(out_dir, f"rank{me}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    comm.Free()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
