"""Per-request sampling seeds: each sample's random numbers come from its own seed, derived from
the run's seed, the prompt and the sample's index (vllm_engine.py says how vLLM uses them; the
rollout log stores each sample's seed; analysis/regenerate.py samples a row again from it)."""
from __future__ import annotations

import hashlib

# Sample seeds are below 2**62: vLLM adds a child's index to its request's seed (n > 1), and
# torch.Generator.manual_seed takes at most 2**64 - 1; the rollout log stores them as int64.
SEED_BITS = 62


def _hash_seed(*parts: int | str) -> int:
    """A stable 62-bit integer of `parts` (BLAKE2b; the same on every machine and run)."""
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8,
                        person=b"areal_hpc.seed")
    return int.from_bytes(h.digest(), "little") >> (64 - SEED_BITS)


def group_seed(run_seed: int, kind: str, prompt_id: int) -> int:
    """The seed of sample 0 of a group, below 2**61; sample i's is this + i (`sample_seed`).
    `kind` is "train" or "eval" (held-out prompts are numbered apart); `prompt_id` the training
    prompt's data-cursor position, which names its (epoch, dataset index) one-to-one for a
    given data.seed and data set, or the held-out row's index."""
    return _hash_seed("group", int(run_seed), kind, int(prompt_id)) >> 1


def sample_seed(run_seed: int, kind: str, prompt_id: int, sample_idx: int) -> int:
    """The seed of sample `sample_idx` of its group: consecutive, so distinct within a group."""
    return group_seed(run_seed, kind, prompt_id) + int(sample_idx)


def continuation_seed(seed: int, tokens_done: int) -> int:
    """The seed of a sample's continuation from its first `tokens_done` tokens (a weight update
    or a preemption cut it there); the sample's own seed when it has none yet."""
    return int(seed) if tokens_done == 0 else _hash_seed("continue", int(seed), int(tokens_done))
