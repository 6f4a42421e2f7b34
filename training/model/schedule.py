"""When things happen along training: the inner learning rate, and the points where both arms are scored."""

from __future__ import annotations

import math

def learning_rate(step: int, total_steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak: the same shape for every arm."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def curve_rounds(rounds: int, points: int) -> list[int]:
    """`points` rounds after which both arms are scored, evenly spread and always including the last."""
    return sorted({math.ceil(rounds * k / points) - 1 for k in range(1, points + 1)})


def snapshot_steps(rounds: int, steps: int, points: int) -> list[int]:
    """Standard-training steps (0-based) at which it has seen the islands' tokens after each curve round.

    Both arms consume the same planned rows, the baseline spread evenly over its steps, so
    after step s it has seen (s + 1) / steps of them, as the islands have after (r + 1) / rounds.
    """
    return sorted({max(0, round(steps * (r + 1) / rounds) - 1) for r in curve_rounds(rounds, points)})
