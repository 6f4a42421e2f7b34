"""The exchange: what a learner sends its peers at the end of a round, what it takes from theirs,
and how both become the fragment's next anchor.

Each round exchanges one fragment (`training.exchange.fragments`). The learner hands the `Exchanger` its
weights; the exchanger takes the fragment's pseudo-gradient Δ = θ − x against the fragment's
anchor θ, and on the transport thread commits the message (compressed with error feedback when
the codec is lossy), then fetches and validates each peer's (`training.exchange.messages`), mixes them (the
sync mode) and takes the fragment's outer optimizer step, all while the learner goes on computing.
`tau` inner steps later the learner applies the exchange: the fragment moves to the new anchor plus
the local progress made since it was sent: x_f <- θ'_f + (x_f(now) − x_f(sent)).

The exchanger talks to the stores only through its channel (`training.exchange.channel.Channel`:
`submit`, `send`, `read_own`, `fetch`; the real one is `training.exchange.transport.Transport`), so it
is tested against a fake one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from infra import layout, watchdog
from infra.spec import LearnerSlot, RunSpec
from infra.store import IntegrityError, ObjectExists, StoreError, calls_end_by
from training.exchange.channel import Channel, MalformedMessage
from training.exchange.compression import Codec, ErrorFeedback
from training.events import emit
from training.exchange.fragments import FragmentLayout, exchange_count, fragment_of_round
from training.exchange.messages import ExpectedMessage, MessageRejected, accept_message, check_bounds
from training.exchange.mixing import (butterfly_partner, crosses_islands_in, mean_over_islands, mix_pair,
                                      slice_bounds, stage_count, weighted_mean)
from training.exchange.outer import OuterOptimizer, StateRejected


@dataclass(frozen=True)
class Received:
    peer: int
    fields: dict[str, torch.Tensor]
    tokens: int  # what the receiver's plan weighs the peer by, never the message's word


class SyncMode:
    """Who a learner's peers are in a round, which fields its message carries, how messages mix."""

    fields: tuple[str, ...]

    def peers(self, me: int, round_index: int, fragments: int, links: list[str],
              inter_island_every: int = 1) -> list[int]:
        raise NotImplementedError

    def mix(self, outer: OuterOptimizer, me: int, own: dict[str, torch.Tensor], tokens: int,
            received: list[Received]) -> torch.Tensor:
        """The fragment's next anchor."""
        raise NotImplementedError

    def period(self, fragments: int, learners: int, inter_island_every: int) -> int:
        """Rounds after which the pattern of peers and island crossings repeats: every fragment once."""
        return fragments


class Butterfly(SyncMode):
    """One partner per exchange, across the hypercube's dimension of the fragment's exchange count.
    Partners average anchors too (they may have drifted apart), so a message carries both."""

    fields = ("anchor", "delta")

    def peers(self, me, round_index, fragments, links, inter_island_every=1):
        exchange = exchange_count(round_index, fragments)
        partner = butterfly_partner(me, exchange, len(links))
        # Both partners see the pair as crossing or not, so both sit out together.
        if partner is None or (links[partner] == "inter" and
                               not crosses_islands_in(exchange, inter_island_every, stage_count(len(links)))):
            return []
        return [partner]

    def period(self, fragments, learners, inter_island_every):
        return fragments * stage_count(learners) * inter_island_every

    def mix(self, outer, me, own, tokens, received):
        if not received:
            return outer.step(own["anchor"], own["delta"])
        theirs = received[0]
        return outer.step(*mix_pair(own["anchor"], own["delta"], tokens, theirs.fields["anchor"],
                                    theirs.fields["delta"], theirs.tokens, me, theirs.peer))


class AllReduce(SyncMode):
    """Every other learner, inter-island peers first (they are the slow ones); all share one anchor,
    so only pseudo-gradients travel."""

    fields = ("delta",)

    def peers(self, me, round_index, fragments, links, inter_island_every=1):
        return sorted((p for p in range(len(links)) if p != me), key=lambda p: links[p] != "inter")

    def mix(self, outer, me, own, tokens, received):
        return outer.step(own["anchor"], mean_delta(me, own["delta"], tokens, received))


class Hierarchical(SyncMode):
    """An exact mean inside each island and the island's outer step along it every round; in every
    `inter_island_every`-th exchange of a fragment, right after that step, a crossing that gives every
    learner the islands' mean anchor (training/exchange/mixing.py). A round's peers are the learner's
    own island. In a crossing each learner reads, from the other islands, only the learners whose
    slices of the fragment overlap its own, takes the islands' mean of its slice, and shares that with
    its own island, whose mixed slices it reads back: a crossing's bytes over the slow link are one
    fragment's anchor per island pair, not per learner."""

    fields = ("delta",)

    def peers(self, me, round_index, fragments, links, inter_island_every=1):
        return [p for p in range(len(links)) if p != me and links[p] == "intra"]

    def period(self, fragments, learners, inter_island_every):
        return fragments * inter_island_every

    def crosses(self, round_index: int, fragments: int, inter_island_every: int) -> bool:
        return crosses_islands_in(exchange_count(round_index, fragments), inter_island_every)

    def crossing_sources(self, me: int, links: list[str], slices: list[tuple[int, int]]) -> list[int]:
        """Whose slices a learner reads in a crossing: the other islands' learners whose slice of the
        fragment (`slices`, per learner) overlaps its own; one per island where islands have as many
        learners."""
        start, end = slices[me]
        return [p for p in range(len(links)) if links[p] == "inter" and slices[p][0] < end and start < slices[p][1]]


def mean_delta(me: int, own_delta: torch.Tensor, tokens: int, received: list[Received]) -> torch.Tensor:
    """The token-weighted mean of this learner's pseudo-gradient and its peers'. Every learner sums in
    learner order, so all that heard the same peers agree bitwise."""
    messages = sorted([(me, own_delta, tokens)] + [(r.peer, r.fields["delta"], r.tokens) for r in received],
                      key=lambda item: item[0])
    return weighted_mean([m[1] for m in messages], [m[2] for m in messages])


SYNC_MODES: dict[str, SyncMode] = {"butterfly": Butterfly(), "allreduce": AllReduce(), "hierarchical": Hierarchical()}


def mode_period(spec: RunSpec) -> int:
    """The rounds after which the spec's mode repeats its peers and island crossings (`SyncMode.period`)."""
    sync = spec.sync
    return SYNC_MODES[sync.mode].period(sync.transport.fragments, len(spec.learners), sync.inter_island_every)


def first_crossing(spec: RunSpec) -> int:
    """The first round in which a learner hears from another island (0 where none ever does)."""
    mode, sync = SYNC_MODES[spec.sync.mode], spec.sync
    fragments, every = sync.transport.fragments, sync.inter_island_every
    links = [island_links(spec, slot.index) for slot in spec.learners]
    for t in range(mode_period(spec)):
        crosses = isinstance(mode, Hierarchical) and mode.crosses(t, fragments, every)
        if crosses or any(links[me][p] == "inter" for me in range(len(links))
                          for p in mode.peers(me, t, fragments, links[me], every)):
            return t
    return 0


# A learner's messages of a round: its round's message; in hierarchical mode, in a round that crosses
# islands, its slice of its island's anchor for the other islands, then that slice's islands' mean for
# its own island.
ROUND, CROSSING, MIXED = "round", "crossing", "mixed"
CROSSING_FIELDS = ("anchor",)  # the fields of a crossing's and of a mixed slice's message
CROSSING_RESIDUALS = "crossing."  # where a crossing's message keeps its error-feedback residuals


def islands_of(spec: RunSpec) -> list[list[int]]:
    """Each island's learners, islands and learners in order (learners are numbered island by island)."""
    return [[slot.index for slot in spec.learners if slot.island.name == island.name] for island in spec.islands]


def island_members(spec: RunSpec, learner: int) -> list[int]:
    """The learners of `learner`'s island, in order."""
    return next(members for members in islands_of(spec) if learner in members)


def island_links(spec: RunSpec, me: int) -> list[str]:
    """Per learner of the run: "intra" where it shares learner `me`'s island, else "inter"."""
    island = spec.learners[me].island.name
    return ["intra" if peer.island.name == island else "inter" for peer in spec.learners]


def crossing_slices(spec: RunSpec, sizes: list[int]) -> list[list[tuple[int, int]]]:
    """Per fragment (of `sizes` elements), per learner: the (start, end) of the slice of the fragment
    the learner carries across islands in hierarchical mode, its place in its island's slicing. A
    fragment with fewer elements than an island has learners leaves one with nothing to carry: refused."""
    for island in spec.islands:
        for fragment, size in enumerate(sizes):
            if size < island.learners:
                raise ValueError(f"sync.mode hierarchical: fragment {fragment} has {size} parameters, fewer than "
                                 f"island {island.name}'s {island.learners} learners, each of which carries a slice "
                                 f"of it across islands; use fewer fragments (sync.transport.fragments) or learners")
    members = [island_members(spec, slot.index) for slot in spec.learners]
    return [[slice_bounds(size, len(members[i]), members[i].index(i)) for i in range(len(spec.learners))]
            for size in sizes]


def message_key(fragments: int, learner: int, round_index: int, kind: str = ROUND) -> str:
    """Where learner `learner`'s message of `kind` (ROUND, CROSSING, MIXED) of a round lies."""
    fragment = fragment_of_round(round_index, fragments) if fragments > 1 else None
    key = {ROUND: layout.message, CROSSING: layout.crossing_message, MIXED: layout.mixed_slice_message}[kind]
    return key(learner, round_index, fragment)


def message_codec(spec: RunSpec, kind: str = ROUND) -> Codec:
    """How a message of `kind` is encoded: with the run's codec, but in hierarchical mode a message that
    stays inside its island (a round's, a mixed slice's), on the island's own fast path where its values
    are taken exactly, as fp32."""
    settings = spec.sync.transport
    if spec.sync.mode == "hierarchical" and kind != CROSSING:
        return Codec("none")
    return Codec(settings.compression, settings.scale_chunk, settings.topk)


def residual_fields(spec: RunSpec) -> tuple[str, ...]:
    """The error-feedback residuals a learner keeps, where its codec is lossy: a round message's two fields
    (not a hierarchical round's, which goes exact), and in hierarchical mode a crossing's own: it carries
    the island's values, not the learner's."""
    rounds = () if message_codec(spec).lossless else ("anchor", "delta")
    return rounds + (tuple(CROSSING_RESIDUALS + f for f in CROSSING_FIELDS) if spec.sync.mode == "hierarchical" else ())


def expected_message(spec: RunSpec, learner: int, round_index: int, numel: int, kind: str = ROUND) -> ExpectedMessage:
    """What learner `learner`'s message of `kind` of a round is by the run's plan, `numel` elements a
    field. A crossing's message (hierarchical mode) carries the learner's slice of its island's anchor,
    a mixed slice's the islands' mean of that slice."""
    settings = spec.sync.transport
    sliced = kind != ROUND
    return ExpectedMessage(learner=learner, round=round_index, fragment=fragment_of_round(round_index, settings.fragments),
                           tokens=spec.learners[learner].tokens_per_round(), numel=numel,
                           fields=CROSSING_FIELDS if sliced else SYNC_MODES[spec.sync.mode].fields,
                           anchor_from_initial=not message_codec(spec, kind).lossless,
                           slice_index=island_members(spec, learner).index(learner) if sliced else None,
                           mixed=kind == MIXED)


def partner_wait_s(sync, round_compute_s: float) -> float | None:
    """With `sync.partner_wait_rounds`, how long after its inner steps a learner waits for all of this
    round's peers together; None: each peer gets `sync.partner_timeout_s`."""
    if sync.partner_wait_rounds is None:
        return None
    return min(sync.partner_timeout_s, sync.partner_wait_rounds * round_compute_s)


@dataclass
class Fragment:
    """One fragment's exchange state: its positions in the flat parameter vector, its anchor (where
    it last synchronised) and its outer optimizer. Its error-feedback residual is the slice at
    `index` of the learner's `ErrorFeedback`."""

    number: int
    index: torch.Tensor
    anchor: torch.Tensor
    outer: OuterOptimizer
    # The outer optimizer's state (`OuterOptimizer.state`) after its latest applied step. Checkpoints
    # take it from here: the live optimizer may be in the middle of the next step on the transport thread.
    outer_state: tuple[dict[str, torch.Tensor], dict] = field(init=False)

    def __post_init__(self):
        self.outer_state = self.outer.state()


@dataclass
class Exchange:
    """A fragment's exchange in flight: sent at the end of `round`, applied `tau` steps later."""

    round: int
    fragment: int
    sent_weights: torch.Tensor | None = None  # the fragment's weights when it was sent
    result: Future | None = None  # the transport job's ExchangeResult


@dataclass
class Receipt:
    """What fetching one peer's message came to: the message, or why there is none."""

    peer: int
    message: Received | None
    reason: str | None = None
    link: str = "intra"
    bytes_read: int = 0
    corrupt: bool = False
    refused: bool = False  # the message came and was refused: damaged, or failing a peer message's checks


@dataclass
class Published:
    sent: dict[str, torch.Tensor]  # our message as peers decode it
    residual: dict[str, torch.Tensor]  # the error-feedback residual slices after it
    bytes_written: int


@dataclass
class ExchangeResult:
    sent: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]  # what our message was encoded from
    residual: dict[str, torch.Tensor]
    received: list[Received]
    bytes_sent: int
    bytes_read: dict[str, int] = field(default_factory=lambda: {"intra": 0, "inter": 0})
    missed: list[dict] = field(default_factory=list)
    corrupt_reads: int = 0
    refused: int = 0  # peers' messages that came and were refused
    anchor: torch.Tensor | None = None  # the fragment's next anchor: the mix after the outer step
    outer_state: tuple[dict[str, torch.Tensor], dict] | None = None  # the outer optimizer's, after that step
    crossing_residual: dict[str, torch.Tensor] = field(default_factory=dict)  # over this learner's slice
    seconds: dict[str, float] = field(default_factory=dict)  # the job's parts: publish, receive, cross, outer_step


class Exchanger:
    """A learner's side of every exchange, one `Fragment` per fragment of the model.

    `skipped(peer, round)` says whether a peer's restart skipped a round (its message never comes);
    `before_publish(round)` runs on the transport thread just before a message is written (fault
    injection corrupts that write)."""

    def __init__(self, spec: RunSpec, slot: LearnerSlot, channel: Channel, model: torch.nn.Module, initial: torch.Tensor,
                 skipped: Callable[[int, int], bool] = lambda peer, round_index: False,
                 before_publish: Callable[[int], None] = lambda round_index: None):
        self.spec, self.slot, self.channel = spec, slot, channel
        self.skipped, self.before_publish = skipped, before_publish
        settings = spec.sync.transport
        self.tau = settings.tau
        self.mode = SYNC_MODES[spec.sync.mode]
        self.layout = FragmentLayout.build(model, settings.fragments, settings.layout)
        shapes = {name: p.shape for name, p in model.named_parameters()}
        # Shampoo preconditions each weight matrix: every fragment's optimizer sees its parameters' shapes.
        self.fragments = [Fragment(f, index, initial[index].clone(),
                                   OuterOptimizer.from_spec(spec.sync.outer, [shapes[name] for name in names]))
                          for f, (index, names) in enumerate(zip(self.layout.indices, self.layout.names))]
        self.codec = message_codec(spec, CROSSING)  # every message but those inside a hierarchical island
        self.round_codec = message_codec(spec)
        # Compressed anchors travel as their difference from the run's initial weights, which every
        # learner rebuilds from the seed: quantisation then spends its levels on what training changed.
        self.initial = initial
        self.hierarchical = isinstance(self.mode, Hierarchical)
        self.feedback = ErrorFeedback(self.codec, initial.numel(), residual_fields(spec), settings.error_feedback)
        self.links = island_links(spec, slot.index)
        self.slices = crossing_slices(spec, self.layout.sizes) if self.hierarchical else []

    # -- the public face ------------------------------------------------------------------------

    def fragment_of(self, round_index: int) -> Fragment:
        return self.fragments[fragment_of_round(round_index, len(self.fragments))]

    def due(self, steps_since_sent: int) -> bool:
        """Whether an exchange sent `steps_since_sent` inner steps ago is applied now."""
        return steps_since_sent >= self.tau

    def start(self, round_index: int, fragment_weights: torch.Tensor, deadline: float | None = None) -> Exchange:
        """Queue this round's fragment's exchange on the transport thread; the learner goes on computing.
        `fragment_weights`: a copy of the fragment's weights (in the order of its `index`), which no one
        changes afterwards. `deadline` (monotonic seconds): when to stop waiting for all peers together."""
        fragment = self.fragment_of(round_index)
        # Anchors are replaced when an exchange is applied, never changed in place: the job may read this one.
        future = self.channel.submit(self._job_class(round_index), self._exchange, round_index, fragment.anchor,
                                       fragment_weights, deadline)
        return Exchange(round_index, fragment.number, fragment_weights, future)

    def apply(self, exchange: Exchange, fragment_weights: torch.Tensor) -> tuple[torch.Tensor, ExchangeResult]:
        """Wait for the exchange (if it is still in flight: its job mixes and takes the outer step);
        returns the fragment's new weights (the new anchor plus the progress made since it was sent).
        `fragment_weights`: the fragment's weights now, in the order of its `index`."""
        fragment = self.fragments[exchange.fragment]
        result: ExchangeResult = exchange.result.result()
        fragment.anchor, fragment.outer_state = result.anchor, result.outer_state
        self.feedback.commit(fragment.index, result.residual)
        if result.crossing_residual:
            self.feedback.commit(self._slice_positions(fragment, self.slot.index), result.crossing_residual)
        return fragment.anchor + (fragment_weights - exchange.sent_weights), result

    def publish(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor) -> Published:
        """Commit this round's message. If a previous life of this learner already sent one for the
        round, peers may have mixed with it: keep to what was sent."""
        self.before_publish(round_index)
        fragment = self.fragment_of(round_index)
        fields = {name: value for name, value in (("anchor", anchor), ("delta", delta)) if name in self.mode.fields}
        published = self._commit(round_index, self._message_key(self.slot.index, round_index),
                                 self._link_class(round_index), fields, fragment.index,
                                 self._expected(self.slot.index, round_index), self.round_codec)
        published.sent = {"anchor": published.sent.get("anchor", anchor), "delta": published.sent["delta"]}
        return published

    def _commit(self, round_index: int, key: str, link: str, fields: dict[str, torch.Tensor],
                positions: torch.Tensor, expected: ExpectedMessage, codec: Codec, residuals: str = "") -> Published:
        """Encode `fields` (their `positions` in the flat vector) with `codec`, with error feedback (the
        residuals under `residuals`) where it is lossy, and commit them under `key` as `expected`
        describes; `sent`: the fields as peers decode them."""
        if not codec.lossless:
            fields = {name: value - self.initial[positions] if name == "anchor" else value
                      for name, value in fields.items()}
        payload, decoded, residual = (dict(fields), dict(fields), {}) if codec.lossless else \
            self.feedback.encode(fields, positions, sparsify={"anchor": False}, residuals=residuals)
        nbytes = 0
        try:
            nbytes = self.channel.send(key, payload, expected.metadata(), link)
        except ObjectExists:
            try:
                sent, sent_meta, _ = self.channel.read_own(key, link, expected.max_bytes)
                decoded = accept_message(sent, sent_meta, expected, codec)
                # A previous life's message is close to what this life would send; one that is not
                # was not ours to adopt, whoever wrote it.
                check_bounds(decoded, fields)
                residual = {} if codec.lossless else self.feedback.residual_after(fields, positions, decoded, residuals)
            except (StoreError, MessageRejected) as err:
                # Someone else wrote our key first: peers refuse it as we do (or, if it passes their
                # checks, it is bounded like any peer's); mix with our own, keep the residual as it was.
                emit("own_message_refused", learner=self.slot.index, round=round_index, reason=str(err))
                decoded, residual = dict(fields), {}
        if not codec.lossless and "anchor" in decoded:
            decoded["anchor"] = decoded["anchor"] + self.initial[positions]
        return Published(decoded, residual, nbytes)

    def receive(self, peer: int, round_index: int, deadline: float | None = None,
                own: dict[str, torch.Tensor] | None = None) -> Receipt:
        """Fetch and validate a peer's message of a round, waiting for it until `deadline` (or, without
        one, `sync.partner_timeout_s`) unless the peer's restart skipped the round. `own`: this
        learner's anchor and pseudo-gradient of the fragment, which the message's values are bounded by.

        Whatever goes wrong with a peer's message is a missed exchange, never this learner's end: a
        store that refuses us, bytes of any shape, records that lie."""
        return self._receive(peer, round_index, self._message_key(peer, round_index), self._expected(peer, round_index),
                             self.round_codec, self.fragment_of(round_index).index, deadline, own)

    def _receive(self, peer: int, round_index: int, key: str, expected: ExpectedMessage, codec: Codec,
                 positions: torch.Tensor, deadline: float | None, own: dict[str, torch.Tensor] | None) -> Receipt:
        """`receive` of the message under `key`, encoded with `codec`, whose fields lie at `positions` of
        the flat vector."""
        try:
            return self._fetch(peer, round_index, key, expected, codec, positions, deadline, own)
        except Exception as err:  # noqa: BLE001 - a peer's data must cost an exchange, never the run
            return self._missed(peer, round_index, f"unreadable: {type(err).__name__}")

    def _fetch(self, peer: int, round_index: int, key: str, expected: ExpectedMessage, codec: Codec,
               positions: torch.Tensor, deadline: float | None, own: dict[str, torch.Tensor] | None) -> Receipt:
        timeout = self.spec.sync.partner_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        link = self.links[peer]
        wait_ends = time.monotonic() + timeout
        try:
            fetched = self.channel.fetch(peer, key, link, expected.max_bytes, timeout,
                                           give_up=lambda: self.skipped(peer, round_index))
            if fetched is None:
                with calls_end_by(wait_ends):  # why the wait ended is asked within it, not after it
                    skipped = self.skipped(peer, round_index)
                return self._missed(peer, round_index, "skipped by the peer's restart" if skipped else "deadline")
            payload, meta, nbytes = fetched
        except IntegrityError as err:
            return self._missed(peer, round_index, f"corrupt: {err}", corrupt=True, refused=True)
        except MalformedMessage as err:
            return self._missed(peer, round_index, f"refused: {err}", refused=True)
        except StoreError as err:  # the peer's store is out of reach: its site, or the link
            return self._missed(peer, round_index, f"unreachable: {err}")
        try:
            message = accept_message(payload, meta, expected, codec)
            if expected.anchor_from_initial and "anchor" in message:
                message["anchor"] = message["anchor"] + self.initial[positions]
            if own is not None:
                check_bounds(message, own)
        except MessageRejected as err:
            return self._missed(peer, round_index, f"refused: {err}", link=link, bytes_read=nbytes, refused=True)
        return Receipt(peer, Received(peer, message, expected.tokens), link=link, bytes_read=nbytes)

    # -- state ----------------------------------------------------------------------------------

    def anchors(self) -> torch.Tensor:
        """Every fragment's anchor, as one vector in flat-parameter order."""
        flat = torch.empty_like(self.initial)
        for fragment in self.fragments:
            flat[fragment.index] = fragment.anchor
        return flat

    def load_anchors(self, flat: torch.Tensor) -> None:
        for fragment in self.fragments:
            fragment.anchor = flat[fragment.index].float().cpu().clone()

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The outer optimizers' and error feedback's tensors, and the outer optimizers' scalars."""
        tensors, scalars = {}, {}
        if len(self.fragments) == 1:
            tensors, scalars = self.fragments[0].outer_state
        else:
            for fragment in self.fragments:
                fragment_tensors, scalars[f"fragment-{fragment.number}"] = fragment.outer_state
                tensors.update({f"fragment-{fragment.number}.{k}": v for k, v in fragment_tensors.items()})
        return {**tensors, **self.feedback.state_tensors()}, scalars

    def check_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Raise StateRejected unless `state_dict`'s output of a checkpoint fits fresh outer optimizers
        of this run (restored into throwaway ones, so this exchanger's own state is untouched)."""
        if not isinstance(scalars, dict):
            raise StateRejected("outer optimizer state: scalars are not an object")
        for fragment, fragment_tensors, fragment_scalars in self._outer_states(tensors, scalars):
            fresh = OuterOptimizer.from_spec(self.spec.sync.outer, [p.shape for p in fragment.outer.params])
            fresh.load_state(fragment_tensors, fragment_scalars)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        for fragment, fragment_tensors, fragment_scalars in self._outer_states(tensors, scalars):
            fragment.outer.load_state(fragment_tensors, fragment_scalars)
        self.feedback.load_state_tensors(tensors)
        for fragment in self.fragments:
            fragment.outer_state = fragment.outer.state()

    def _outer_states(self, tensors: dict[str, torch.Tensor], scalars: dict):
        """(fragment, its outer optimizer's tensors, its scalars) out of `state_dict`'s layout: the state
        as is with one fragment, under `fragment-<n>.` prefixes and keys with several."""
        if len(self.fragments) == 1:
            return [(self.fragments[0], tensors, scalars)]
        return [(fragment, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                 scalars.get(f"fragment-{fragment.number}", {}))
                for fragment in self.fragments for prefix in [f"fragment-{fragment.number}."]]

    # -- on the transport thread ----------------------------------------------------------------

    def _exchange(self, round_index: int, anchor: torch.Tensor, sent_weights: torch.Tensor,
                  deadline: float | None) -> ExchangeResult:
        began = time.monotonic()
        delta = anchor - sent_weights
        published = self.publish(round_index, anchor, delta)
        result = ExchangeResult(published.sent, {"anchor": anchor, "delta": delta}, published.residual, [],
                                published.bytes_written)
        result.seconds["publish"] = time.monotonic() - began
        for peer in self._peers(round_index):
            receipt = self.receive(peer, round_index, deadline, own={"anchor": anchor, "delta": delta})
            if self._book(result, receipt, round_index):
                result.received.append(receipt.message)
        mixing = time.monotonic()
        result.seconds["receive"] = mixing - began - result.seconds["publish"]
        # At most one exchange is in flight (tau is at most the inner steps), so this fragment's
        # optimizer steps for one exchange at a time, in round order.
        fragment = self.fragment_of(round_index)
        own = result.exact if self._mixes_own_exact() else result.sent
        if self.hierarchical:
            # The crossing's reads get as long as this round's reads had, from when they begin: a slice
            # comes only once its sender's own island has been heard.
            self._mix_hierarchical(result, round_index, fragment, own, None if deadline is None else
                                   time.monotonic() + max(0.0, deadline - began))
        else:
            result.anchor = self.mode.mix(fragment.outer, self.slot.index, own, self.slot.tokens_per_round(),
                                          result.received)
        result.outer_state = fragment.outer.state()
        result.seconds["outer_step"] = time.monotonic() - mixing - result.seconds.get("cross", 0.0)
        return result

    def _mix_hierarchical(self, result: ExchangeResult, round_index: int, fragment: Fragment,
                          own: dict[str, torch.Tensor], deadline: float | None) -> None:
        """The island's outer step along its mean pseudo-gradient; in a round that crosses islands, then
        the islands' mean of the anchors that step gave."""
        island_delta = mean_delta(self.slot.index, own["delta"], self.slot.tokens_per_round(), result.received)
        result.anchor = fragment.outer.step(own["anchor"], island_delta)
        if self._crosses(round_index):
            crossing = time.monotonic()
            result.anchor = self._cross(result, round_index, fragment, result.anchor, deadline)
            result.seconds["cross"] = time.monotonic() - crossing

    def _cross(self, result: ExchangeResult, round_index: int, fragment: Fragment, anchor: torch.Tensor,
               deadline: float | None) -> torch.Tensor:
        """Send this learner's slice of its island's new anchor to the other islands, read theirs of the
        same elements, and take the islands' mean of the slice (`mean_over_islands`); then share it with
        this learner's own island and read theirs back. A slice of another island that does not arrive
        leaves that island out of the slice's mean; a mixed slice of this island's that does not arrive
        leaves this learner with its island's own values there. A peer's slice is bounded by the island's
        own anchor there and by how far the island has moved since the run began (its pseudo-gradient
        over the whole run): islands that trained apart since the last crossing may lie much further
        apart than one round's step. Each phase's reads get as long as the first's had."""
        me, slices = self.slot.index, self.slices[fragment.number]
        allowed = None if deadline is None else max(0.0, deadline - time.monotonic())
        travelled = self.initial[fragment.index] - anchor

        def island_values(learner: int) -> dict[str, torch.Tensor]:
            start, end = slices[learner]
            return {"anchor": anchor[start:end], "delta": travelled[start:end]}

        exact = {"anchor": island_values(me)["anchor"]}
        published = self._commit(round_index, self._message_key(me, round_index, CROSSING),
                                 "inter" if "inter" in self.links else "intra", exact,
                                 self._slice_positions(fragment, me), self._expected(me, round_index, CROSSING),
                                 self.codec, residuals=CROSSING_RESIDUALS)
        result.bytes_sent += published.bytes_written
        result.crossing_residual = published.residual
        heard = {me: (exact if self._mixes_own_exact() else published.sent)["anchor"]}
        for peer in self.mode.crossing_sources(me, self.links, slices):
            receipt = self._receive(peer, round_index, self._message_key(peer, round_index, CROSSING),
                                    self._expected(peer, round_index, CROSSING), self.codec,
                                    self._slice_positions(fragment, peer), deadline, own=island_values(peer))
            if self._book(result, receipt, round_index, crossing=True):
                heard[peer] = receipt.message.fields["anchor"]
        mixed = mean_over_islands(int(fragment.index.numel()),
                                  [(sum(self.spec.learners[m].tokens_per_round() for m in members),
                                    [heard.get(m) for m in members]) for members in islands_of(self.spec)],
                                  span=slices[me])
        peers = self._peers(round_index)
        if peers:  # an island of one has no one to share the mix with
            # A previous life of this learner may have shared a different mix: its island holds that one.
            shared = self._commit(round_index, self._message_key(me, round_index, MIXED), "intra",
                                  {"anchor": mixed}, self._slice_positions(fragment, me),
                                  self._expected(me, round_index, MIXED), self.round_codec)
            result.bytes_sent += shared.bytes_written
            mixed = shared.sent["anchor"]
        crossed = anchor.clone()
        crossed[slices[me][0]:slices[me][1]] = mixed
        deadline = None if allowed is None else time.monotonic() + allowed
        for peer in peers:
            receipt = self._receive(peer, round_index, self._message_key(peer, round_index, MIXED),
                                    self._expected(peer, round_index, MIXED), self.round_codec,
                                    self._slice_positions(fragment, peer), deadline, own=island_values(peer))
            if self._book(result, receipt, round_index, crossing=True, mixed=True):
                crossed[slices[peer][0]:slices[peer][1]] = receipt.message.fields["anchor"]
        return crossed

    def _book(self, result: ExchangeResult, receipt: Receipt, round_index: int, **details) -> bool:
        """Count what reading a peer's message moved; record it as missed if it brought none (with
        `details`: which of a crossing's messages it was). Returns whether it brought one."""
        watchdog.progress()
        result.bytes_read[receipt.link] += receipt.bytes_read
        result.corrupt_reads += receipt.corrupt
        result.refused += receipt.refused
        if receipt.message is None:
            result.missed.append({"round": round_index, "peer": receipt.peer, "reason": receipt.reason, **details})
        return receipt.message is not None

    def _mixes_own_exact(self) -> bool:
        return self.spec.sync.transport.mix_own_exact and not self.codec.lossless

    def _crosses(self, round_index: int) -> bool:
        """Whether this round's exchange crosses islands in a second phase (hierarchical mode)."""
        return self.hierarchical and self.mode.crosses(round_index, len(self.fragments),
                                                       self.spec.sync.inter_island_every)

    def _slice_positions(self, fragment: Fragment, learner: int) -> torch.Tensor:
        """Positions in the flat vector of the slice of `fragment` that `learner` carries across islands."""
        start, end = self.slices[fragment.number][learner]
        return fragment.index[start:end]

    def _missed(self, peer: int, round_index: int, reason: str, **details) -> Receipt:
        emit("missed_exchange", learner=self.slot.index, peer=peer, round=round_index, reason=reason)
        return Receipt(peer, None, reason, **details)

    def _peers(self, round_index: int) -> list[int]:
        return self.mode.peers(self.slot.index, round_index, len(self.fragments), self.links,
                               self.spec.sync.inter_island_every)

    def _link_class(self, round_index: int) -> str:
        """A message travels as inter-island traffic when any of the round's peers is on another island."""
        return "inter" if any(self.links[p] == "inter" for p in self._peers(round_index)) else "intra"

    def _job_class(self, round_index: int) -> str:
        """The exchange's priority on the transport: inter-island when any of its messages crosses islands."""
        return "inter" if self._crosses(round_index) and "inter" in self.links else self._link_class(round_index)

    def _message_key(self, learner: int, round_index: int, kind: str = ROUND) -> str:
        return message_key(len(self.fragments), learner, round_index, kind)

    def _expected(self, learner: int, round_index: int, kind: str = ROUND) -> ExpectedMessage:
        """What learner `learner`'s message of `kind` of a round must be, by this learner's own plan."""
        fragment = self.fragment_of(round_index)
        start, end = self.slices[fragment.number][learner] if kind != ROUND else (0, int(fragment.index.numel()))
        return expected_message(self.spec, learner, round_index, end - start, kind)
