"""What the user watches: one line per step, a progress bar with ETA, the held-out accuracy table."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total_steps: int, enabled: bool = True, initial: int = 0):
        self.enabled = enabled
        self.bar = tqdm(total=total_steps, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, disable=not enabled, mininterval=1.0)
        self._ready = -1

    def waiting(self, ready: int) -> None:
        """Called while the trainer waits for groups; redraws only when the count changes."""
        if ready != self._ready:
            self._ready = ready
            self.bar.set_postfix_str(f"waiting for rollouts: {ready} groups ready")

    def step(self, r: dict) -> None:
        if not self.enabled:
            return
        line = (f"step {r['step'] + 1:>4} | reward {r['reward']:+.3f} | acc {r['accuracy']:.3f} "
                f"| len {r['response_len']:5.1f} | stale max {r['staleness_max']} "
                f"mean {r['staleness_mean']:.2f} drop {r['dropped_stale']} | gen {r['gen_tok_per_s']:7.1f} tok/s "
                f"| loss {r['loss']:+.4f} | gnorm {r['grad_norm']:.3f} ess {r.get('ess', 1.0):.2f} "
                f"| wait {r['wait_s']:.1f}s train {r['seconds']:.1f}s sync {r['weight_sync_s']:.2f}s")
        if r.get("engine_restarts"):        # shown once an engine has been restarted after a fault
            line += f" | engines restarted {r['engine_restarts']}, generators live {r.get('generators_live', '?')}"
        self.bar.write(line, file=sys.stdout)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def eval_table(self, evals: list[dict]) -> None:
        if not self.enabled or not evals:
            return
        print("\nheld-out accuracy")
        print(f"{'':8} {'version':>7} {'accuracy':>9} {'samples':>8}")
        for e in evals:
            print(f"{e['label']:8} {e['version']:>7} {e['accuracy']:>9.3f} {e['samples']:>8}")
        if len(evals) >= 2:
            print(f"{'change':8} {'':>7} {evals[-1]['accuracy'] - evals[0]['accuracy']:>+9.3f}")
        sys.stdout.flush()
