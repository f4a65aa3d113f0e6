"""The generators' acknowledgements of weight updates, and the error a missing one becomes."""

from __future__ import annotations

from dataclasses import dataclass, field


class WeightSyncError(RuntimeError):
    """A weight update did not complete on every generator in time; the job must stop."""


@dataclass
class AckTracker:
    """The generators' acknowledgements of weight updates (fed from MPI by the controller).

    A generator sends `WeightsAck(version, "started")` when it begins loading an update and
    `WeightsAck(version, "loaded", paused_s)` once the engine runs the new weights.
    `expected` maps generator world rank → host name.
    """

    expected: dict[int, str]
    started: dict[int, int] = field(default_factory=dict)  # rank → newest version started
    loaded: dict[int, int] = field(default_factory=dict)  # rank → newest version loaded
    paused_s: dict[int, float] = field(default_factory=dict)  # rank → pause of its newest load

    def record(self, rank: int, ack) -> None:
        """Take a generator's `messages.WeightsAck`."""
        if ack.phase == "started":
            self.started[rank] = ack.version
        else:
            self.loaded[rank] = ack.version
            self.paused_s[rank] = ack.paused_s

    def complete(self, version: int) -> bool:
        return all(self.loaded.get(r, -1) >= version for r in self.expected)

    def check(self, version: int, waited_s: float, cause: BaseException | None = None) -> None:
        """Raise `WeightSyncError` unless every generator runs exactly `version`."""
        wrong = {r: v for r, v in self.loaded.items() if r in self.expected and v > version}
        lines = [f"generator rank {r} (host {self.expected[r]}) reports version {v}"
                 for r, v in sorted(wrong.items())]
        for r, host in sorted(self.expected.items()):
            if self.loaded.get(r, -1) >= version:
                continue
            if self.started.get(r, -1) >= version:
                lines.append(f"generator rank {r} (host {host}) started loading but did not finish")
            else:
                lines.append(f"generator rank {r} (host {host}) never started loading")
        if not lines and cause is None:
            return
        what = f"weight update to version {version} failed after {waited_s:.1f} s"
        if cause is not None:
            what += f" ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
        raise WeightSyncError("; ".join([what, *lines]) if lines else what) from cause
