from areal_hpc.rollout.staleness import StalenessBudget, staleness_of


def test_capacity_formula_by_hand():
    b = StalenessBudget(max_staleness=1, batch_prompts=4, max_concurrent=100)
    assert b.capacity() == (1 + 0 + 1) * 4          # 8 groups may start at version 0
    b.on_submitted(8)
    assert b.capacity() == 0
    for _ in range(8):
        b.on_accepted()
    assert (b.accepted, b.running, b.capacity()) == (8, 0, 0)
    b.on_version(1)                                   # one step consumed 4
    assert b.capacity() == 4


def test_concurrency_cap_and_rejection():
    b = StalenessBudget(max_staleness=10, batch_prompts=4, max_concurrent=3)
    assert b.capacity() == 3
    b.on_submitted(3)
    b.on_rejected()
    assert b.capacity() == 1 and b.accepted == 0


def test_simulated_staleness_never_exceeds_eta():
    """FIFO consumption: every group is trained at most η versions after its submission."""
    for eta in (0, 1, 2, 4):
        B = 3
        b = StalenessBudget(max_staleness=eta, batch_prompts=B, max_concurrent=50)
        queue, ready, worst = [], [], 0
        for _ in range(40):
            for _ in range(max(b.capacity(), 0)):
                b.on_submitted()
                queue.append(b.version)
            while queue:                      # generation finishes in submission order
                ready.append(queue.pop(0))
                b.on_accepted()
            batch, ready = ready[:B], ready[B:]
            worst = max([worst] + [b.version - v for v in batch])
            b.on_version(b.version + 1)
        assert worst == eta


def test_dropped_group_frees_its_slot():
    b = StalenessBudget(max_staleness=0, batch_prompts=2, max_concurrent=10)
    b.on_submitted(2)
    b.on_accepted()
    b.on_accepted()
    assert b.capacity() == 0
    b.on_dropped()
    assert (b.accepted, b.capacity()) == (1, 1)


def test_recovery_and_staleness_of():
    b = StalenessBudget(max_staleness=2, batch_prompts=8, max_concurrent=64)
    b.on_recovered(5)
    assert (b.accepted, b.running, b.capacity()) == (40, 0, 24)
    assert staleness_of(7, [5, 5, 6, 7]) == 2
    assert staleness_of(7, []) == 0
