"""TP, PP and DP layouts of the Actor (gloo processes) against the single-process reference.

Two decoupled-PPO steps of two minibatches each (π_prox recomputed, token-level advantage norm,
lr warm-up then decay), on micro-batches small enough that every layout packs several. Every
layout must give the reference's log-probs, losses and grad norms, and after the four optimizer
steps the same gathered weights.

Layouts run the default packed (varlen) attention; the references are computed both with it and
with the dense-mask attention (the exact reference), and every TP/PP layout must match both.
Sequence parallelism, full activation recompute and the distributed optimizer are layouts too.
"""

import pickle
from dataclasses import replace
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from areal_hpc.config import TrainConfig

CFG = TrainConfig(lr=1e-3, max_tokens_per_mb=40, ppo_minibatches=2, adv_norm="batch",
                  lr_warmup_steps=1, lr_decay_style="linear", total_steps=2)
ACTOR = dict(group_size=4, temperature=0.7)
WORKER = Path(__file__).with_name("dist_worker.py")
# Tolerances (fp32, gloo). Log-probs and the first loss see the same weights; the second step's
# loss and grad norm see weights that already differ by rounding. Weights: Adam moves each by
# about lr = 1e-3 per step however small its gradient, so rounding in near-zero gradients shows
# up to ~1e-5 after four steps; 1e-4 is a tenth of one step.
LOGPROB_ATOL, LOSS_REL, GRAD_NORM_REL, WEIGHT_ATOL = 1e-5, 1e-4, 1e-4, 1e-4


def batches(model_dir):
    """Two steps of 8 sequences (2 groups) with off-policy behaviour log-probs."""
    rng = np.random.default_rng(0)
    hf = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    steps = []
    for _ in range(2):
        seqs = []
        for i in range(8):
            prompt = rng.integers(0, 128, rng.integers(1, 10)).astype(np.int32)
            output = rng.integers(0, 128, rng.integers(1, 20)).astype(np.int32)
            ids = torch.from_numpy(np.concatenate([prompt, output]).astype(np.int64))[None]
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1] / ACTOR["temperature"]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].numpy()
            seqs.append(dict(prompt_tokens=prompt, output_tokens=output, reward=float(rng.integers(0, 2)),
                             behav_logprobs=(lp + rng.normal(0, 0.2, len(lp))).astype(np.float32),
                             versions=np.zeros(len(output), np.int32)))
        steps.append(seqs)
    return steps


def launch(run_distributed, world: int, cases: list[dict], work: Path) -> dict:
    """Run `cases` in one gloo world of `world` processes; {tag: [output of each rank]}."""
    with open(work / "in.pkl", "wb") as f:
        pickle.dump({"cases": cases, "cfg": CFG, "actor": ACTOR}, f)
    run_distributed(WORKER, world, work, mpi=False, timeout=900)
    return {c["tag"]: [pickle.loads((work / f"{c['tag']}.{r}.pkl").read_bytes()) for r in range(world)]
            for c in cases}


@pytest.fixture(scope="module")
def references(megatron_ws1, model_dir, tied_model_dir):
    """Single-process (TP = PP = DP = 1) runs, per model."""
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import run_case

    out = {}
    for d in (model_dir, tied_model_dir):
        steps = batches(d)
        out[d] = (steps, run_case(d, 1, 1, CFG, ACTOR, steps))
    steps = out[model_dir][0]
    out["mask"] = (steps, run_case(model_dir, 1, 1, replace(CFG, attention="mask"), ACTOR, steps))
    return out


def test_varlen_equals_mask_single_process(references, model_dir):
    """TP1: packed attention gives the dense-mask path's log-probs, losses, grads and weights."""
    check_layout([references[model_dir][1]], references["mask"][1], model_dir)


def check_layout(ranks: list[dict], ref: dict, model_dir: str) -> None:
    hf_initial = Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()
    rank0 = ranks[0]  # dp = tp = pp = 0: holds the whole model
    assert set(rank0["initial"]) == set(ref["initial"])
    for name, tensor in rank0["initial"].items():
        assert torch.equal(tensor, hf_initial[name]), name
    for out in ranks:  # every rank: the reference's log-probs and statistics
        for a, b in zip(out["logprobs"], ref["logprobs"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROB_ATOL)
        for got, want in zip(out["stats"], ref["stats"], strict=True):
            assert got["n_tokens"] == want["n_tokens"]
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_REL, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_NORM_REL)
            assert got["clip_frac"] == pytest.approx(want["clip_frac"], abs=1e-6)
            assert got["lr"] == want["lr"]
    assert set(rank0["trained"]) == set(ref["trained"])
    for name, tensor in rank0["trained"].items():
        torch.testing.assert_close(tensor, ref["trained"][name], rtol=0, atol=WEIGHT_ATOL)


def case(tag, tp, pp, model_dir, references, **train):
    return dict(tag=tag, tp=tp, pp=pp, model_dir=model_dir, batches=references[model_dir][0], train=train)


def test_two_processes_tp2_pp2_dp2(references, model_dir, tied_model_dir, tmp_path, run_distributed):
    """One 2-process world, four layouts in turn: TP=2, PP=2, DP=2, and PP=2 with tied embeddings."""
    cases = [case("tp2", 2, 1, model_dir, references), case("pp2", 1, 2, model_dir, references),
             case("dp2", 1, 1, model_dir, references), case("pp2_tied", 1, 2, tied_model_dir, references),
             case("tp2_sp", 2, 1, model_dir, references, sequence_parallel=True),
             case("tp2_recompute", 2, 1, model_dir, references, recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=1),
             case("dp2_distopt", 1, 1, model_dir, references, distributed_optimizer=True)]
    outs = launch(run_distributed, 2, cases, tmp_path)
    for c in cases:
        check_layout(outs[c["tag"]], references[c["model_dir"]][1], c["model_dir"])
    for tag in ("tp2", "pp2", "tp2_sp"):  # packed attention at TP2 / PP2 equals the mask path
        check_layout(outs[tag], references["mask"][1], model_dir)
    features = {tag: outs[tag][0]["features"] for tag in outs}
    assert features["tp2"] == dict(sequence_parallel=False, recompute=None, distributed_optimizer=False,
                                   core_attention="PackedAttention")
    assert features["tp2_sp"]["sequence_parallel"] and features["tp2_recompute"]["recompute"] == "full"
    assert features["dp2_distopt"]["distributed_optimizer"]
    assert references["mask"][1]["features"]["core_attention"] == "DotProductAttention"
    assert [s["n_micro_batches"] % 2 for s in outs["pp2"][0]["stats"]] == [0, 0]  # a multiple of pp


def test_dp2_steps_alike_when_one_rank_has_no_signal(references, model_dir, tmp_path,
                                                     run_distributed):
    """The no-signal rule is decided on the all-reduced count: in every minibatch the sequences
    of data-parallel rank 1 have advantage 0 and rank 0's do not. Both ranks must make the
    optimizer step (their all-reduced gradients are equal), ending with the single process's
    weights; a rank deciding on its own share alone would skip it and drift apart."""
    from areal_hpc.train.shares import dp_split, sequence_lengths
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import run_case

    train = dict(reward_norm="none", adv_norm="none")
    steps = [[dict(s) for s in seqs] for seqs in references[model_dir][0]]
    for seqs in steps:
        rank0, rank1 = dp_split(sequence_lengths(seqs), CFG.ppo_minibatches, 2)
        for k, i in enumerate(i for mb in rank0 for i in mb):
            seqs[i]["reward"] = (1.0, -1.0)[k % 2]
        for i in (i for mb in rank1 for i in mb):
            seqs[i]["reward"] = 0.0
        assert all(rank0) and all(rank1)
    ref = run_case(model_dir, 1, 1, replace(CFG, **train), ACTOR, steps)
    assert all(st["no_signal_minibatches"] == 0 for st in ref["stats"])
    c = dict(tag="dp2_half", tp=1, pp=1, model_dir=model_dir, batches=steps, train=train)
    ranks = launch(run_distributed, 2, [c], tmp_path)["dp2_half"]
    check_layout(ranks, ref, model_dir)
    for name, tensor in ranks[1]["trained"].items():     # the other replica too
        torch.testing.assert_close(tensor, ref["trained"][name], rtol=0, atol=WEIGHT_ATOL)
    assert all(st["no_signal_minibatches"] == 0 for out in ranks for st in out["stats"])


def test_four_processes_tp2xpp2_and_pp2xdp2(references, model_dir, tmp_path, run_distributed):
    cases = [case("tp2pp2", 2, 2, model_dir, references), case("pp2dp2", 1, 2, model_dir, references)]
    outs = launch(run_distributed, 4, cases, tmp_path)
    for c in cases:
        check_layout(outs[c["tag"]], references[model_dir][1], model_dir)
    # equal micro-batch counts on both data-parallel ranks (global ranks 0 and 1), a multiple of pp
    counts = [[s["n_micro_batches"] for s in out["stats"]] for out in outs["pp2dp2"]]
    assert counts[0] == counts[1] and all(n % 2 == 0 for n in counts[0])
