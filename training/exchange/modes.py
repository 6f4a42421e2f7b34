"""Sync modes: who a learner's peers are in each round, which phases a round's exchange has, what each
message carries and how it is encoded, and how what arrived becomes the fragment's next anchor.

A mode is built with its run's settings (`sync_mode`) and is asked the same questions by the learner's
exchanger, which runs its phases (`training.exchange.exchanger`), and by the planner, which replays them
(`training.planning.planner`). The mixing rules are in `training.exchange.mixing`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from infra.spec import RunSpec
from training.exchange.compression import Codec
from training.exchange.fragments import exchange_count, fragment_of_round, whole_parameter_shards
from training.exchange.mixing import (butterfly_partner, crosses_islands_in, mean_over_islands, mix_pair, slice_bounds,
                                      stage_count, weighted_mean)
from training.exchange.influence import Influence
from training.exchange.outer import OuterOptimizer
from training.exchange.plan import (CROSSING, CROSSING_FIELDS, CROSSING_RESIDUALS, MIXED, ROUND, SCATTERED, STEPPED,
                                    ExchangeResult, Received)
from training.exchange.topology import Topology


@dataclass(frozen=True)
class Phase:
    """One step of a learner's exchange in a round: it writes its message of `kind` (where `writes`) and
    reads those of `sources`, in order."""

    kind: str
    sources: tuple[int, ...]
    writes: bool = True


class SyncMode:
    """A mode of one run. `fragment_parameters`, where given, are the element counts of each fragment's
    parameters, in order (a mode that slices or shards fragments needs them to run or plan a round).
    `shard_outer_step`: learners that share an anchor each step their own shard of it (`anchor_group`)."""

    fields: ClassVar[tuple[str, ...]]

    def __init__(self, topology: Topology, codec: Codec, fragments: int, inter_island_every: int = 1,
                 fragment_parameters: list[list[int]] | None = None, shard_outer_step: bool = False):
        self.topology, self.run_codec, self.fragments = topology, codec, fragments
        self.inter_island_every, self.fragment_parameters = inter_island_every, fragment_parameters
        self.fragment_sizes = None if fragment_parameters is None else [sum(p) for p in fragment_parameters]
        self.sharded = shard_outer_step and any(len(self.anchor_group(me)) > 1 for me in range(topology.learners))

    def anchor_group(self, me: int) -> tuple[int, ...]:
        """The learners that hold the same anchor as learner `me` when no message is missed: they mix
        the same messages the same way."""
        return (me,)

    def position(self, learner: int) -> int:
        """The learner's place in its anchor group: which shard of a fragment's outer step it takes."""
        return self.anchor_group(learner).index(learner)

    def outer_span(self, fragment: int, learner: int) -> tuple[int, int]:
        """The (start, end) of the fragment's elements whose outer step the learner takes and whose outer
        optimizer state it keeps: whole parameters, the whole fragment unless the step is sharded."""
        if not self.sharded:
            return 0, self.fragment_sizes[fragment]
        shards = whole_parameter_shards(self.fragment_parameters[fragment], len(self.anchor_group(learner)))
        return shards[self.position(learner)]

    def outer_parameters(self, fragment: int, learner: int) -> range:
        """Which of the fragment's parameters (by their place in it) `outer_span` covers."""
        bounds = list(itertools.accumulate(self.fragment_parameters[fragment], initial=0))
        start, end = self.outer_span(fragment, learner)
        return range(bounds.index(start), bounds.index(end))

    def peers(self, me: int, round_index: int) -> list[int]:
        raise NotImplementedError

    def phases(self, me: int, round_index: int) -> list[Phase]:
        """The round's phases for learner `me`: the round's message to its peers; with a sharded outer
        step instead its pseudo-gradient on each peer's shard to that peer (a reduce-scatter), then its
        shard of the anchor its step gave to them all (an all-gather). A learner with an empty shard (a
        fragment of fewer parameters than its group has learners) reads no pseudo-gradient and sends no shard."""
        peers = tuple(self.peers(me, round_index))
        if not self.sharded:
            return [Phase(ROUND, peers)]
        fragment = fragment_of_round(round_index, self.fragments)
        holds = [p for p in peers if self._holds_shard(fragment, p)]
        owns = self._holds_shard(fragment, me)
        return [Phase(SCATTERED, peers if owns else ()), Phase(STEPPED, tuple(holds), writes=owns)]

    def _holds_shard(self, fragment: int, learner: int) -> bool:
        start, end = self.outer_span(fragment, learner)
        return end > start

    def period(self) -> int:
        """Rounds after which the pattern of peers and island crossings repeats: every fragment once."""
        return self.fragments

    def first_crossing(self) -> int:
        """The first round in which a learner hears from another island (0 where none ever does)."""
        for t in range(self.period()):
            for me in range(self.topology.learners):
                links = self.topology.links(me)
                if any(links[p] == "inter" for p in self.peers(me, t)):
                    return t
        return 0

    def span(self, fragment: int, learner: int, kind: str) -> tuple[int, int]:
        """The (start, end) of the fragment's elements that `learner`'s message of `kind` carries; of a
        scattered one, those of the shard of `learner`, its addressee."""
        if kind in (STEPPED, SCATTERED):
            return self.outer_span(fragment, learner)
        return 0, self.fragment_sizes[fragment]

    def codec(self, kind: str = ROUND) -> Codec:
        """How a message of `kind` is encoded: a shard of the anchor exactly, which every learner of its
        group takes as it is; the others with the run's codec."""
        return Codec("none") if kind == STEPPED else self.run_codec

    def residual_fields(self) -> tuple[str, ...]:
        """The error-feedback residuals a learner keeps where its codec is lossy: its round message's fields."""
        return () if self.codec(ROUND).lossless else ("anchor", "delta")

    def next_anchor(self, runtime, round_index: int, outer: OuterOptimizer, own: dict[str, torch.Tensor],
                    result: ExchangeResult, deadline: float | None) -> torch.Tensor:
        """The fragment's next anchor once the round's message is sent and its peers' read (`result`).
        `runtime`: the learner's `Exchanger`, for a mode with later phases, whose reads end by `deadline`."""
        raise NotImplementedError

    def shared_step(self, runtime, round_index: int, outer: OuterOptimizer, own: dict[str, torch.Tensor],
                    result: ExchangeResult, deadline: float | None) -> torch.Tensor:
        """The outer step from the group's shared anchor along its mean pseudo-gradient (of `own` and what
        `result` received). Sharded: what arrived is each peer's pseudo-gradient on this learner's shard;
        it steps the shard, shares it with its group and takes theirs. A shard that does not arrive
        stays where the anchor was, until its owner's next step: a group's shards are their owners'."""
        me, fragment = runtime.me, runtime.fragment_of(round_index)
        start, end = self.outer_span(fragment.number, me)
        anchor = own["anchor"]
        mean = mean_delta(me, own["delta"][start:end], self.topology.tokens[me], result.received, runtime.influence)
        stepped = outer.step(anchor[start:end], mean)
        if not self.sharded:
            return stepped
        phase = self.phases(me, round_index)[1]
        if phase.writes:
            shared = runtime.commit(round_index, STEPPED, {"anchor": stepped}, phase)
            result.bytes_sent += shared.bytes_written
        assembled = anchor.clone()
        assembled[start:end] = stepped
        shards = {me: (start, end)} if end > start else {}
        for peer in phase.sources:
            low, high = self.outer_span(fragment.number, peer)
            receipt = runtime.receive(peer, round_index, deadline, kind=STEPPED,
                                      own={"anchor": anchor[low:high], "delta": own["delta"][low:high]})
            if runtime.book(result, receipt, round_index, stepped=True):
                assembled[low:high] = receipt.message.fields["anchor"]
                shards[peer] = (low, high)
        return runtime.influence.clip_shards(anchor, assembled, shards)


class Butterfly(SyncMode):
    """One partner per exchange, across the hypercube's dimension of the fragment's exchange count.
    Partners average anchors too (they may have drifted apart), so a message carries both."""

    fields = ("anchor", "delta")

    def peers(self, me, round_index):
        exchange = exchange_count(round_index, self.fragments)
        partner = butterfly_partner(me, exchange, self.topology.learners)
        # Both partners see the pair as crossing or not, so both sit out together.
        if partner is None or (self.topology.links(me)[partner] == "inter" and not crosses_islands_in(
                exchange, self.inter_island_every, stage_count(self.topology.learners))):
            return []
        return [partner]

    def period(self):
        return self.fragments * stage_count(self.topology.learners) * self.inter_island_every

    def next_anchor(self, runtime, round_index, outer, own, result, deadline):
        if not result.received:
            return outer.step(own["anchor"], own["delta"])
        theirs, fragment = result.received[0], runtime.fragment_of(round_index).number
        # Both partners clip the pair's messages alike, bounded by what the pair last agreed (`Influence`).
        own, peer = runtime.influence.clip_pair(theirs.peer, fragment, own, theirs.fields,
                                                stage_count(self.topology.learners))
        anchor = outer.step(*mix_pair(own["anchor"], own["delta"], self.topology.tokens[runtime.me],
                                      peer["anchor"], peer["delta"], theirs.tokens, runtime.me, theirs.peer))
        runtime.influence.agreed(theirs.peer, fragment, anchor)
        return anchor


class AllReduce(SyncMode):
    """Every other learner, inter-island peers first (they are the slow ones); all share one anchor,
    so only pseudo-gradients travel."""

    fields = ("delta",)

    def __init__(self, topology, codec, fragments, inter_island_every=1, fragment_parameters=None,
                 shard_outer_step=False):
        if inter_island_every > 1:
            raise ValueError(f"sync.inter_island_every: {inter_island_every} needs mode butterfly or hierarchical "
                             "(allreduce has no crossings to skip)")
        super().__init__(topology, codec, fragments, inter_island_every, fragment_parameters, shard_outer_step)

    def anchor_group(self, me):
        return tuple(range(self.topology.learners))

    def peers(self, me, round_index):
        links = self.topology.links(me)
        return sorted((p for p in range(self.topology.learners) if p != me), key=lambda p: links[p] != "inter")

    def next_anchor(self, runtime, round_index, outer, own, result, deadline):
        return self.shared_step(runtime, round_index, outer, own, result, deadline)


class Hierarchical(SyncMode):
    """An exact mean inside each island and the island's outer step along it every round; in every
    `inter_island_every`-th exchange of a fragment, right after that step, a crossing that gives every
    learner the islands' mean anchor (training/exchange/mixing.py). A round's peers are the learner's
    own island. In a crossing each learner reads, from the other islands, only the learners whose
    slices of the fragment overlap its own, takes the islands' mean of its slice, and shares that with
    its own island, whose mixed slices it reads back: a crossing's bytes over the slow link are one
    fragment's anchor per island pair, not per learner. Messages inside an island, on its own fast
    path where its values are taken exactly, go as fp32; crossings use the run's codec."""

    fields = ("delta",)

    def __init__(self, topology, codec, fragments, inter_island_every=1, fragment_parameters=None,
                 shard_outer_step=False):
        super().__init__(topology, codec, fragments, inter_island_every, fragment_parameters, shard_outer_step)
        # Per fragment, per learner: the (start, end) of the slice of the fragment it carries across islands.
        self.slices = [] if self.fragment_sizes is None else self.carried_slices(self.fragment_sizes)

    def carried_slices(self, sizes: list[int]) -> list[list[tuple[int, int]]]:
        """Per fragment (of `sizes` elements), per learner: the slice of the fragment the learner carries
        across islands, its place in its island's slicing. A fragment with fewer elements than an island
        has learners leaves one with nothing to carry: refused."""
        for name, members in zip(self.topology.names, self.topology.islands):
            for fragment, size in enumerate(sizes):
                if size < len(members):
                    raise ValueError(f"sync.mode hierarchical: fragment {fragment} has {size} parameters, fewer than "
                                     f"island {name}'s {len(members)} learners, each of which carries a slice "
                                     "of it across islands; use fewer fragments (sync.transport.fragments) or learners")
        members = [self.topology.members(i) for i in range(self.topology.learners)]
        return [[slice_bounds(size, len(members[i]), members[i].index(i)) for i in range(self.topology.learners)]
                for size in sizes]

    def anchor_group(self, me):
        return self.topology.members(me)

    def span(self, fragment, learner, kind):
        return self.slices[fragment][learner] if kind in (CROSSING, MIXED) else super().span(fragment, learner, kind)

    def peers(self, me, round_index):
        links = self.topology.links(me)
        return [p for p in range(self.topology.learners) if p != me and links[p] == "intra"]

    def period(self):
        return self.fragments * self.inter_island_every

    def crosses(self, round_index: int) -> bool:
        return crosses_islands_in(exchange_count(round_index, self.fragments), self.inter_island_every)

    def first_crossing(self):
        return next((t for t in range(self.period()) if self.crosses(t)), 0)

    def phases(self, me, round_index):
        island = tuple(self.peers(me, round_index))
        if not self.crosses(round_index):
            return super().phases(me, round_index)
        slices = self.slices[fragment_of_round(round_index, self.fragments)]
        # An island of one has no one to share its mix with.
        return super().phases(me, round_index) + [Phase(CROSSING, self.crossing_sources(me, slices)),
                                                  Phase(MIXED, island, writes=bool(island))]

    def crossing_sources(self, me: int, slices: list[tuple[int, int]]) -> tuple[int, ...]:
        """Whose slices a learner reads in a crossing: the other islands' learners whose slice of the
        fragment (`slices`, per learner) overlaps its own; one per island where islands have as many
        learners."""
        start, end = slices[me]
        links = self.topology.links(me)
        return tuple(p for p in range(self.topology.learners)
                     if links[p] == "inter" and slices[p][0] < end and start < slices[p][1])

    def codec(self, kind=ROUND):
        """Inside the island, on its own fast path, exactly; a crossing with the run's codec."""
        return self.run_codec if kind == CROSSING else Codec("none")

    def residual_fields(self):
        """A crossing's own residuals: it carries the island's values, not the learner's."""
        return tuple(CROSSING_RESIDUALS + f for f in CROSSING_FIELDS)

    def next_anchor(self, runtime, round_index, outer, own, result, deadline):
        """The island's outer step along its mean pseudo-gradient; in a round that crosses islands, then
        the islands' mean of the anchors that step gave."""
        me = runtime.me
        anchor = self.shared_step(runtime, round_index, outer, own, result, deadline)
        if self.crosses(round_index):
            crossing = time.monotonic()
            anchor = self._cross(runtime, round_index, anchor, self.phases(me, round_index)[-2:], result, deadline)
            result.seconds["cross"] = time.monotonic() - crossing
        return anchor

    def _cross(self, runtime, round_index: int, anchor: torch.Tensor, phases: list[Phase], result: ExchangeResult,
               deadline: float | None) -> torch.Tensor:
        """Send this learner's slice of its island's new anchor to the other islands, read theirs of the
        same elements, and take the islands' mean of the slice (`mean_over_islands`); then share it with
        this learner's own island and read theirs back. A slice of another island that does not arrive
        leaves that island out of the slice's mean; a mixed slice of this island's that does not arrive
        leaves this learner with its island's own values there. A peer's slice is bounded by the island's
        own anchor there and by how far the island has moved since the run began (its pseudo-gradient
        over the whole run): islands that trained apart since the last crossing may lie much further
        apart than one round's step. Each phase's reads get as long as the first's had."""
        me, fragment = runtime.me, runtime.fragment_of(round_index)
        slices = self.slices[fragment.number]
        crossing, mixed_phase = phases
        allowed = None if deadline is None else max(0.0, deadline - time.monotonic())
        travelled = runtime.initial[fragment.index] - anchor

        def island_values(learner: int) -> dict[str, torch.Tensor]:
            start, end = slices[learner]
            return {"anchor": anchor[start:end], "delta": travelled[start:end]}

        exact = {"anchor": island_values(me)["anchor"]}
        published = runtime.commit(round_index, CROSSING, exact, crossing)
        result.bytes_sent += published.bytes_written
        result.crossing_residual = published.residual
        heard = {me: (exact if runtime.mixes_own_exact() else published.sent)["anchor"]}
        for peer in crossing.sources:
            receipt = runtime.receive(peer, round_index, deadline, own=island_values(peer), kind=CROSSING)
            if runtime.book(result, receipt, round_index, crossing=True):
                heard[peer] = receipt.message.fields["anchor"]
        mixed = mean_over_islands(int(fragment.index.numel()),
                                  [(tokens, [heard.get(m) for m in members]) for tokens, members
                                   in zip(self.topology.island_tokens(), self.topology.islands)],
                                  span=slices[me])
        if mixed_phase.writes:
            # A previous life of this learner may have shared a different mix: its island holds that one.
            shared = runtime.commit(round_index, MIXED, {"anchor": mixed}, mixed_phase)
            result.bytes_sent += shared.bytes_written
            mixed = shared.sent["anchor"]
        crossed = anchor.clone()
        crossed[slices[me][0]:slices[me][1]] = mixed
        deadline = None if allowed is None else time.monotonic() + allowed
        for peer in mixed_phase.sources:
            receipt = runtime.receive(peer, round_index, deadline, own=island_values(peer), kind=MIXED)
            if runtime.book(result, receipt, round_index, crossing=True, mixed=True):
                crossed[slices[peer][0]:slices[peer][1]] = receipt.message.fields["anchor"]
        return crossed


def mean_delta(me: int, own_delta: torch.Tensor, tokens: int, received: list[Received],
               influence: Influence) -> torch.Tensor:
    """The token-weighted mean of this learner's pseudo-gradient and its peers', each clipped to a
    multiple of the median member's norm (`Influence.clip_members`: one bad member does not carry
    the mean). Every learner clips and sums in learner order, so all that heard the same peers agree bitwise."""
    messages = influence.clip_members(sorted(
        [(me, own_delta, tokens)] + [(r.peer, r.fields["delta"], r.tokens) for r in received], key=lambda item: item[0]))
    return weighted_mean([m[1] for m in messages], [m[2] for m in messages])


MODES: dict[str, type[SyncMode]] = {"butterfly": Butterfly, "allreduce": AllReduce, "hierarchical": Hierarchical}


def sync_mode(spec: RunSpec, fragment_parameters: list[list[int]] | None = None) -> SyncMode:
    """The spec's sync mode, built with the run's settings; `fragment_parameters`: see `SyncMode`."""
    sync, transport = spec.sync, spec.sync.transport
    return MODES[sync.mode](Topology.of(spec), Codec(transport.compression, transport.scale_chunk, transport.topk),
                            transport.fragments, sync.inter_island_every, fragment_parameters, sync.shard_outer_step)
