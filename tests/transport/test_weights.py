"""Bucket layout (pure), the two-in-flight sender and prefetching receiver against a fake group,
and gloo round trips of the bucketed weight broadcast."""

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

from areal_hpc.transport.rendezvous import free_port
from areal_hpc.transport.messages import WeightsAck
from areal_hpc.transport.weights import (
    AckTracker,
    WeightGroupAddress,
    WeightSyncError,
    bucket_dtype,
    bucket_numel,
    dtype_from_str,
    dtype_to_str,
    plan_buckets,
    plan_bytes,
    plan_stages,
)

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

# Spawned children unpickle their targets by module name (`tests.transport.test_weights` under
# --import-mode=importlib), which needs the repo root on the sys.path they inherit; the
# `.venv/bin/pytest` entry point does not put it there (`python -m pytest` does).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def names(buckets):
    return [[name for name, _, _ in b] for b in buckets]


def test_empty():
    assert plan_buckets([], 100) == []


def test_greedy_fill_in_input_order():
    specs = [(n, (4,), "float32") for n in "abcde"]  # 16 bytes each
    assert names(plan_buckets(specs, 32)) == [["a", "b"], ["c", "d"], ["e"]]
    assert names(plan_buckets(specs, 47)) == [["a", "b"], ["c", "d"], ["e"]]
    assert names(plan_buckets(specs, 48)) == [["a", "b", "c"], ["d", "e"]]
    assert names(plan_buckets(specs, 10**9)) == [["a", "b", "c", "d", "e"]]


def test_oversized_tensor_gets_its_own_bucket():
    specs = [("s1", (1,), "float32"), ("big", (4, 4), "float32"), ("s2", (1,), "float32")]
    assert names(plan_buckets(specs, 10)) == [["s1"], ["big"], ["s2"]]


def test_one_dtype_per_bucket_dtypes_in_first_appearance_order():
    specs = [
        ("a", (2, 2), "float32"),  # 16 B
        ("b", (4,), "bfloat16"),  # 8 B
        ("c", (3,), "float32"),  # 12 B
        ("d", (8,), "bfloat16"),  # 16 B
    ]
    assert names(plan_buckets(specs, 16)) == [["a"], ["c"], ["b"], ["d"]]
    assert names(plan_buckets(specs, 24)) == [["a"], ["c"], ["b", "d"]]
    assert names(plan_buckets(specs, 28)) == [["a", "c"], ["b", "d"]]


def test_normalised_specs():
    buckets = plan_buckets([("w", [2, 3], "torch.bfloat16"), ("s", [], "bfloat16")], 100)
    assert buckets == [[("w", (2, 3), "bfloat16"), ("s", (), "bfloat16")]]
    assert bucket_numel(buckets[0]) == 7  # a 0-d tensor is one element
    assert bucket_dtype(buckets[0]) == "bfloat16"


def test_invalid_input():
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("a", (1,), "float32"), ("a", (1,), "float32")], 8)
    with pytest.raises(ValueError, match="dtype"):
        plan_buckets([("a", (1,), "float42")], 8)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (1,), "float32")], 0)
    with pytest.raises(ValueError, match="one dtype"):
        bucket_dtype([("a", (1,), "float32"), ("b", (1,), "bfloat16")])


def test_realistic_model_partition():
    """Every tensor exactly once, caps respected, deterministic."""
    specs = []
    for i in range(3):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (64,), "float32"),
            (p + "self_attn.q_proj.weight", (64, 64), "bfloat16"),
            (p + "self_attn.q_proj.bias", (64,), "bfloat16"),
            (p + "mlp.down_proj.weight", (64, 128), "bfloat16"),
        ]
    specs.append(("lm_head.weight", (1000, 64), "bfloat16"))  # 128000 B > cap
    cap = 20_000
    buckets = plan_buckets(specs, cap)
    assert buckets == plan_buckets(list(specs), cap)
    flat = [s for b in buckets for s in b]
    assert sorted(flat) == sorted(specs)
    for b in buckets:
        nbytes = bucket_numel(b) * dtype_from_str(bucket_dtype(b)).itemsize
        assert nbytes <= cap or len(b) == 1
    # within a dtype the input order is kept (layer order bounds the receiver's memory)
    bf16 = [n for n, _, d in flat if d == "bfloat16"]
    assert bf16 == [n for n, _, d in specs if d == "bfloat16"]


def test_dtype_strings():
    assert dtype_to_str(torch.bfloat16) == "bfloat16"
    assert dtype_from_str("torch.float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_str("Tensor")


# ------------------------------------------------------------ against a fake group


class _LazyWire:
    """A weight group whose broadcast reads its buffer only when waited on, the latest moment
    a real backend may: a sender that refilled a buffer still in flight would send the wrong
    bytes. As a receiver's group it fills the buffer from `incoming` at that moment instead."""

    def __init__(self, incoming=None, fail_at_wait=None):
        self.incoming = list(incoming or [])
        self.fail_at_wait = fail_at_wait  # index of the wait that raises, like a timeout
        self.events = []  # ("post", k) / ("wait", k), in order
        self.arrived = []  # what each broadcast carried, in plan order
        self.sources = []  # data_ptr of each broadcast's tensor
        self.in_flight = self.max_in_flight = 0

    def broadcast(self, flat, root):
        k = len(self.sources)
        self.sources.append(flat.data_ptr())
        self.events.append(("post", k))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        wire = self

        class Work:
            def is_completed(self):     # the lazy wire completes when waited on
                return True

            def wait(self):
                wire.in_flight -= 1
                if k == wire.fail_at_wait:
                    raise TimeoutError("gloo: timed out")
                if wire.incoming:
                    flat.copy_(wire.incoming[k])
                wire.events.append(("wait", k))
                wire.arrived.append(flat.clone())

        return Work()


def _many_tensors():
    """Tensors for many buckets of several sizes: two dtypes, a 0-d one, non-contiguous ones,
    and two larger than the bucket cap (one contiguous: sent as it is; one transposed)."""
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i in range(6):
        sd[f"l{i}.w"] = torch.randn(3 + i, 4, generator=g)
        sd[f"l{i}.b"] = torch.randn(4 + 2 * i, generator=g).to(torch.bfloat16)
        sd[f"l{i}.t"] = torch.randn(5, 2 + i, generator=g).t()
    sd["scale"] = torch.tensor(2.5)
    sd["big"] = torch.randn(40, 8, generator=g)
    sd["big_t"] = torch.randn(8, 40, generator=g).t()
    return sd


def _unpack(plan, arrived):
    out = {}
    for (_, bucket), flat in zip(plan, arrived, strict=True):
        offset = 0
        for name, shape, _ in bucket:
            n = bucket_numel([(name, shape, "float32")])
            out[name] = flat[offset : offset + n].view(shape)
            offset += n
    return out


def _plan_of(sd, cap):
    return plan_stages([[(k, v.shape, dtype_to_str(v.dtype)) for k, v in sd.items()]], cap)


def test_sender_keeps_two_buckets_in_flight_and_never_overwrites_one():
    from areal_hpc.transport.weights import broadcast_stage

    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    assert len(plan) > 8 and len({bucket_numel(b) for _, b in plan}) > 3  # buffers must grow
    wire = _LazyWire()
    # produced in reverse order: the sender holds tensors until their bucket is due
    stats = broadcast_stage(wire, plan, 0, reversed(list(sd.items())), "cpu")
    assert wire.max_in_flight == 2
    assert stats.num_buckets == len(plan)
    assert stats.num_bytes == sum(v.numel() * v.element_size() for v in sd.values())
    got = _unpack(plan, wire.arrived)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # a contiguous tensor alone in its bucket goes on the wire as it is; a transposed one is packed
    index = {b[0][0]: k for k, (_, b) in enumerate(plan) if len(b) == 1}
    assert wire.sources[index["big"]] == sd["big"].data_ptr()
    assert wire.sources[index["big_t"]] != sd["big_t"].data_ptr()


def test_sender_other_stages_buckets_received_and_dropped():
    from areal_hpc.transport.weights import broadcast_stage

    sd = _many_tensors()
    names = list(sd)
    specs = [(k, sd[k].shape, dtype_to_str(sd[k].dtype)) for k in names]
    plan = plan_stages([specs[:7], specs[7:]], 96)
    wire = _LazyWire()
    stats = broadcast_stage(wire, plan, 1, [(k, sd[k]) for k in names[7:]], "cpu")
    assert stats.num_buckets == sum(root == 1 for root, _ in plan)
    assert len(wire.arrived) == len(plan) and wire.max_in_flight == 2
    got = _unpack(plan, wire.arrived)
    for k in names[7:]:
        assert torch.equal(got[k], sd[k]), k


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda sd: sd.update({"l2.w": sd["l2.w"][:-1]}), "l2.w: tensor is"),
        (lambda sd: sd.update({"big": sd["big"].double()}), "big: tensor is"),
        (lambda sd: sd.pop("l5.t"), "produced no tensor 'l5.t'"),
        (lambda sd: sd.update({"extra": torch.zeros(1)}), "outside the plan"),
    ],
)
def test_sender_plan_mismatch_is_a_value_error(change, match):
    from areal_hpc.transport.weights import broadcast_stage

    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    change(sd)
    with pytest.raises(ValueError, match=match):
        broadcast_stage(_LazyWire(), plan, 0, reversed(list(sd.items())), "cpu")


class _Worker:
    """What the receiver uses of vLLM's worker, with a reload that records when it sees each
    tensor and can fail (`fail_at`: the 1-based tensor; `stop_early`: return instead of raise)."""

    rank = 0
    device = torch.device("cpu")

    def __init__(self, wire, fail_at=None, stop_early=False):
        self._weight_group = wire
        self.fail_at, self.stop_early = fail_at, stop_early
        self.received = {}
        self.views = []     # held, as vLLM's layerwise reload holds them until a layer is whole

    def reload_weights(self, weights_iterator):
        for i, (name, t) in enumerate(weights_iterator, 1):
            if i == self.fail_at:
                if self.stop_early:
                    return
                raise KeyError("no such parameter")
            self._weight_group.events.append(("load", name))
            self.received[name] = t.clone()
            self.views.append(t)    # so no bucket's buffer is freed and its address reused


def _receiver_on(wire, plan, **kw):
    from areal_hpc.rollout.vllm_ext import WeightSyncExtension

    w = _Worker(wire, **kw)
    return w, WeightSyncExtension.recv_weights(w, plan)


def _incoming(plan, sd):
    out = []
    for _, bucket in plan:
        out.append(torch.cat([sd[name].reshape(-1) for name, _, _ in bucket]))
    return out


def test_receiver_posts_next_bucket_before_loading_this_one():
    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    wire = _LazyWire(_incoming(plan, sd))
    w, n = _receiver_on(wire, plan)
    assert n == len(sd) and wire.max_in_flight == 2
    for k, v in sd.items():
        assert torch.equal(w.received[k], v), k
    # bucket k+1 is on the wire before bucket k's first tensor is loaded
    for k, (_, bucket) in enumerate(plan[:-1]):
        first_load = wire.events.index(("load", bucket[0][0]))
        assert wire.events.index(("post", k + 1)) < first_load
        assert wire.events.index(("wait", k)) < first_load
    # a fresh buffer per bucket: vLLM may hold views of earlier ones
    assert len(set(wire.sources)) == len(plan)


@pytest.mark.parametrize("stop_early", [False, True])
@pytest.mark.parametrize("fail_at", [1, 9, 20])
def test_receiver_local_failure_drains_the_whole_plan(fail_at, stop_early):
    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    wire = _LazyWire(_incoming(plan, sd))
    expected = (RuntimeError, "stopped before the end") if stop_early else (KeyError, "no such")
    with pytest.raises(expected[0], match=expected[1]):
        _receiver_on(wire, plan, fail_at=fail_at, stop_early=stop_early)
    assert [e for e in wire.events if e[0] == "wait"] == [("wait", k) for k in range(len(plan))]
    assert wire.in_flight == 0


def test_receiver_wire_failure_is_raised_at_once():
    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    wire = _LazyWire(_incoming(plan, sd), fail_at_wait=3)
    with pytest.raises(TimeoutError):
        _receiver_on(wire, plan)
    posted = [k for e, k in wire.events if e == "post"]
    assert posted == [0, 1, 2, 3, 4]  # no drain: nothing posted after the failed wait


def test_tied_weights_found_by_parameter_identity():
    """The receiver's view of a tied LM head (reprocessed after every reload): the parameter
    that a later module holds too, by name; untied look-alikes are not tied."""
    from areal_hpc.rollout.vllm_ext import tied_weights

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(10, 4)
    model.model.norm = torch.nn.LayerNorm(4)
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    assert tied_weights(model) == {}
    model.lm_head.weight = model.model.embed_tokens.weight
    assert tied_weights(model) == {"model.embed_tokens.weight": ["lm_head.weight"]}


# ------------------------------------------------------------ gloo round trip


class _FakeWorker:
    """Stands in for vLLM's worker: what the extension uses of it (rank, device, reload_weights)."""

    rank = 0
    device = torch.device("cpu")

    def reload_weights(self, weights_iterator):
        self.received = {name: t.clone() for name, t in weights_iterator}


def _receiver(port, buckets, out_queue):
    from areal_hpc.rollout.vllm_ext import WeightSyncExtension

    class Worker(_FakeWorker, WeightSyncExtension):
        pass

    w = Worker()
    assert w.init_weight_group(WeightGroupAddress("127.0.0.1", port, 2, "gloo"), 1) == 1
    n = w.recv_weights([(0, b) for b in buckets])
    out_queue.put((n, _to_bytes(w.received)))


def _to_bytes(tensors: dict) -> bytes:
    """Tensors for a multiprocessing queue as plain bytes: a queued tensor is shared through a
    file descriptor that vanishes when the child exits before the parent has read it."""
    import io
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> dict:
    import io
    return torch.load(io.BytesIO(data))


def _state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(4, 6, generator=g).t(),  # non-contiguous on purpose
        "proj.bias": torch.randn(6, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(3.0),
    }


def test_broadcast_round_trip_gloo():
    from areal_hpc.transport.weights import broadcast_weights, init_sender_group

    sd = _state_dict()
    buckets = plan_buckets([(k, v.shape, dtype_to_str(v.dtype)) for k, v in sd.items()], 64)
    assert len(buckets) > 2
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, buckets, out))
    proc.start()
    try:
        group = init_sender_group(WeightGroupAddress("127.0.0.1", port, 2, "gloo", timeout_s=120))
        stats = broadcast_weights(group, sd, buckets)
        n, received = out.get(timeout=120)
        received = _from_bytes(received)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert n == len(sd) and stats.num_buckets == len(buckets)
    assert stats.num_bytes == sum(v.numel() * v.element_size() for v in sd.values())
    for k, v in sd.items():
        assert received[k].dtype == v.dtype and received[k].shape == v.shape
        assert torch.equal(received[k], v), k


class _FailingWorker(_FakeWorker):
    fail_at = 1  # the tensor (1-based) on which vLLM's loader fails

    def reload_weights(self, weights_iterator):
        for i, _ in enumerate(weights_iterator, 1):
            if i == self.fail_at:
                raise KeyError("no such parameter")


def _failing_receiver(port, buckets, out_queue, fail_at=1):
    from areal_hpc.rollout.vllm_ext import WeightSyncExtension

    class Worker(_FailingWorker, WeightSyncExtension):
        pass

    w = Worker()
    w.fail_at = fail_at
    w.init_weight_group(WeightGroupAddress("127.0.0.1", port, 2, "gloo"), 1)
    try:
        w.recv_weights([(0, b) for b in buckets])
    except KeyError as e:
        out_queue.put(repr(e))


@pytest.mark.parametrize("fail_at", [1, 9])
def test_receiver_error_does_not_hang_the_sender(fail_at):
    """A receiver that fails mid-update (with the next bucket already posted) still takes
    every bucket off the wire, so the sender finishes."""
    from areal_hpc.transport.weights import broadcast_weights, init_sender_group

    sd = _many_tensors()
    buckets = plan_buckets([(k, v.shape, dtype_to_str(v.dtype)) for k, v in sd.items()], 96)
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_failing_receiver, args=(port, buckets, out, fail_at))
    proc.start()
    try:
        group = init_sender_group(WeightGroupAddress("127.0.0.1", port, 2, "gloo", timeout_s=60))
        stats = broadcast_weights(group, sd, buckets)  # would block here without the drain
        assert "no such parameter" in out.get(timeout=60)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0 and stats.num_buckets == len(buckets)


# ------------------------------------------------------------ per-stage plan, handshake


def test_plan_stages_roots_and_order():
    s0 = [("embed", (8, 4), "float32"), ("l0.w", (4, 4), "float32")]  # 128 B, 64 B
    s1 = [("l1.w", (4, 4), "float32"), ("head", (8, 4), "float32")]
    plan = plan_stages([s0, s1], 128)
    assert [(root, [n for n, _, _ in b]) for root, b in plan] == [
        (0, ["embed"]), (0, ["l0.w"]), (1, ["l1.w"]), (1, ["head"])]
    assert plan_bytes(plan) == 384
    with pytest.raises(ValueError, match="repeats"):
        plan_stages([s0, s0], 128)


def test_ack_tracker_names_generators():
    acks = AckTracker({2: "n1", 3: "n2", 4: "n3"})
    acks.record(2, WeightsAck(5, "started"))
    acks.record(2, WeightsAck(5, "loaded", paused_s=0.1))
    acks.record(3, WeightsAck(5, "started"))
    assert not acks.complete(5)
    with pytest.raises(WeightSyncError) as e:
        acks.check(5, 12.0)
    msg = str(e.value)
    assert "version 5 failed after 12.0 s" in msg and "rank 2" not in msg
    assert "generator rank 3 (host n2) started loading but did not finish" in msg
    assert "generator rank 4 (host n3) never started loading" in msg
    acks.record(3, WeightsAck(5, "loaded"))
    acks.record(4, WeightsAck(5, "loaded"))
    assert acks.complete(5)
    acks.check(5, 1.0)  # no error
    with pytest.raises(WeightSyncError, match="TimeoutError: gloo"):
        acks.check(5, 1.0, cause=TimeoutError("gloo timed out\nmore"))


def test_ack_tracker_awaiting_answers_only_the_notice_after_it():
    """A generator whose engine was replaced (or whose load failed) says it waits for the
    version: the update is settled (to be sent again over a re-formed group) once every other
    generator runs it, but an "awaiting" from before the last notice answers nothing."""
    acks = AckTracker({2: "n1", 3: "n2"})
    acks.sent()
    acks.record(2, WeightsAck(5, "started"))
    acks.record(2, WeightsAck(5, "loaded"))
    acks.record(3, WeightsAck(5, "started"))
    assert not acks.settled(5) and not acks.complete(5)
    acks.record(3, WeightsAck(5, "awaiting"))
    assert acks.settled(5) and not acks.complete(5)
    with pytest.raises(WeightSyncError, match="rank 3 .host n2. waits for weights v5 again"):
        acks.check(5, 1.0)
    acks.sent()                                         # sent again: the old reply is stale
    assert not acks.settled(5) and not acks.complete(5)
    acks.record(3, WeightsAck(5, "started"))
    acks.record(3, WeightsAck(5, "loaded"))
    assert acks.complete(5) and not acks.settled(5) and not acks.awaiting


def _stage_sender(port, world, stage, plan, sd, out_queue):
    from areal_hpc.transport.weights import broadcast_stage, init_weight_group

    group = init_weight_group(WeightGroupAddress("127.0.0.1", port, world, "gloo", timeout_s=60), stage)
    mine = {n for root, b in plan if root == stage for n, _, _ in b}
    # produced in reverse order: the sender must hold tensors until their bucket is due
    tensors = [(k, v) for k, v in reversed(list(sd.items())) if k in mine]
    out_queue.put(("stats", stage, broadcast_stage(group, plan, stage, tensors, "cpu")))


def _plan_receiver(port, world, rank, plan, out_queue, stall_s=0.0):
    import time

    from areal_hpc.rollout.vllm_ext import WeightSyncExtension

    class Worker(_FakeWorker, WeightSyncExtension):
        pass

    w = Worker()
    w.init_weight_group(WeightGroupAddress("127.0.0.1", port, world, "gloo", timeout_s=8,
                                           join_timeout_s=120), rank)
    time.sleep(stall_s)  # a generator stuck elsewhere: it never enters the broadcast in time
    try:
        n = w.recv_weights(plan)
        out_queue.put(("ok", rank, n, _to_bytes(w.received)))
    except Exception as e:  # the wire's own timeout: raised at once, no drain
        out_queue.put(("error", rank, type(e).__name__, str(e)[:200]))


def test_two_stage_senders_round_trip_gloo():
    """PP=2: stage 0 and stage 1 each broadcast their own buckets; a receiver gets all."""
    sd = _state_dict()
    names = list(sd)
    specs = [(k, sd[k].shape, dtype_to_str(sd[k].dtype)) for k in names]
    plan = plan_stages([specs[:2], specs[2:]], 64)
    assert {root for root, _ in plan} == {0, 1}
    port, ctx = free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_stage_sender, args=(port, 3, 1, plan, sd, out)),
             ctx.Process(target=_plan_receiver, args=(port, 3, 2, plan, out))]
    for p in procs:
        p.start()
    try:
        _stage_sender(port, 3, 0, plan, sd, out)
        got = [out.get(timeout=120) for _ in range(3)]
    finally:
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    (recv,) = [g for g in got if g[0] == "ok"]
    assert recv[2] == len(sd)
    received = _from_bytes(recv[3])
    for k, v in sd.items():
        assert torch.equal(received[k], v), k
    stats = {g[1]: g[2] for g in got if g[0] == "stats"}
    assert stats[0].num_buckets + stats[1].num_buckets == len(plan)


def test_pipelined_round_trip_gloo_many_buckets():
    """Many buckets of several sizes and two dtypes, two in flight, to two receivers."""
    from areal_hpc.transport.weights import broadcast_stage, init_weight_group

    sd = _many_tensors()
    plan = _plan_of(sd, 96)
    assert len(plan) > 8
    port, ctx = free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_plan_receiver, args=(port, 3, r, plan, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = init_weight_group(WeightGroupAddress("127.0.0.1", port, 3, "gloo", timeout_s=60,
                                                     join_timeout_s=120), 0)
        # produced in reverse order: the sender holds tensors until their bucket is due
        stats = broadcast_stage(group, plan, 0, reversed(list(sd.items())), "cpu")
        got = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert stats.num_buckets == len(plan)
    for g in got:
        assert g[0] == "ok" and g[2] == len(sd), g[:3]
        received = _from_bytes(g[3])
        for k, v in sd.items():
            assert received[k].dtype == v.dtype and torch.equal(received[k], v), k


def test_stalled_receiver_times_out_everywhere():
    """One receiver never enters the broadcast: sender and the other receiver fail within the
    group timeout (8 s) instead of hanging, and every process exits."""
    import time

    sd = _state_dict()
    plan = plan_stages([[(k, v.shape, dtype_to_str(v.dtype)) for k, v in sd.items()]], 64)
    port, ctx = free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_plan_receiver, args=(port, 3, 1, plan, out)),
             ctx.Process(target=_plan_receiver, args=(port, 3, 2, plan, out, 60.0))]
    for p in procs:
        p.start()
    from areal_hpc.transport.weights import broadcast_stage, init_weight_group

    group = init_weight_group(WeightGroupAddress("127.0.0.1", port, 3, "gloo", timeout_s=8,
                                                 join_timeout_s=120), 0)
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        broadcast_stage(group, plan, 0, sd.items(), "cpu")
    waited = time.monotonic() - t0
    print(f"\nsender failed after {waited:.1f} s: {type(e.value).__name__}: {str(e.value)[:120]}")
    assert 4 < waited < 30
    first = out.get(timeout=60)
    assert first[:2] == ("error", 1), first
    procs[0].join(timeout=30)
    assert procs[0].exitcode == 0
    procs[1].kill()  # the stalled one (in the real job: mpiexec ends it when the trainer aborts)
    procs[1].join(timeout=30)
    assert not any(p.is_alive() for p in procs)
