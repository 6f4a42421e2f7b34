"""Bits per byte: total negative log-likelihood of a text in nats / (ln 2 x its UTF-8 bytes).

Every token of the held-out stream is scored. The stream is cut into consecutive windows of
`seq_len`; each token is predicted from the tokens before it in its window (so early tokens of a
window see less context, the same for every model compared). Document separators are inputs,
never scored targets: they are not text. With the byte vocabulary a token is a byte; with a
tokenizer, a document's bits are divided by its UTF-8 bytes as the data manifest records them, so
runs with different vocabularies compare.

The bits are also summed per document (a stretch of the stream from one separator to the next), so
that two models scored on the same stream can be compared by a paired bootstrap over documents.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infra.spec.model import BOS


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int = 32,
                  separator: int = BOS, document_bytes: list[int] | None = None) -> dict:
    """`document_bytes`: each document's UTF-8 bytes, in stream order, when its tokens are not bytes."""
    model.eval()
    stream = stream.long()
    n_targets = len(stream) - 1
    starts = list(range(0, n_targets, seq_len))
    document_of = torch.cumsum(stream == separator, 0) - 1  # documents start with a separator
    documents = max(int(document_of[-1]) + 1, 1) if len(stream) else 1
    document_nll = torch.zeros(documents, dtype=torch.float64)
    document_targets = torch.zeros(documents, dtype=torch.int64)
    full = [s for s in starts if s + seq_len <= n_targets]
    tail = [s for s in starts if s + seq_len > n_targets]
    for group, length in ((full, seq_len), (tail, n_targets - tail[0] if tail else 0)):
        for i in range(0, len(group), batch_size):
            chunk = torch.tensor(group[i:i + batch_size])
            offsets = torch.arange(length + 1)
            windows = stream[chunk[:, None] + offsets]
            logits = model(windows[:, :-1])
            targets = windows[:, 1:]
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            counted = targets.reshape(-1) != separator
            owner = document_of[chunk[:, None] + offsets[1:]].reshape(-1).clamp(min=0)[counted]
            document_nll.index_add_(0, owner, losses[counted].double())
            document_targets.index_add_(0, owner, torch.ones_like(owner))
    if document_bytes is None:  # bytes: each scored target is one byte of text
        document_bytes = document_targets
    elif len(document_bytes) != documents:
        raise ValueError(f"{len(document_bytes)} document byte counts for a stream of {documents} documents")
    else:
        document_bytes = torch.tensor(document_bytes, dtype=torch.int64)
    nll, scored = document_nll.sum().item(), int(document_bytes.sum())
    return {"bpb": nll / (math.log(2) * scored), "nll_nats": nll, "bytes": scored,
            "document_bits": (document_nll / math.log(2)).tolist(), "document_bytes": document_bytes.tolist()}
