"""One process of the distributed Actor tests: a gloo world that runs several layouts in turn.

    python tests/train/dist_worker.py RANK WORLD_SIZE PORT WORKDIR

WORKDIR/in.pkl holds `{"cases": [{"tag", "tp", "pp", "model_dir", "batches"[, "train"]}, ...], "cfg":
TrainConfig, "actor": Actor keyword arguments}`, `batches` being [seqs of step 0, of step 1, ...]
and `train` optional TrainConfig fields that this case overrides.
For each case Megatron's parallel state is rebuilt over the same world (dp = world / (tp * pp)),
and `run_case` writes WORKDIR/<tag>.<rank>.pkl. One launch serves several layouts: most of a
launch's time is importing Megatron.
"""

import dataclasses
import pickle
import sys

import torch
import torch.distributed as dist


def run_case(model_dir, tp, pp, cfg, actor_kw, batches) -> dict:
    """Initial weights, log-probs, per-step stats and trained weights of one layout (also the
    single-process reference of the tests)."""
    from areal_hpc.train.actor import Actor

    actor = Actor(cfg, model_dir, tp=tp, pp=pp, **actor_kw)
    out = {"initial": {k: v.clone() for k, v in actor.hf_state_dict().items()}}
    out["logprobs"] = actor.compute_logprobs(batches[0])
    out["stats"] = [actor.train_step(seqs, version) for version, seqs in enumerate(batches)]
    out["trained"] = actor.hf_state_dict()
    mc = actor.model.config
    out["features"] = dict(sequence_parallel=mc.sequence_parallel, recompute=mc.recompute_granularity,
                           distributed_optimizer=actor.optimizer.config.use_distributed_optimizer,
                           core_attention=type(actor.model.module.decoder.layers[0]
                                               .self_attention.core_attention).__name__)
    return out


def each_case():
    """Join the gloo world of `sys.argv` (RANK WORLD_SIZE PORT WORKDIR) and, for each case of
    WORKDIR/in.pkl, rebuild Megatron's parallel state for it; yields (case, spec, the path of
    this rank's output). Also used by export_worker.py."""
    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from areal_hpc.train.megatron_model import init_megatron_parallel

    with open(f"{work}/in.pkl", "rb") as f:
        spec = pickle.load(f)
    for case in spec["cases"]:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_megatron_parallel(case["tp"], case["pp"], seed=spec["cfg"].seed, backend="gloo")
        yield case, spec, f"{work}/{case['tag']}.{rank}.pkl"
    dist.destroy_process_group()


def main() -> None:
    for case, spec, out_path in each_case():
        cfg = dataclasses.replace(spec["cfg"], **case.get("train", {}))
        out = run_case(case["model_dir"], case["tp"], case["pp"], cfg, spec["actor"], case["batches"])
        with open(out_path, "wb") as f:
            pickle.dump(out, f)


if __name__ == "__main__":
    main()
