"""The weight publisher's notifier: rank 0's controller announces and collects acknowledgements,
every other rank is SILENT (no announcement, no wait); the rules without a job."""
from areal_hpc.config import WeightSyncConfig
from areal_hpc.rollout.controller import Controller
from areal_hpc.train.lead import Follower
from areal_hpc.train.weight_publisher import SILENT, WeightPublisher


class _Recorder:
    collects_acks = True

    def __init__(self):
        self.calls = []

    def regroup(self, force=False):
        return None

    def send_weights_notice(self, version, *, plan=None, path=None, generation=None):
        self.calls.append(("notice", version, path))

    def wait_weights_acks(self, version, timeout_s, cause=None):
        self.calls.append(("wait", version, timeout_s))
        return False


def _publisher(notifier):
    cfg = WeightSyncConfig(mode="broadcast", timeout_s=7.0, bucket_mb=1)
    return WeightPublisher(cfg, actor=None, comm=None, pp=1, collective_timeout_s=1.0,
                           weight_dir="w", notifier=notifier)


def test_the_silent_notifier_waits_for_nothing():
    assert _publisher(SILENT)._acknowledged(3, None) == (None, False, False)
    assert Follower.weight_notifier is SILENT and Controller.collects_acks is True


def test_rank_0_waits_for_the_acknowledgements_of_its_version():
    rec = _Recorder()
    assert _publisher(rec)._acknowledged(3, None) == (None, False, False)
    assert rec.calls == [("wait", 3, 7.0)]


class _Comm:
    """One trainer rank: bcast returns what it is given."""
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1


def test_an_update_a_generator_failed_in_is_sent_again_over_a_reformed_group(monkeypatch):
    """Rank 0's notifier says the generators settled with one waiting (its engine failed in
    the update): the version goes out again, the group's next generation formed first; two
    failures more than SENDS allows end the job naming it."""
    from areal_hpc.train import weight_publisher as wp

    class Notifier(_Recorder):
        def __init__(self, waits):
            super().__init__()
            self.waits, self.generation = waits, 0

        def regroup(self, force=False):
            if not force:
                return None
            self.generation += 1
            return self.generation

        def send_weights_notice(self, version, *, plan=None, path=None, generation=None):
            self.calls.append(("notice", version, generation))

        def wait_weights_acks(self, version, timeout_s, cause=None):
            self.calls.append(("wait", version, timeout_s))
            return len([c for c in self.calls if c[0] == "wait"]) <= self.waits

    monkeypatch.setattr(wp.coll, "bcast", lambda comm, obj, root, **kw: obj)

    class Actor:
        weight_stage, is_weight_sender = None, False

    def publisher(notifier):
        pub = _publisher(notifier)
        pub.actor, pub.comm, pub._plan = Actor(), _Comm(), []
        return pub

    rec = Notifier(waits=1)
    publisher(rec).publish(4)
    assert [c for c in rec.calls if c[0] == "notice"] == [("notice", 4, None), ("notice", 4, 1)]
    rec = Notifier(waits=wp.SENDS)
    try:
        publisher(rec).publish(4)
    except wp.wsync.WeightSyncError as exc:
        assert f"after {wp.SENDS} sends over re-formed weight groups" in str(exc)
    else:
        raise AssertionError("no WeightSyncError")
    assert len([c for c in rec.calls if c[0] == "notice"]) == wp.SENDS
