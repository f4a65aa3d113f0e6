"""Preemption signals set a flag (never a lock: repeated signals must not deadlock), and children
started under `shield_children` survive USR1 while this process still receives it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from areal_hpc import preemption


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    preemption.reset()
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    preemption.reset()


def test_signals_set_the_flag_repeatedly(handlers):
    preemption.install(["USR1", "USR2"])
    assert not preemption.requested()
    for _ in range(50):                     # a burst, as srun and the batch shell may both send
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.requested()
    preemption.reset()
    assert not preemption.requested()


def test_children_started_shielded_survive_usr1(handlers):
    preemption.install(["USR1"])
    with preemption.shield_children():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGUSR1 not in mask                           # restored here
    try:
        time.sleep(0.5)
        child.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert child.poll() is None                             # default action would kill it
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested()
    finally:
        child.kill()
        child.wait()


def test_unknown_signal_name_is_a_config_error():
    from areal_hpc.config import ConfigError, load
    with pytest.raises(ConfigError, match="checkpoint.signals"):
        load(None, ["model.path=x", "data.train_path=y", "checkpoint.signals=[USR9]"])


def test_the_hold_hook_holds_once(tmp_path, monkeypatch):
    """The generator's test hook (preemption.HOLD_HOOK_ENV): unset, nothing; set, its version,
    tokens and mark; once the mark is written, spent (a requeued attempt keeps the environment)."""
    mark = tmp_path / "held"
    monkeypatch.delenv(preemption.HOLD_HOOK_ENV, raising=False)
    assert preemption.hold_hook() is None
    monkeypatch.setenv(preemption.HOLD_HOOK_ENV, f"3:8:{mark}")
    assert preemption.hold_hook() == (3, 8, str(mark))
    mark.write_text("rank 1: held\n")
    assert preemption.hold_hook() is None
