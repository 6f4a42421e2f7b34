"""Paired bootstrap of the relative bits-per-byte difference of two models on the same documents.

Documents, not bytes, are the unit of resampling: bytes within a document are correlated (a
document the model knows well is easy throughout), so treating them as independent would make the
interval far too narrow. Both models see the same resampled documents, so what the documents share
(some are hard for every model) cancels out of the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Index matrices are drawn in blocks of at most this many entries, so a long evaluation does not
# need resamples x documents integers at once.
_BLOCK_ENTRIES = 1 << 22


@dataclass(frozen=True)
class PairedDifference:
    """bpb of each model, A's relative difference to B (bpb_a / bpb_b - 1) and its interval."""

    bpb_a: float
    bpb_b: float
    relative: float
    low: float
    high: float
    confidence: float


def paired_bootstrap(bits_a, bits_b, nbytes, resamples: int = 10_000, confidence: float = 0.95,
                     seed: int = 0) -> PairedDifference:
    """Percentile interval of bpb_a / bpb_b - 1 over `resamples` resamplings of the documents with
    replacement, the same documents for both models, from a generator seeded with `seed`.

    `bits_a[i]` and `bits_b[i]` are the two models' summed losses in bits on document (or chunk) i,
    `nbytes[i]` its length in bytes.
    """
    a, b, n = (np.asarray(values, dtype=np.float64) for values in (bits_a, bits_b, nbytes))
    for name, values in (("bits_a", a), ("bits_b", b), ("nbytes", n)):
        if values.ndim != 1 or len(values) == 0:
            raise ValueError(f"{name} must be a non-empty sequence of numbers, one per document")
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"{name} must hold finite numbers >= 0")
    if not len(a) == len(b) == len(n):
        raise ValueError(f"bits_a, bits_b and nbytes must have one entry per document, got lengths "
                         f"{len(a)}, {len(b)} and {len(n)}")
    if b.sum() == 0 or n.sum() == 0:
        raise ValueError("bits_b and nbytes must not sum to 0")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    generator = np.random.default_rng(seed)
    documents = len(a)
    block = max(1, _BLOCK_ENTRIES // documents)
    ratios = []
    for start in range(0, resamples, block):
        drawn = generator.integers(0, documents, size=(min(block, resamples - start), documents))
        # Both models' bpb share the resample's byte count, so their ratio is that of their bits.
        ratios.append(a[drawn].sum(axis=1) / b[drawn].sum(axis=1))
    relative = np.concatenate(ratios) - 1
    tail = (1 - confidence) / 2
    low, high = np.quantile(relative, [tail, 1 - tail])
    bpb_a, bpb_b = a.sum() / n.sum(), b.sum() / n.sum()
    return PairedDifference(bpb_a=float(bpb_a), bpb_b=float(bpb_b), relative=float(bpb_a / bpb_b - 1),
                            low=float(low), high=float(high), confidence=confidence)
