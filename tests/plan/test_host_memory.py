"""Host memory per node (areal_hpc/plan/host_memory.py): the terms, the 32B trainer node's pinned
memory worked out by hand, the preflight's refusal, and the recipes' `#SBATCH --mem` against the
plan. Pure logic, nothing started."""
import re
from pathlib import Path

import pytest

from areal_hpc import plan, preflight
from areal_hpc.config import ConfigError, load
from areal_hpc.launch.placement import sbatch_components
from areal_hpc.plan import host_memory as hm

ROOT = Path(__file__).resolve().parents[2]
CONFIG_32B = ROOT / "configs/qwen2_5_32b_math.yaml"
GPU_RECIPES = ["areal_32b.sh", "areal_7b.sh", "areal_1_5b.sh"]
GiB = 2**30


def test_a_nodes_terms_are_its_ranks_terms_added_up():
    cfg = load(CONFIG_32B)
    hp = hm.host_estimate(cfg)
    arch = plan.read_arch(cfg)
    stages = plan.trainer_estimates(cfg, arch)
    assert (hp.trainers_per_node, hp.generators_per_node) == (8, 1)
    assert [n.ranks for n in hp.trainer_nodes] == [8, 8, 8, 8]
    for k, node in enumerate(hp.trainer_nodes):
        ranks = [hm.trainer_rank_terms(cfg, arch, stages, r) for r in range(8 * k, 8 * k + 8)]
        for i, term in enumerate(node.terms):
            assert term.bytes == pytest.approx(sum(rt[i].bytes for rt in ranks))
        assert node.ranks_bytes == pytest.approx(sum(t.bytes for t in node.terms))
        assert node.total == pytest.approx(node.ranks_bytes * (1 + hm.HEADROOM))
        assert node.pinned == pytest.approx(node.term("step snapshot").bytes + node.term("checkpoint staging").bytes)
    # the controller lives on trainer rank 0 only
    assert hp.trainer_nodes[0].term("controller + rollout log").bytes > 0
    assert all(n.term("controller + rollout log").bytes == 0 for n in hp.trainer_nodes[1:])
    gen = hp.generator_node
    one = hm.generator_rank_terms(cfg, arch)
    assert [t.name for t in gen.terms] == [t.name for t in one]
    assert gen.ranks_bytes == pytest.approx(sum(t.bytes for t in one)) and gen.pinned == 0
    # the same config with 2 generators a node: twice the bytes
    two = hm.host_estimate(cfg, generators_per_node=2).generator_node
    assert two.ranks_bytes == pytest.approx(2 * gen.ranks_bytes)


def test_32b_trainer_nodes_pinned_bytes_worked_out_by_hand():
    """R1-Distill-Qwen-32B: h 5120, ffn 27648, 64 layers, 40 heads / 8 kv of 128, vocab 152064,
    untied; tp 2 x pp 8 x dp 2, bf16, distributed optimizer, mid_step_stop on.
    A layer's matmul parameters: qkv (40 + 2 x 8) x 128 = 7168 rows of 5120 + bias 7168, proj
    5120 x 5120, MLP 3 x 27648 x 5120 = 487,595,008, over tp 2 = 243,797,504, + 2 norms of 5120
    replicated = 243,807,744; 8 layers a stage = 1,950,461,952 parameters a rank; stage 0 also
    the embedding, 152064 x 5120 / 2 = 389,283,840: 2,339,745,792.
    Per rank, the snapshot is 2 (bf16) + 12 / dp (fp32 main + Adam m, v) = 8 B a parameter; the
    checkpoint stages the model (2 B) on dp rank 0 only and the optimizer shard (6 B) on both:
    8 B on dp rank 0, 6 B on dp rank 1. Node 0 holds ranks 0-7 (tp fastest, then dp, then pp):
    stage 0 on ranks 0-3 (two of them dp rank 0), stage 1 on 4-7: each stage 4 x 8 + 2 x 8 +
    2 x 6 = 60 B a parameter of a rank's shard. The issue's "~270 GB per 32B trainer node"."""
    per_layer = ((40 + 16) * 128 * 5120 + (40 + 16) * 128 + 5120 * 5120 + 3 * 27648 * 5120) // 2 + 2 * 5120
    assert per_layer == 243_807_744
    n_mid = 8 * per_layer
    n_first = n_mid + 152064 * 5120 // 2
    hp = hm.host_estimate(load(CONFIG_32B))
    node0, node1 = hp.trainer_nodes[:2]
    assert node0.pinned == pytest.approx(60 * (n_first + n_mid), abs=1)
    assert node1.pinned == pytest.approx(60 * 2 * n_mid, abs=1)     # stages 2 and 3
    assert node0.term("step snapshot").bytes == pytest.approx(32 * (n_first + n_mid), abs=1)
    assert 255e9 < node0.pinned < 260e9 and 235 * GiB < node0.pinned < 245 * GiB
    # without the mid-step stop only the checkpoint's staging is pinned
    no_stop = hm.host_estimate(load(CONFIG_32B, ["checkpoint.mid_step_stop=false"])).trainer_nodes[0]
    assert no_stop.pinned == pytest.approx(28 * (n_first + n_mid), abs=1)


def test_a_node_over_host_mem_is_refused_in_one_line_naming_the_term_and_keys(capsys):
    cfg = load(CONFIG_32B, ["topology.host_mem_gib=256"])
    hp = hm.host_estimate(cfg)
    worst = hp.worst(hm.TRAINER)
    assert worst is hp.trainer_nodes[0] and worst.total > 256 * GiB
    with pytest.raises(ConfigError) as err:
        hm.check_host_fits(cfg)
    line = str(err.value)
    assert "\n" not in line and line == hp.error()
    assert line == (f"trainer node 0 (ranks 0-7) needs {worst.total / GiB:.1f} GiB of host memory, over "
                    f"topology.host_mem_gib=256: step snapshot "
                    f"{worst.term('step snapshot').bytes / GiB:.1f} GiB (shrink with "
                    "checkpoint.mid_step_stop=false, topology.tp, topology.pp)")
    # without the snapshot the largest term is the checkpoint's staging
    line = hm.host_estimate(load(CONFIG_32B, ["topology.host_mem_gib=256", "checkpoint.mid_step_stop=false"])).error()
    assert ": checkpoint staging " in line and "topology.tp, topology.pp)" in line
    # the launchers' preflight refuses it before anything else is read (model.path is a placeholder)
    with pytest.raises(ConfigError, match=r"^trainer node 0 \(ranks 0-7\) needs .* topology\.host_mem_gib=256"):
        preflight.launcher(str(CONFIG_32B), ["topology.host_mem_gib=256"])
    # `plan memory`: both tables, then the one line, exit 2
    assert plan.main(["memory", str(CONFIG_32B), "topology.host_mem_gib=256"]) == 2
    out, err_text = capsys.readouterr()
    assert "host memory, trainer node" in out and "host memory, generator node" in out
    assert err_text.strip().splitlines() == [f"error: {hp.error()}"]
    # a node that holds it fits; 0 (the default) and CPU configs are not checked
    assert plan.main(["memory", str(CONFIG_32B), "topology.host_mem_gib=2048"]) == 0
    assert "fits in 2048 GiB of host memory per node" in capsys.readouterr().out
    hm.check_host_fits(load(CONFIG_32B))
    tiny = load(ROOT / "configs/tiny_cpu.yaml", ["topology.host_mem_gib=0.001"])
    hm.check_host_fits(tiny)       # models/tiny need not exist: nothing is read on CPU
    with pytest.raises(ConfigError, match=r"'topology\.host_mem_gib': must be >= 0"):
        load(CONFIG_32B, ["topology.host_mem_gib=-1"])


def test_generator_terms_follow_their_keys():
    base = load(CONFIG_32B)
    arch = plan.read_arch(base)

    def term(cfg, name):
        return next(t.bytes for t in hm.generator_rank_terms(cfg, arch) if t.name == name)

    r = base.rollout
    window = (r.max_staleness + 1) * base.train.batch_prompts        # 2560 groups > 512 in flight
    in_flight = -(-min(r.max_concurrent_prompts, window) * r.group_size // base.topology.n_generators)
    assert term(base, "samples in flight") == in_flight * r.max_model_len * hm.INFLIGHT_TOKEN_BYTES
    assert term(base, "vLLM swap / CPU offload") == 0 and term(base, "weight load (disk mode)") == 0
    disk = load(CONFIG_32B, ["weights.mode=disk"])
    assert term(disk, "weight load (disk mode)") == 8 * 152064 * 5120 * 2     # each worker: the embedding
    assert term(load(CONFIG_32B, ["reward.workers=4"]), "reward workers") == 4 * hm.REWARD_WORKER_GIB * GiB
    env = load(CONFIG_32B, ["env.fn=calculator", "env.max_episodes=8", "env.memory_mb=1024"])
    assert term(env, "environment processes") == 8 * GiB
    # 8 vLLM workers with a CUDA context each, the engine core, the rank's process
    assert term(base, "process baseline") == pytest.approx(
        (hm.GENERATOR_PROCESS_GIB + hm.VLLM_PROCESS_GIB + 8 * (hm.VLLM_PROCESS_GIB + hm.CUDA_HOST_GIB)) * GiB)


def test_plan_memory_on_cpu_prints_no_host_table(tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}')
    args = ["memory", str(ROOT / "configs/tiny_cpu.yaml"), f"model.path={d}", "topology.host_mem_gib=0.001"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "host memory: planned for topology.device=cuda only" in out and "host memory, trainer" not in out
    assert hm.host_estimate(load(args[1], args[2:])).error() is None


def _mem_gib(value: str) -> float:
    """Slurm's --mem: a number with K, M (the default), G or T (powers of 1024), in GiB."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", value.upper())
    assert m, value
    return int(m.group(1)) * 1024 ** ("KMGT".index(m.group(2) or "M") + 1) / GiB


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_each_gpu_recipe_asks_at_least_the_planned_host_memory(name):
    """Each het component's --mem holds the plan's largest node of its role, at the recipe's
    own ranks a node; the recipe says where the number comes from."""
    text = (ROOT / "slurm" / name).read_text()
    config = re.search(r"slurm/job\.sh (configs/\S+\.yaml)", text).group(1)
    trainers, generators = sbatch_components(text)
    hp = hm.host_estimate(load(ROOT / config), int(trainers["ntasks-per-node"]),
                          int(generators["ntasks-per-node"]))
    for comp, role in ((trainers, hm.TRAINER), (generators, hm.GENERATOR)):
        assert "mem" in comp, f"{name}: no --mem for the {role} component"
        asked, planned = _mem_gib(comp["mem"]), hp.mem_gib(role)
        assert asked >= planned, f"{name}: {role} --mem={comp['mem']} < the plan's {planned}G"
        assert asked <= 1.5 * planned, f"{name}: {role} --mem={comp['mem']} far above the plan's {planned}G"
    assert f"python -m areal_hpc.plan memory\n#   {config}" in text and "areal_hpc/plan/host_memory.py" in text
