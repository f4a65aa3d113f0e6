"""Run under `mpiexec -n 2 python -m mpi4py tests/rollout/controller_worker.py OUT_DIR`.

Rank 0 is the real `Controller` (the trainer's side, without a model: each "step" takes a batch,
marks it trained and announces new weights); rank 1 a fake generator that answers every message
at once: each prompt's group of n samples with every token of the version it last loaded, rewards
alternating so that every group carries a signal, acknowledgements for weights, an evaluation's
results, its statistics at the Stop. Rank 0 checks what the controller did and writes
OUT_DIR/report.json."""
import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from areal_hpc.config import load
from areal_hpc.random_models import qwen_byte_tokenizer
from areal_hpc.rollout.controller import Controller
from areal_hpc.rollout.gen_clock import BUCKETS
from areal_hpc.storage.rollout_log import RolloutReader
from areal_hpc.topology import Topology
from areal_hpc.transport import messages as msgs
from areal_hpc.transport.mpi import Channel

STEPS, B, N, ETA = 4, 2, 3, 1
OUT = Path(sys.argv[1])


def config():
    return load(Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml",
                [f"output_dir={OUT}", "name=ctrl", f"train.total_steps={STEPS}",
                 f"train.batch_prompts={B}", f"rollout.group_size={N}",
                 f"rollout.max_staleness={ETA}", "rollout.max_concurrent_prompts=4",
                 "rollout.heartbeat_s=0.5"])


def fake_generator(topo: Topology) -> None:
    chan, version, stats_sent = Channel(topo.world), 0, False
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + 120
    while not stats_sent and time.monotonic() < deadline:
        got = chan.poll()
        for _, tag, msg in got:
            match msgs.check(tag, msg):
                case msgs.Prompts(prompts=prompts):
                    for p in prompts:
                        group = []
                        for k in range(p.n):
                            n_out = int(rng.integers(1, 6))
                            group.append(dict(
                                prompt_id=p.prompt_id, sample_idx=k,
                                prompt_tokens=np.asarray(p.prompt_tokens, np.int32),
                                output_tokens=rng.integers(0, 255, n_out).astype(np.int32),
                                behav_logprobs=-rng.random(n_out).astype(np.float32),
                                versions=np.full(n_out, version, np.int32),
                                reward=float(k % 2), finish_reason="stop",
                                generator_rank=topo.rank, t_submit=time.time(),
                                t_first_token=time.time(), t_end=time.time(), reward_error="",
                                reward_extra={}))
                        msgs.post(chan, msgs.Group(group), 0)
                case msgs.WeightsNotice(version=v):
                    msgs.post(chan, msgs.WeightsAck(v, "started"), 0)
                    version = v
                    msgs.post(chan, msgs.WeightsAck(v, "loaded", paused_s=0.0), 0)
                case msgs.EvalRequest(prompts=prompts):
                    msgs.post(chan, msgs.EvalResult(version, [
                        {"prompt_id": p.prompt_id, "rewards": [1.0] * p.n} for p in prompts], 0.0), 0)
                case msgs.Stop():
                    seconds = dict.fromkeys(BUCKETS, 0.0) | {"busy": 1.0}
                    msgs.post(chan, msgs.GeneratorStats(topo.rank, 0, seconds, version,
                                                        {"calls": 0, "errors": 0, "timeouts": 0}), 0)
                    stats_sent = True
        if not got:
            chan.idle(timeout=0.01)
    chan.flush(timeout=30)
    assert stats_sent, "the fake generator never got a Stop"


def controller(cfg, topo: Topology) -> dict:
    tok = qwen_byte_tokenizer(OUT / "tokenizer", eos=256, max_len=256)
    rows = [{"question": f"{i} + {i}", "reward_kind": "math", "reference": str(2 * i)}
            for i in range(10)]
    ctrl = Controller.start(cfg, topo, rows, tok)
    batches = []
    for step in range(STEPS):
        batch = ctrl.next_batch()
        trajs = batch.trajectories
        # B groups of N samples, group after group, each row the log row of its trajectory
        assert len(trajs) == len(batch.rows) == B * N, (len(trajs), len(batch.rows))
        pids = [t["prompt_id"] for t in trajs]
        assert all(len(set(pids[g * N:(g + 1) * N])) == 1 for g in range(B)), pids
        assert all(step - int(np.min(t["versions"])) <= ETA for t in trajs)     # η holds
        assert abs(batch.stats["reward"] - 1 / 3) < 1e-9 and batch.stats["staleness_max"] <= ETA, \
            batch.stats                                 # rewards 0, 1, 0 in every group
        ctrl.on_trained(batch.rows, step, step + 1)
        ctrl.send_weights_notice(step + 1, path=str(OUT / "weights"))
        ctrl.wait_weights_acks(step + 1, timeout_s=30)
        batches.append({"rows": batch.rows, "prompt_ids": sorted(set(pids)),
                        "stale": batch.stats["staleness_max"]})
    ctrl.request_eval(rows[:3], 2)
    ev = ctrl.eval_result()
    ctrl.stop()
    state = ctrl.state()
    state.check("the final state")
    ctrl.close()
    with RolloutReader(cfg.run_dir / "rollouts.h5") as r:
        consumed = r.column("consumed_step")
        log_pids = r.column("prompt_id")
    for step, b in enumerate(batches):              # each trained row marked with its step
        assert (consumed[b["rows"]] == step).all(), (step, consumed[b["rows"]])
        assert sorted(set(log_pids[b["rows"]].tolist())) == b["prompt_ids"]
    trained = [p for b in batches for p in b["prompt_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * B          # no prompt trained twice
    return {"batches": batches, "eval": ev, "state": state.as_lists(),
            "generators": sorted(ctrl.gen_stats), "log_rows": int(len(consumed))}


def main() -> None:
    cfg = config()
    topo = Topology.build(cfg.topology, MPI.COMM_WORLD)
    if topo.is_controller:
        report = controller(cfg, topo)
        (OUT / "report.json").write_text(json.dumps(report))
        print("controller OK", flush=True)
    else:
        fake_generator(topo)


if __name__ == "__main__":
    main()
