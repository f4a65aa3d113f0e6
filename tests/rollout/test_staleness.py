import threading

import pytest

from areal_hpc.rollout.ledger import PromptCursor
from areal_hpc.rollout.staleness import StaleGroups, StalenessManager, staleness_of


def test_initial_capacity_is_eta_plus_one_batches_capped_by_concurrency():
    assert StalenessManager(100, 4, 1).get_capacity(0) == (1 + 0 + 1) * 4
    assert StalenessManager(5, 4, 1).get_capacity(0) == 5
    assert StalenessManager(100, 4, 0).get_capacity(0) == 4          # η = 0: one batch at a time


def test_running_accepted_rejected_and_version_growth():
    m = StalenessManager(max_concurrent_rollouts=6, consumer_batch_size=4, max_staleness=1)
    for _ in range(6):
        m.on_rollout_submitted()
    assert m.get_capacity(0) == min(6 - 6, 8 - 6) == 0
    for _ in range(5):
        m.on_rollout_accepted()
    m.on_rollout_rejected()                          # frees its slot, does not count
    assert (m.running, m.accepted, m.rejected) == (0, 5, 1)
    assert m.get_capacity(0) == min(6, 8 - 5) == 3
    assert m.get_capacity(1) == min(6, 12 - 5) == 6
    assert m.get_capacity(2) == 6
    for _ in range(9):
        m.on_rollout_submitted()
    assert m.get_capacity(0) == min(6 - 9, 8 - 14) == -6           # may be negative


def test_dropped_rollout_frees_its_slot():
    m = StalenessManager(10, 2, 0)
    m.on_rollout_submitted()
    m.on_rollout_submitted()
    m.on_rollout_accepted()
    m.on_rollout_accepted()
    assert m.get_capacity(0) == 0
    m.on_rollout_dropped()
    assert (m.accepted, m.rejected, m.get_capacity(0)) == (1, 1, 1)


def test_window_is_capped_at_the_run_s_steps():
    m = StalenessManager(100, 4, max_staleness=2, total_batches=2)
    assert m.get_capacity(0) == 2 * 4               # not (2 + 0 + 1) * 4: step 3 never comes
    for _ in range(8):
        m.on_rollout_submitted()
        m.on_rollout_accepted()
    assert m.get_capacity(1) == 0                   # the last batch is out: nothing more
    m.on_rollout_dropped()                          # one of it dropped as too stale
    assert m.get_capacity(1) == 1                   # its replacement, and only that
    assert StalenessManager(100, 4, 1, total_batches=10).get_capacity(0) == 8   # cap not reached


def test_bad_arguments():
    with pytest.raises(ValueError):
        StalenessManager(0, 4, 1)
    with pytest.raises(ValueError):
        StalenessManager(4, 4, -1)
    with pytest.raises(ValueError):
        StalenessManager(4, 4, 1, total_batches=-1)


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_simulated_staleness_never_exceeds_eta(eta):
    """In-order completion: every group is trained at most η versions after its submission."""
    B, version = 3, 0
    m = StalenessManager(max_concurrent_rollouts=50, consumer_batch_size=B, max_staleness=eta)
    queue, ready, worst = [], [], 0
    for _ in range(40):
        for _ in range(max(m.get_capacity(version), 0)):
            m.on_rollout_submitted()
            queue.append(version)
        while queue:
            ready.append(queue.pop(0))
            m.on_rollout_accepted()
        batch, ready = ready[:B], ready[B:]
        worst = max([worst] + [version - v for v in batch])
        version += 1
    assert worst == eta


def test_thread_safety():
    m = StalenessManager(10**6, 10, 1)

    def work():
        for _ in range(2000):
            m.on_rollout_submitted()
            m.on_rollout_accepted()
            m.get_capacity(0)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (m.running, m.accepted) == (0, 16000)


def test_staleness_of():
    assert staleness_of(7, [5, 5, 6, 7]) == 2
    assert staleness_of(7, []) == 0


def _group(*versions):
    return [{"versions": list(v)} for v in versions]


def test_ready_buffer_drops_late_groups_and_serves_oldest_first():
    from areal_hpc.rollout.staleness import ReadyBuffer
    buf = ReadyBuffer()
    buf.add(_group([3, 3], [3, 4]), rows=[0, 1])     # oldest token: version 3
    buf.add(_group([1, 2], [2, 2]), rows=[2, 3])     # 1: a straggler, started long ago
    buf.add(_group([2, 3], [3]), rows=[4, 5])        # 2
    buf.add(_group([2], [2, 2]), rows=[6, 7])        # 2, arrived later
    stale = buf.drop_older_than(2)                   # version 3, η = 1
    assert [g.rows for g in stale] == [[2, 3]] and len(buf) == 3
    assert [g.rows for g in buf.take(2)] == [[4, 5], [6, 7]]   # oldest first, FIFO among equals
    assert [g.oldest_version for g in buf.take(5)] == [3] and len(buf) == 0


def test_reissue_gives_a_dropped_prompt_max_reissues_more_tries_then_counts_it_lost():
    s = StaleGroups("reissue", max_reissues=2)
    assert s.drops
    assert s.on_dropped(7) and s.on_dropped(7)          # two more tries
    assert not s.on_dropped(7) and s.lost == 1          # the third drop gives it up
    assert s.on_dropped(7) and s.lost == 1              # a fresh start after giving up
    s.on_trained(7)                                     # trained: its count is forgotten
    assert s.on_dropped(7) and s.on_dropped(7) and not s.on_dropped(7) and s.lost == 2
    assert s.on_dropped(8) and s.times == {8: 1}


def test_drop_and_keep_policies():
    d = StaleGroups("drop", max_reissues=5)
    assert d.drops and not d.on_dropped(1) and not d.on_dropped(2) and d.lost == 2
    assert not StaleGroups("keep", 0).drops
    with pytest.raises(ValueError):
        StaleGroups("sometimes", 1)
    with pytest.raises(ValueError):
        StaleGroups("reissue", -1)


def test_cursor_index_of_is_what_next_handed_out():
    """A reissued prompt id maps back to its dataset row, also ids from earlier epochs."""
    c = PromptCursor(5, seed=3)
    handed = [c.next() for _ in range(13)]
    assert sorted(handed[:5]) == list(range(5)) and sorted(handed[5:10]) == list(range(5))
    assert [PromptCursor(5, seed=3).index_of(i) for i in range(13)] == handed
    assert [c.index_of(i) for i in (12, 0, 7)] == [handed[12], handed[0], handed[7]]
    assert c.next() == PromptCursor(5, seed=3).index_of(13)
