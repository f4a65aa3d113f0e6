"""Staleness control (AReaL's η bound), pure logic. Units: prompts (one prompt = one group).

A prompt may be submitted only while

    capacity = min(max_concurrent - running,
                   (max_staleness + version + 1) * batch_prompts - (accepted + running)) > 0

so that every accepted group is consumed by a training step at most η versions after the policy
version it was started under. Rejected (or failed) groups free their slot and do not count.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessBudget:
    max_staleness: int          # η
    batch_prompts: int          # B: groups consumed per training step
    max_concurrent: int         # groups in flight at most
    version: int = 0            # current policy version (training steps done)
    running: int = 0            # submitted, not yet returned
    accepted: int = 0           # returned and kept for training

    def capacity(self) -> int:
        """How many more prompts may be submitted now (may be <= 0)."""
        concurrency = self.max_concurrent - self.running
        staleness = (self.max_staleness + self.version + 1) * self.batch_prompts \
            - (self.accepted + self.running)
        return min(concurrency, staleness)

    def on_submitted(self, n: int = 1) -> None:
        self.running += n

    def on_accepted(self) -> None:
        self.running -= 1
        self.accepted += 1

    def on_rejected(self) -> None:
        self.running -= 1

    def on_dropped(self) -> None:
        """An accepted group was discarded unused (too stale): it no longer counts."""
        self.accepted -= 1

    def on_version(self, version: int) -> None:
        self.version = version

    def on_recovered(self, version: int) -> None:
        """After a restart at `version`: everything consumed so far counts as accepted."""
        self.version = version
        self.accepted = version * self.batch_prompts
        self.running = 0


def staleness_of(consume_version: int, token_versions) -> int:
    """How many versions behind the consuming policy the oldest token of a trajectory is."""
    return int(consume_version - min(token_versions)) if len(token_versions) else 0
