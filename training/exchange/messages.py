"""What a learner accepts from a peer before any of it is mixed.

A peer's message is whatever bytes sit under its key: anyone with write access to a store can
put something there first, and a learner that diverged sends non-finite values. Mixing is
contagious (a NaN reaches every learner of a butterfly within ceil(log2 N) rounds and then passes
every checksum as part of a checkpoint), so a message is checked against what the receiver
expects from that peer in that round, field by field, and anything else is refused:

  * metadata: the sending learner, round, fragment and token count the receiver's own plan says
    (the tokens a mix weighs a message by come from the spec, never from the message);
  * payload: exactly the tensors the run's codec produces for the fragment, with their dtypes and
    shapes, the same element counts, positions in range, and finite values;
  * values: what the payload decodes to is finite (a finite scale of 3e38 decodes to inf), and
    within bounds of the receiver's own (`check_bounds`): a valid-looking message that would throw
    the mix far from where the receiver's own training went is refused like a malformed one.

A refusal names the field at fault and quotes at most a few characters of what the message holds.

The expected layout is the codec's own encoding of a zero vector of the fragment's size, so the
check cannot drift from the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.exchange.compression import Codec, decode_field


class MessageRejected(ValueError):
    """A peer's message is not what the receiver expects; the message says what is wrong."""


# A peer's pseudo-gradient may be this many times as long as the receiver's own (islands differ in
# batch and inner steps, by small factors), plus a floor per element for rounds in which the receiver
# barely moved; its anchor may sit that far from the receiver's plus this share of the anchor's norm
# (partners drift apart by a few percent between the rounds they meet).
BOUND_FACTOR = 10.0
BOUND_FLOOR_PER_ELEMENT = 1e-3
ANCHOR_SPREAD = 0.5


def short(value) -> str:
    """What a message holds, cut short for an error: it could be any length."""
    text = repr(value)
    return text[:40] + "..." if len(text) > 40 else text


@dataclass(frozen=True)
class ExpectedMessage:
    """What the receiver's plan says a peer's message of one round must be."""

    learner: int
    round: int
    fragment: int
    tokens: int
    numel: int  # elements of the fragment
    fields: tuple[str, ...]  # ("anchor", "delta") for butterfly pairs, ("delta",) for means of Δ, ("anchor",) for crossings
    anchor_from_initial: bool  # the anchor travels relative to the initial weights (`Codec.anchor_relative`)
    slice_index: int | None = None  # a hierarchical crossing's message: the sender's slice of its island's fragment
    mixed: bool = False  # a slice's islands' mean, shared inside the island after a crossing
    stepped: bool = False  # a shard of the anchor its owner's outer step gave (`sync.shard_outer_step`)

    @property
    def max_bytes(self) -> int:
        """The most bytes a well-formed message can have (fp32 fields and headers), before it is read."""
        return 64 * 1024 + 8 * self.numel * len(self.fields)

    def metadata(self) -> dict:
        """What the message's commit says besides its tensors: its sender writes exactly this."""
        meta = {"learner": self.learner, "round": self.round, "fragment": self.fragment, "tokens": self.tokens,
                "anchor_from_initial": self.anchor_from_initial}
        if self.slice_index is not None:
            meta["slice"] = self.slice_index
        if self.mixed:
            meta["mixed"] = True
        if self.stepped:
            meta["stepped"] = True
        return meta


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
        raise MessageRejected(f"tensors {short(sorted(payload))}, expected {sorted(template)}")
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
    decoded = {name: decode_field(name, payload) for name in expected.fields}
    for name, value in decoded.items():
        if not bool(torch.isfinite(value).all()):
            raise MessageRejected(f"field {name!r} decodes to non-finite values")
    return decoded


def check_bounds(message: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """Refuse a decoded message whose pseudo-gradient, or whose anchor's distance from the receiver's,
    is out of proportion to the receiver's own pseudo-gradient (fp32 vectors of the fragment; the
    receiver's `own` anchor and, where it has one, its pseudo-gradient)."""
    numel = own["anchor" if "anchor" in own else "delta"].numel()
    step = (float(own["delta"].norm()) if "delta" in own else 0.0) + BOUND_FLOOR_PER_ELEMENT * numel ** 0.5
    if "delta" in message and float(message["delta"].norm()) > BOUND_FACTOR * step:
        raise MessageRejected(f"field 'delta' is more than {BOUND_FACTOR:g} times as long as the receiver's own")
    if "anchor" in message and float((message["anchor"] - own["anchor"]).norm()) > \
            BOUND_FACTOR * step + ANCHOR_SPREAD * float(own["anchor"].norm()):
        raise MessageRejected("field 'anchor' lies too far from the receiver's own anchor")


def _check_metadata(meta: dict, expected: ExpectedMessage) -> None:
    if not isinstance(meta, dict):
        raise MessageRejected("metadata is not an object")
    for name, want in expected.metadata().items():
        got = meta.get(name)
        if type(got) is not type(want) or got != want:
            raise MessageRejected(f"metadata {name}={short(got)}, expected {want!r}")
