"""What a learner accepts from a peer before any of it is mixed.

A peer's message is whatever bytes sit under its key: anyone with write access to a store can
put something there first, and a learner that diverged sends non-finite values. Mixing is
contagious (a NaN reaches every learner of a butterfly within ceil(log2 N) rounds and then passes
every checksum as part of a checkpoint), so a message is checked against what the receiver
expects from that peer in that round, field by field, and anything else is refused:

  * metadata: the sending learner, round, fragment and token count the receiver's own plan says
    (the tokens a mix weighs a message by come from the spec, never from the message);
  * payload: exactly the tensors the run's codec produces for the fragment, with their dtypes and
    shapes, the same element counts, positions in range, and finite values.

The expected layout is the codec's own encoding of a zero vector of the fragment's size, so the
check cannot drift from the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.compression import Codec, decode_field


class MessageRejected(ValueError):
    """A peer's message is not what the receiver expects; the message says what is wrong."""


@dataclass(frozen=True)
class ExpectedMessage:
    """What the receiver's plan says a peer's message of one round must be."""

    learner: int
    round: int
    fragment: int
    tokens: int
    numel: int  # elements of the fragment
    fields: tuple[str, ...]  # ("anchor", "delta") for butterfly pairs, ("delta",) for all-reduce
    anchor_from_initial: bool  # compressed anchors travel as their difference from the initial weights

    @property
    def max_bytes(self) -> int:
        """The most bytes a well-formed message can have (fp32 fields and headers), before it is read."""
        return 64 * 1024 + 8 * self.numel * len(self.fields)

    def metadata(self) -> dict:
        return {"learner": self.learner, "round": self.round, "fragment": self.fragment, "tokens": self.tokens,
                "anchor_from_initial": self.anchor_from_initial}


def _sparsified(name: str) -> bool:
    """Anchors are never sparsified: a partner must land on the same full anchor."""
    return name != "anchor"


def accept_message(payload: dict[str, torch.Tensor], meta: dict, expected: ExpectedMessage,
                   codec: Codec) -> dict[str, torch.Tensor]:
    """The message's fields as fp32 vectors of the fragment's size, or MessageRejected."""
    _check_metadata(meta, expected)
    template = {}
    for name in expected.fields:
        template.update(codec.encode(name, torch.zeros(expected.numel), sparsify=_sparsified(name)))
    if set(payload) != set(template):
        raise MessageRejected(f"tensors {sorted(payload)}, expected {sorted(template)}")
    for key, want in template.items():
        got = payload[key]
        if got.dtype != want.dtype or got.shape != want.shape:
            raise MessageRejected(f"tensor {key!r} is {got.dtype} {tuple(got.shape)}, "
                                  f"expected {want.dtype} {tuple(want.shape)}")
        if key.endswith((".count", ".numel")) and not torch.equal(got, want):
            raise MessageRejected(f"tensor {key!r} declares {got.tolist()}, expected {want.tolist()}")
        if key.endswith(".index") and got.numel() and (
                int(got.min()) < 0 or int(got.max()) >= expected.numel or not bool((got[1:] > got[:-1]).all())):
            raise MessageRejected(f"tensor {key!r} holds positions that are out of range or not increasing")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise MessageRejected(f"tensor {key!r} holds non-finite values")
        if key.endswith(".scale") and bool((got < 0).any()):
            raise MessageRejected(f"tensor {key!r} holds negative scales")
    return {name: decode_field(name, payload) for name in expected.fields}


def _check_metadata(meta: dict, expected: ExpectedMessage) -> None:
    for name, want in expected.metadata().items():
        got = meta.get(name)
        if type(got) is not type(want) or got != want:
            raise MessageRejected(f"metadata {name}={got!r}, expected {want!r}")
