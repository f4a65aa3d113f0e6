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
    # rank → the version it needs: its engine has no usable weights until the group is
    # re-formed and that version sent again (a restarted engine, a broadcast failed part-way)
    awaiting: dict[int, int] = field(default_factory=dict)
    # acknowledgements are numbered as they come: an "awaiting" counts as a reply to the last
    # notice sent (`sent`) only if it came after it
    count: int = 0
    sent_at: int = 0
    awaiting_at: dict[int, int] = field(default_factory=dict)

    def sent(self) -> None:
        """A weight notice went out: later "awaiting" acknowledgements answer it."""
        self.sent_at = self.count

    def record(self, rank: int, ack) -> None:
        """Take a generator's `messages.WeightsAck`."""
        self.count += 1
        if ack.phase == "started":
            self.started[rank] = ack.version
        elif ack.phase == "awaiting":
            self.awaiting[rank] = ack.version
            self.awaiting_at[rank] = self.count
        else:
            self.loaded[rank] = ack.version
            self.paused_s[rank] = ack.paused_s
            self.awaiting.pop(rank, None)

    def complete(self, version: int) -> bool:
        return all(self.loaded.get(r, -1) >= version and r not in self.awaiting
                   for r in self.expected)

    def settled(self, version: int) -> bool:
        """Every generator either runs `version` or said, after the last notice, that it waits
        for the group to be re-formed, and at least one waits: the update is to be sent again
        to a re-formed group."""
        def done(r: int) -> bool:
            if r in self.awaiting:
                return self.awaiting_at[r] > self.sent_at
            return self.loaded.get(r, -1) >= version
        return bool(self.awaiting) and all(done(r) for r in self.expected)

    def check(self, version: int, waited_s: float, cause: BaseException | None = None) -> None:
        """Raise `WeightSyncError` unless every generator runs exactly `version`."""
        wrong = {r: v for r, v in self.loaded.items() if r in self.expected and v > version}
        lines = [f"generator rank {r} (host {self.expected[r]}) reports version {v}"
                 for r, v in sorted(wrong.items())]
        for r, host in sorted(self.expected.items()):
            if r in self.awaiting:
                lines.append(f"generator rank {r} (host {host}) waits for weights "
                             f"v{self.awaiting[r]} again (its engine restarted, or its load failed)")
                continue
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
