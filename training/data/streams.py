"""Token streams as the learners and the evaluation read them: what a stored shard or held-out set
holds, and the random windows training draws from it.

Kept apart from the data preparation so that a learner's process needs torch and the store only,
not the libraries that read corpora and find near-duplicates.
"""

from __future__ import annotations

import torch

from infra.objects import ObjectRef


def min_stream_tokens(seq_len: int) -> int:
    """A window is seq_len + 1 tokens (inputs and their shifted targets), drawn from at least two starts."""
    return seq_len + 2


class WindowSampler:
    """Random (input, target) windows from a learner's stream, reproducible from a seed.

    The learner reseeds the generator every round, so a resumed learner draws exactly the windows
    it would have drawn.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        if len(stream) < min_stream_tokens(seq_len):
            raise ValueError(f"shard of {len(stream)} bytes is too short for seq_len {seq_len}")
        self.stream = stream.long()
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (rows,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.stream[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


def read_stream(store, entry: dict) -> torch.Tensor:
    """A shard or held-out stream named by a manifest entry, verified against its checksum."""
    return store.get_tensors(ObjectRef.from_json(entry["object"]))["tokens"]
