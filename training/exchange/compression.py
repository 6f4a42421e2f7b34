"""Message compression with error feedback: what a learner sends its peers, in fewer bytes.

A message field (a fragment's anchor or pseudo-gradient, one flat vector) is encoded as:
  * `none`: the fp32 values;
  * `int8`: symmetric int8 with one fp32 scale per chunk of `scale_chunk` values (absmax / 127);
  * `int4`: symmetric 4-bit values in [-7, 7], two per byte (low nibble first), one fp32 scale
    per chunk (absmax / 7);
and optionally sparsified first: only the `topk` largest-magnitude fraction of values is kept,
with their int32 positions. Everything stays a safetensors payload; nothing is pickled.

Error feedback (see the method notes): the sender keeps what compression dropped,
    send C(v + e),   e <- (v + e) - D(C(v + e)),
so nothing is lost, only delayed. The residual is updated from what was actually written (the
decoded payload), which is what peers mix with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT8_MAX, INT4_MAX = 127, 7


@dataclass(frozen=True)
class Codec:
    """How one message field is compressed."""

    scheme: str = "none"  # none | int8 | int4
    scale_chunk: int = 256
    topk: float = 1.0

    def __post_init__(self):
        if self.scheme not in ("none", "int8", "int4"):
            raise ValueError(f"compression: unknown scheme {self.scheme!r} (none, int8 or int4)")
        if self.scale_chunk < 2 or self.scale_chunk % 2:
            raise ValueError(f"scale_chunk must be an even number >= 2, got {self.scale_chunk}")
        if not 0 < self.topk <= 1:
            raise ValueError(f"topk must be in (0, 1], got {self.topk}")

    @property
    def lossless(self) -> bool:
        return self.scheme == "none" and self.topk == 1.0

    @property
    def anchor_relative(self) -> bool:
        """Whether an anchor travels as its difference from a reference every learner holds (the run's
        initial weights, which each rebuilds from the seed): a lossy codec then spends its levels on what
        training changed rather than on the weights themselves. Exact anchors travel as they are."""
        return not self.lossless

    def to_wire(self, fields: dict[str, torch.Tensor], reference: torch.Tensor) -> dict[str, torch.Tensor]:
        """`fields` as they are encoded: an anchor relative to `reference` (its positions' values) where
        `anchor_relative` says so."""
        if not self.anchor_relative or "anchor" not in fields:
            return fields
        return {**fields, "anchor": fields["anchor"] - reference}

    def from_wire(self, fields: dict[str, torch.Tensor], reference: torch.Tensor) -> dict[str, torch.Tensor]:
        """What `to_wire` took away, given back to a decoded message."""
        if not self.anchor_relative or "anchor" not in fields:
            return fields
        return {**fields, "anchor": fields["anchor"] + reference}

    def encode(self, name: str, vector: torch.Tensor, sparsify: bool = True) -> dict[str, torch.Tensor]:
        """Payload tensors for one field, named `name` or `name.<part>`."""
        vector = vector.detach().float().reshape(-1).cpu()
        payload: dict[str, torch.Tensor] = {}
        values = vector
        sparse = sparsify and self.topk < 1.0
        if sparse:
            k = max(1, math.ceil(self.topk * vector.numel()))
            index = torch.topk(vector.abs(), k, sorted=False).indices.sort().values
            payload[f"{name}.index"] = index.to(torch.int32)
            payload[f"{name}.numel"] = torch.tensor([vector.numel()], dtype=torch.int64)
            values = vector[index]
        if self.scheme == "none":
            payload[f"{name}.values" if sparse else name] = values.clone()
            return payload
        levels = INT8_MAX if self.scheme == "int8" else INT4_MAX
        chunks, count = _chunked(values, self.scale_chunk)
        scale = chunks.abs().amax(dim=1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(chunks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).reshape(-1)[:count]
        payload[f"{name}.scale"] = scale
        if self.scheme == "int8":
            payload[f"{name}.q8"] = q
        else:
            payload[f"{name}.q4"] = _pack_nibbles(q)
        payload[f"{name}.count"] = torch.tensor([count, self.scale_chunk], dtype=torch.int64)
        return payload



def decode_field(name: str, payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 vector a payload field stands for; the encoding is read from the payload itself."""
    if name in payload:
        return payload[name].float()
    if f"{name}.values" in payload:
        values = payload[f"{name}.values"].float()
    elif f"{name}.scale" in payload:
        count, chunk = (int(v) for v in payload[f"{name}.count"])
        scale = payload[f"{name}.scale"].float()
        if f"{name}.q8" in payload:
            q = payload[f"{name}.q8"].to(torch.float32)
        else:
            q = _unpack_nibbles(payload[f"{name}.q4"], count).to(torch.float32)
        chunks, _ = _chunked(q, chunk)
        values = (chunks * scale[:, None]).reshape(-1)[:count]
    else:
        raise KeyError(f"message has no field {name!r} (parts: {sorted(payload)})")
    if f"{name}.index" not in payload:
        return values
    out = torch.zeros(int(payload[f"{name}.numel"][0]))
    out[payload[f"{name}.index"].long()] = values
    return out


def _chunked(values: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    count = values.numel()
    padded = math.ceil(count / chunk) * chunk
    return torch.nn.functional.pad(values, (0, padded - count)).view(-1, chunk), count


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    biased = (q.to(torch.int16) + 8).to(torch.uint8)  # [-7, 7] -> [1, 15]
    if biased.numel() % 2:
        biased = torch.cat([biased, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = biased.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:count]


class ErrorFeedback:
    """Per-field residuals over the whole flat parameter vector; a fragment uses its slice.

    `encode` does not change the residual: it returns the new slice, and the learner commits it
    with `commit` when the exchange is applied. So a checkpoint written while a message is in
    flight holds the residual the message was encoded from, and a restarted learner re-encodes
    the very same message instead of counting the dropped part twice.
    """

    def __init__(self, codec: Codec, size: int, fields: tuple[str, ...], enabled: bool = True):
        self.codec = codec
        self.enabled = enabled and not codec.lossless
        self.residual = {f: torch.zeros(size) for f in fields} if self.enabled else {}

    def encode(self, fields: dict[str, torch.Tensor], index: torch.Tensor,
               sparsify: dict[str, bool] | None = None, residuals: str = "",
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Payload, the decoded values peers will see, and each field's new residual slice. A field
        `name` keeps its residual under `<residuals><name>`: messages of another kind keep theirs apart."""
        payload, decoded, residual = {}, {}, {}
        for name, value in fields.items():
            target = value + self.residual[residuals + name].index_select(0, index) if self.enabled else value
            part = self.codec.encode(name, target, sparsify=(sparsify or {}).get(name, True))
            payload.update(part)
            decoded[name] = decode_field(name, part)
            if self.enabled:
                residual[residuals + name] = target - decoded[name]
        return payload, decoded, residual

    def residual_after(self, fields: dict[str, torch.Tensor], index: torch.Tensor,
                       sent: dict[str, torch.Tensor], residuals: str = "") -> dict[str, torch.Tensor]:
        """The residual slices when a message other than the one just encoded was sent (an
        earlier life of this learner committed it first): target minus what peers actually see."""
        if not self.enabled:
            return {}
        return {residuals + name: value + self.residual[residuals + name].index_select(0, index) - sent[name]
                for name, value in fields.items()}

    def commit(self, index: torch.Tensor, residual: dict[str, torch.Tensor]) -> None:
        for name, value in residual.items():
            self.residual[name].index_copy_(0, index, value)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"residual.{name}": r.clone() for name, r in self.residual.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.residual:
            if f"residual.{name}" in tensors:
                self.residual[name] = tensors[f"residual.{name}"].float().clone()

    def reset(self) -> None:
        for r in self.residual.values():
            r.zero_()
