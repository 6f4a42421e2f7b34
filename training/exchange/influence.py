"""How far a peer's message may move a learner's mix, and the record of how far each peer did.

`check_bounds` (training/exchange/messages.py) refuses a message far out of proportion to the
receiver's own values. A peer whose island's own key signs what it sends can stay inside those
fixed bounds every round (an anchor 1.45 times the receiver's, a pseudo-gradient -9.5 times), and
its pull compounds. So what is mixed is bounded further, by what the learners have shown they do:

  * butterfly: a pair bounds both messages by the anchor the pair agreed the last time it met (the
    fragment's anchor after that mix's outer step) and by the pair's recent steps (`PairRecord.step`:
    a running norm of the pair's accepted pseudo-gradients, which only the smaller of the two
    raises and which decays slowly, so neither member can grow it and neither can shrink it fast);
  * allreduce and hierarchical: each member's pseudo-gradient is bounded by a multiple of the
    median member's norm (one bad member of three or more is never the median).

A message beyond its bound is clipped: its deviation (from the agreed anchor, of the pseudo-gradient
from zero) is scaled down to the bound, so a merely large message still counts, at a bounded size.
Each bound is a function of the messages both sides hold, taken in learner order, so every honest
receiver of the same messages clips them the same way and partners still agree bit for bit; a
message within its bound is mixed untouched. The state kept per peer goes into the learner's
checkpoint (`Exchanger.state_dict`), so a restart clips as the uninterrupted run would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from training.exchange.messages import BOUND_FLOOR_PER_ELEMENT

# A pair's pseudo-gradients may be this many times its recent step (islands differ in batch and inner
# steps by small factors), and when they point against each other (cosine below OPPOSED_COSINE: honest
# partners, stepping from one anchor on the same kind of data, point the same way) no longer than it:
# no rule that treats both members alike can tell which of two is honest, and then one can at most
# cancel the pair's step, never reverse it. (At twice it, a partner sent -9.5 times its own each
# round took the honest one from loss 5.4 to 8.6 in 8 rounds.) An anchor may lie this many recent
# steps (times the butterfly's stages, for the mixes with other partners between two meetings) from
# the one the pair agreed.
PAIR_DELTA_CLIP = 2.0
OPPOSED_COSINE = -0.5
PAIR_ANCHOR_CLIP = 2.0
# A pair's recent step decays by this factor at each meeting when both members step less.
STEP_DECAY = 0.9
# A member of a mean of pseudo-gradients may be this many times as long as the median member's: with
# N members one pointing against the rest moves their mean by at most this over N of a step (so it
# stalls a mean of three and slows a larger one), and honest members rarely lie beyond it.
MEMBER_CLIP = 2.0
# A shard of a sharded outer step (`sync.shard_outer_step`) may move its elements this many times as far,
# per element, as the median shard: parameters of different kinds step by different sizes, so the
# bound is loose, and only a group of three or more has a median that is not one of two.
SHARD_CLIP = 10.0
# Clip factors kept per peer (the smallest ever is kept apart): the record stays bounded.
KEPT_FACTORS = 32


def clip(vector: torch.Tensor, limit: float) -> tuple[torch.Tensor, float]:
    """`vector` scaled down to norm `limit`, and the factor (1.0, and `vector` itself, within it)."""
    norm = float(vector.norm())
    if norm <= limit:
        return vector, 1.0
    factor = limit / norm
    return vector * factor, factor


@dataclass
class PairRecord:
    """What a pair agreed at its last meeting over one fragment: the fragment's anchor after the
    mix's outer step, and the pair's recent step (a norm)."""

    agreed: torch.Tensor
    step: float


@dataclass
class PeerInfluence:
    """How one peer's messages fared: mixed as they came, clipped (with the factors), refused."""

    mixed: int = 0
    clipped: int = 0
    refused: int = 0
    smallest_factor: float = 1.0
    factors: list[float] = field(default_factory=list)

    def book(self, factor: float) -> None:
        self.mixed += 1
        if factor < 1.0:
            self.clipped += 1
            self.smallest_factor = min(self.smallest_factor, factor)
            self.factors = (self.factors + [factor])[-KEPT_FACTORS:]


class Influence:
    """A learner's records of its peers: each pair's `PairRecord` per fragment, each peer's
    `PeerInfluence`. Changed on the transport thread by the exchange being mixed (one at a time);
    `snapshot` is what that exchange leaves, which the learner takes when it applies it."""

    def __init__(self, me: int):
        self.me = me
        self.pairs: dict[tuple[int, int], PairRecord] = {}
        self.peers: dict[int, PeerInfluence] = {}

    def peer(self, learner: int) -> PeerInfluence:
        return self.peers.setdefault(learner, PeerInfluence())

    def refused(self, learner: int) -> None:
        self.peer(learner).refused += 1

    def clip_pair(self, peer: int, fragment: int, own: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                  stages: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Both messages of a butterfly pair (anchor and pseudo-gradient each), clipped to the pair's
        bounds: the same function of the two, taken in learner order, on both sides."""
        record = self.pairs.get((peer, fragment))
        numel = own["delta"].numel()
        floor = BOUND_FLOOR_PER_ELEMENT * numel ** 0.5
        norms = [float(own["delta"].norm()), float(theirs["delta"].norm())]
        step = max(min(norms), STEP_DECAY * record.step if record else 0.0, floor)
        ordered = (own, theirs) if self.me < peer else (theirs, own)
        opposed = min(norms) > 0 and float(ordered[0]["delta"].dot(ordered[1]["delta"])) < \
            OPPOSED_COSINE * norms[0] * norms[1]
        clipped, factors = [], []
        for message in ordered:
            delta, delta_factor = clip(message["delta"], (1.0 if opposed else PAIR_DELTA_CLIP) * step)
            anchor, anchor_factor = message["anchor"], 1.0
            if record is not None:
                deviation, anchor_factor = clip(message["anchor"] - record.agreed, PAIR_ANCHOR_CLIP * stages * step)
                if anchor_factor < 1.0:
                    anchor = record.agreed + deviation
            clipped.append({"anchor": anchor, "delta": delta})
            factors.append(min(delta_factor, anchor_factor))
        own_clipped, theirs_clipped = clipped if self.me < peer else clipped[::-1]
        self.peer(peer).book(factors[1] if self.me < peer else factors[0])
        self.pairs[(peer, fragment)] = PairRecord(own["anchor"], step)  # its anchor: `agreed` sets it
        return own_clipped, theirs_clipped

    def agreed(self, peer: int, fragment: int, anchor: torch.Tensor) -> None:
        """The anchor the pair's mix and outer step gave: the pair's reference at its next meeting."""
        self.pairs[(peer, fragment)].agreed = anchor

    def clip_members(self, members: list[tuple[int, torch.Tensor, int]]) -> list[tuple[int, torch.Tensor, int]]:
        """(learner, pseudo-gradient, tokens) of a mean, in learner order, each pseudo-gradient clipped
        to `MEMBER_CLIP` times the median member's norm (the lower median: with two, the shorter)."""
        if len(members) < 2:
            return members
        norms = [float(delta.norm()) for _, delta, _ in members]
        floor = BOUND_FLOOR_PER_ELEMENT * members[0][1].numel() ** 0.5
        limit = MEMBER_CLIP * max(sorted(norms)[(len(norms) - 1) // 2], floor)
        clipped = []
        for learner, delta, tokens in members:
            delta, factor = clip(delta, limit)
            if learner != self.me:
                self.peer(learner).book(factor)
            clipped.append((learner, delta, tokens))
        return clipped

    def clip_shards(self, anchor: torch.Tensor, stepped: torch.Tensor,
                    shards: dict[int, tuple[int, int]]) -> torch.Tensor:
        """A sharded outer step's result (`stepped`, from the group's shared `anchor`) with each
        (start, end) shard in `shards` (by owner; those that arrived, and this learner's own) moving at
        most `SHARD_CLIP` times as far per element as the median shard: every member that holds the
        same shards clips them alike, its own included."""
        if len(shards) < 3:
            return stepped
        moved = {owner: float((stepped[a:b] - anchor[a:b]).norm()) / (b - a) ** 0.5 for owner, (a, b) in shards.items()}
        typical = max(sorted(moved.values())[(len(moved) - 1) // 2], BOUND_FLOOR_PER_ELEMENT)
        clipped = stepped.clone()
        for owner, (a, b) in sorted(shards.items()):
            deviation, factor = clip(stepped[a:b] - anchor[a:b], SHARD_CLIP * typical * (b - a) ** 0.5)
            if factor < 1.0:
                clipped[a:b] = anchor[a:b] + deviation
            if owner != self.me:
                self.peer(owner).book(factor)
        return clipped

    def snapshot(self) -> "Influence":
        """A copy that later exchanges leave alone (tensors are replaced, never changed in place)."""
        copied = Influence(self.me)
        copied.pairs = {key: PairRecord(r.agreed, r.step) for key, r in self.pairs.items()}
        copied.peers = copy.deepcopy(self.peers)
        return copied

    def report(self) -> dict:
        """Per peer, what the learner's summary carries."""
        return {str(peer): vars(record) for peer, record in sorted(self.peers.items())}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {f"influence.{peer}.{fragment}": r.agreed for (peer, fragment), r in self.pairs.items()}
        steps = {f"{peer}.{fragment}": r.step for (peer, fragment), r in self.pairs.items()}
        return tensors, {"learner": self.me, "steps": steps, "peers": self.report()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Restore from a checkpoint's records; a peer's checkpoint (records of its own pairs) leaves
        this learner with none, as a new learner starts."""
        self.pairs, self.peers = {}, {}
        if not isinstance(scalars, dict) or scalars.get("learner") != self.me:
            return
        for name, step in scalars.get("steps", {}).items():
            peer, fragment = map(int, name.split("."))
            if f"influence.{name}" in tensors:
                self.pairs[(peer, fragment)] = PairRecord(tensors[f"influence.{name}"], float(step))
        self.peers = {int(peer): PeerInfluence(**record) for peer, record in scalars.get("peers", {}).items()}
