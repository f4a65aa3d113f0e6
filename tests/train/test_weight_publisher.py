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

    def send_weights_notice(self, version, *, plan=None, path=None):
        self.calls.append(("notice", version, path))

    def wait_weights_acks(self, version, timeout_s, cause=None):
        self.calls.append(("wait", version, timeout_s))


def _publisher(notifier):
    cfg = WeightSyncConfig(mode="broadcast", timeout_s=7.0, bucket_mb=1)
    return WeightPublisher(cfg, actor=None, comm=None, pp=1, collective_timeout_s=1.0,
                           weight_dir="w", notifier=notifier)


def test_the_silent_notifier_waits_for_nothing():
    assert _publisher(SILENT)._acknowledged(3, None) == (None, False)
    assert Follower.weight_notifier is SILENT and Controller.collects_acks is True


def test_rank_0_waits_for_the_acknowledgements_of_its_version():
    rec = _Recorder()
    assert _publisher(rec)._acknowledged(3, None) == (None, False)
    assert rec.calls == [("wait", 3, 7.0)]
