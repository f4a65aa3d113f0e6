"""One process of the streamed-export tests: a gloo world that exports the policy in several layouts.

    python tests/train/export_worker.py RANK WORLD_SIZE PORT WORKDIR

WORKDIR/in.pkl holds `{"cases": [{"tag", "tp", "pp", "model_dir", "chunk_bytes"}, ...], "cfg":
TrainConfig}`. For each case (Megatron's parallel state rebuilt over the world, as in
dist_worker.py) an Actor is built from the HF model and `hf_export.export` writes WORKDIR/<tag>
(step 3) over a torch.distributed stand-in for the trainer communicator;
WORKDIR/<tag>.<rank>.pkl gets the stats the rank returned.
"""

import pickle


def main() -> None:
    from dist_worker import each_case  # beside this file
    from distopt_worker import GlooComm

    from areal_hpc.train.actor import Actor
    from areal_hpc.train.hf_export import export

    for case, spec, out_path in each_case():
        actor = Actor(spec["cfg"], case["model_dir"], tp=case["tp"], pp=case["pp"])
        stats = export(actor, out_path.rsplit("/", 1)[0] + "/" + case["tag"],
                       chunk_bytes=case["chunk_bytes"], step=3, comm=GlooComm(), timeout_s=300)
        with open(out_path, "wb") as f:
            pickle.dump(stats, f)


if __name__ == "__main__":
    main()
