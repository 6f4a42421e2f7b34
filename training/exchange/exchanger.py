"""The exchange: what a learner sends its peers at the end of a round, what it takes from theirs,
and how both become the fragment's next anchor.

Each round exchanges one fragment (`training.exchange.fragments`). The learner hands the `Exchanger` its
weights; the exchanger takes the fragment's pseudo-gradient Δ = θ − x against the fragment's
anchor θ, and on the transport thread runs the round's phases as the sync mode plans them
(`training.exchange.modes`): it commits each message (compressed with error feedback when the codec is
lossy), fetches and validates each peer's (`training.exchange.messages`), and the mode mixes them and
takes the fragment's outer optimizer step, all while the learner goes on computing. `tau` inner steps
later the learner applies the exchange: the fragment moves to the new anchor plus the local progress
made since it was sent: x_f <- θ'_f + (x_f(now) − x_f(sent)).

The exchanger talks to the stores only through its channel (`training.exchange.channel.Channel`:
`submit`, `send`, `read_own`, `fetch`; the real one is `training.exchange.transport.Transport`), so it
is tested against a fake one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infra import watchdog
from infra.spec import LearnerSlot, RunSpec
from infra.retry import calls_end_by
from infra.store import IntegrityError, ObjectExists, StoreError
from training.events import emit
from training.exchange.channel import Channel, MalformedMessage
from training.exchange.compression import ErrorFeedback
from training.exchange.fragments import FragmentLayout, fragment_of_round
from training.exchange.influence import Influence
from training.exchange.messages import ExpectedMessage, MessageRejected, accept_message, check_bounds
from training.exchange.modes import Phase, sync_mode
from training.exchange.outer import OuterOptimizer, StateRejected
from training.exchange.plan import (CROSSING, CROSSING_RESIDUALS, ROUND, SCATTERED, Exchange, ExchangeResult, Published,
                                    Receipt, Received, expected_message, message_key)


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
        self.me = slot.index
        self.layout = FragmentLayout.build(model, settings.fragments, settings.layout)
        shapes = {name: p.shape for name, p in model.named_parameters()}
        self.mode = sync_mode(spec, [[shapes[name].numel() for name in names] for names in self.layout.names])
        # Shampoo preconditions each weight matrix: every fragment's optimizer sees its parameters' shapes,
        # those whose outer step this learner takes (`SyncMode.outer_span`).
        self.fragments = [Fragment(f, index, initial[index].clone(), OuterOptimizer.from_spec(
                                       spec.sync.outer, [shapes[names[i]] for i in self.mode.outer_parameters(f, self.me)]))
                          for f, (index, names) in enumerate(zip(self.layout.indices, self.layout.names))]
        # The reference anchors travel relative to, where the codec says so (`Codec.anchor_relative`).
        self.initial = initial
        self.codec = self.mode.run_codec
        self.feedback = ErrorFeedback(self.codec, initial.numel(), self.mode.residual_fields(), settings.error_feedback)
        self.links = self.mode.topology.links(slot.index)
        # How far each peer moved this learner's mixes; checkpoints take `applied_influence`, as of the
        # latest applied exchange, while the next one may be changing the live records.
        self.influence = Influence(self.me)
        self.applied_influence = self.influence.snapshot()

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
        self.applied_influence = result.influence or self.applied_influence
        self.feedback.commit(fragment.index, result.residual)
        if result.crossing_residual:
            self.feedback.commit(self._positions(fragment, self.me, CROSSING), result.crossing_residual)
        return fragment.anchor + (fragment_weights - exchange.sent_weights), result

    def publish(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor) -> Published:
        """Commit this round's message (or, with a sharded outer step, its scattered pseudo-gradient)."""
        self.before_publish(round_index)
        phase = self.mode.phases(self.me, round_index)[0]
        if phase.kind == SCATTERED:
            return self._scatter(round_index, anchor, delta, phase)
        fields = {name: value for name, value in (("anchor", anchor), ("delta", delta)) if name in self.mode.fields}
        published = self.commit(round_index, ROUND, fields, phase)
        published.sent = {"anchor": published.sent.get("anchor", anchor), "delta": published.sent["delta"]}
        return published

    def _scatter(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor, phase: Phase) -> Published:
        """Commit this round's pseudo-gradient on each peer's shard of the fragment's outer step to that
        peer. This learner's own shard is encoded as a peer's would be, unsent: its owner mixes what it
        would have sent, as every learner does with the whole message."""
        fragment, codec = self.fragment_of(round_index), self.mode.codec(SCATTERED)
        sent, residuals, nbytes = delta.clone(), [], 0
        for owner in self.mode.anchor_group(self.me):
            start, end = self.mode.outer_span(fragment.number, owner)
            if owner != self.me and end > start:
                published = self.commit(round_index, SCATTERED, {"delta": delta[start:end]}, phase, to=owner)
                decoded, residual, nbytes = published.sent["delta"], published.residual, nbytes + published.bytes_written
            elif codec.lossless:
                decoded, residual = delta[start:end], {}
            else:
                _, encoded, residual = self.feedback.encode({"delta": delta[start:end]}, fragment.index[start:end])
                decoded = encoded["delta"]
            sent[start:end] = decoded
            residuals.append(residual.get("delta", delta[start:end] - decoded))
        residual = {"delta": torch.cat(residuals)} if self.feedback.enabled and not codec.lossless else {}
        return Published({"anchor": anchor, "delta": sent}, residual, nbytes)

    def commit(self, round_index: int, kind: str, fields: dict[str, torch.Tensor], phase: Phase,
               to: int | None = None) -> Published:
        """Encode this learner's message of `kind` of a round (`fields`, over the fragment's elements the
        mode says it carries; a scattered one's, over those of the shard of `to`) with the mode's codec
        for it, with error feedback where that is lossy, and commit it; `sent`: the fields as peers decode
        them. If a previous life of this learner already committed one, peers may have mixed with it:
        keep to what was sent."""
        fragment, codec = self.fragment_of(round_index), self.mode.codec(kind)
        addressee = self.me if to is None else to
        positions = self._positions(fragment, addressee, kind)
        expected = self._expected(self.me, round_index, kind, to=to)
        key = self._key(self.me, round_index, kind, to)
        link = self._link_of([phase]) if to is None else self.links[to]
        residuals = CROSSING_RESIDUALS if kind == CROSSING else ""
        fields = codec.to_wire(fields, self.initial[positions])
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
                emit("own_message_refused", learner=self.me, round=round_index, reason=str(err))
                decoded, residual = dict(fields), {}
        return Published(codec.from_wire(decoded, self.initial[positions]), residual, nbytes)

    def receive(self, peer: int, round_index: int, deadline: float | None = None,
                own: dict[str, torch.Tensor] | None = None, kind: str = ROUND) -> Receipt:
        """Fetch and validate a peer's message of `kind` of a round, waiting for it until `deadline` (or,
        without one, `sync.partner_timeout_s`) unless the peer's restart skipped the round. `own`: this
        learner's anchor and pseudo-gradient over the same elements, which the message's values are
        bounded by.

        Whatever goes wrong with a peer's message is a missed exchange, never this learner's end: a
        store that refuses us, bytes of any shape, records that lie."""
        try:
            return self._fetch(peer, round_index, kind, deadline, own)
        except Exception as err:  # noqa: BLE001 - a peer's data must cost an exchange, never the run
            return self._missed(peer, round_index, f"unreadable: {type(err).__name__}")

    def _fetch(self, peer: int, round_index: int, kind: str, deadline: float | None,
               own: dict[str, torch.Tensor] | None) -> Receipt:
        fragment, codec = self.fragment_of(round_index), self.mode.codec(kind)
        to = self.me if kind == SCATTERED else None  # a scattered message is addressed to its shard's owner
        key, expected = self._key(peer, round_index, kind, to), self._expected(peer, round_index, kind, to=to)
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
            message = codec.from_wire(accept_message(payload, meta, expected, codec),
                                      self.initial[self._positions(fragment, peer if to is None else to, kind)])
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
        """The outer optimizers' and error feedback's tensors, and the outer optimizers' scalars, each
        fragment's with the shard of it they cover (`shard`: its `SyncMode.outer_span`)."""
        tensors, scalars = {}, {}
        for fragment in self.fragments:
            fragment_tensors, fragment_scalars = fragment.outer_state
            fragment_scalars = {**fragment_scalars, "shard": list(self._shard(fragment))}
            if len(self.fragments) == 1:
                tensors, scalars = fragment_tensors, fragment_scalars
            else:
                scalars[f"fragment-{fragment.number}"] = fragment_scalars
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

    def load_influence(self, tensors: dict[str, torch.Tensor], scalars: dict | None) -> None:
        self.influence.load_state_dict(tensors, scalars)
        self.applied_influence = self.influence.snapshot()

    def _outer_states(self, tensors: dict[str, torch.Tensor], scalars: dict):
        """(fragment, its outer optimizer's tensors, its scalars) out of `state_dict`'s layout: the state
        as is with one fragment, under `fragment-<n>.` prefixes and keys with several. A fragment's state
        of another shard than this learner's (a peer's checkpoint it rejoins from, whose place in their
        group differs) is left out: its optimizer starts afresh on its own shard."""
        if len(self.fragments) == 1:
            states = [(self.fragments[0], tensors, scalars)]
        else:
            states = [(fragment, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                       scalars.get(f"fragment-{fragment.number}", {}))
                      for fragment in self.fragments for prefix in [f"fragment-{fragment.number}."]]
        whole = lambda fragment: [0, int(fragment.index.numel())]  # noqa: E731 - a state saved unsharded
        return [(fragment, fragment_tensors, fragment_scalars) for fragment, fragment_tensors, fragment_scalars in states
                if not isinstance(fragment_scalars, dict)
                or fragment_scalars.get("shard", whole(fragment)) == list(self._shard(fragment))]

    # -- on the transport thread ----------------------------------------------------------------

    def _exchange(self, round_index: int, anchor: torch.Tensor, sent_weights: torch.Tensor,
                  deadline: float | None) -> ExchangeResult:
        began = time.monotonic()
        delta = anchor - sent_weights
        published = self.publish(round_index, anchor, delta)
        result = ExchangeResult(published.sent, {"anchor": anchor, "delta": delta}, published.residual, [],
                                published.bytes_written)
        result.seconds["publish"] = time.monotonic() - began
        first = self.mode.phases(self.me, round_index)[0]
        start, end = self.mode.span(self.fragment_of(round_index).number, self.me, first.kind)
        for peer in first.sources:
            receipt = self.receive(peer, round_index, deadline, kind=first.kind,
                                   own={"anchor": anchor[start:end], "delta": delta[start:end]})
            if self.book(result, receipt, round_index):
                result.received.append(receipt.message)
        mixing = time.monotonic()
        result.seconds["receive"] = mixing - began - result.seconds["publish"]
        # At most one exchange is in flight (tau is at most the inner steps), so this fragment's
        # optimizer steps for one exchange at a time, in round order.
        fragment = self.fragment_of(round_index)
        own = result.exact if self.mixes_own_exact() else result.sent
        # A later phase's reads get as long as this round's reads had, from when they begin: a slice
        # comes only once its sender's own island has been heard.
        later = None if deadline is None else time.monotonic() + max(0.0, deadline - began)
        result.anchor = self.mode.next_anchor(self, round_index, fragment.outer, own, result, later)
        result.outer_state, result.influence = fragment.outer.state(), self.influence.snapshot()
        result.seconds["outer_step"] = time.monotonic() - mixing - result.seconds.get("cross", 0.0)
        return result

    def book(self, result: ExchangeResult, receipt: Receipt, round_index: int, **details) -> bool:
        """Count what reading a peer's message moved; record it as missed if it brought none (with
        `details`: which of a crossing's messages it was). Returns whether it brought one."""
        watchdog.progress()
        result.bytes_read[receipt.link] += receipt.bytes_read
        result.corrupt_reads += receipt.corrupt
        result.refused += receipt.refused
        if receipt.refused:
            self.influence.refused(receipt.peer)
        if receipt.message is None:
            result.missed.append({"round": round_index, "peer": receipt.peer, "reason": receipt.reason, **details})
        return receipt.message is not None

    def mixes_own_exact(self) -> bool:
        return self.spec.sync.transport.mix_own_exact and not self.codec.lossless

    def _shard(self, fragment: Fragment) -> tuple[int, int]:
        return self.mode.outer_span(fragment.number, self.me)

    def _positions(self, fragment: Fragment, learner: int, kind: str) -> torch.Tensor:
        """Positions in the flat vector of what `learner`'s message of `kind` carries of `fragment`."""
        start, end = self.mode.span(fragment.number, learner, kind)
        return fragment.index[start:end]

    def _missed(self, peer: int, round_index: int, reason: str, **details) -> Receipt:
        emit("missed_exchange", learner=self.me, peer=peer, round=round_index, reason=reason)
        return Receipt(peer, None, reason, **details)

    def _link_of(self, phases: list[Phase]) -> str:
        """A message, or a job, travels as inter-island traffic when any of its phases' peers is on another island."""
        return "inter" if any(self.links[p] == "inter" for phase in phases for p in phase.sources) else "intra"

    def _job_class(self, round_index: int) -> str:
        """The exchange's priority on the transport: inter-island when any of its messages crosses islands."""
        return self._link_of(self.mode.phases(self.me, round_index))

    def _expected(self, learner: int, round_index: int, kind: str = ROUND, to: int | None = None) -> ExpectedMessage:
        """What learner `learner`'s message of `kind` (to learner `to`) of a round must be, by this learner's own plan."""
        start, end = self.mode.span(self.fragment_of(round_index).number, learner if to is None else to, kind)
        return expected_message(self.mode, learner, round_index, end - start, kind, to=to)

    def _key(self, learner: int, round_index: int, kind: str, to: int | None) -> str:
        return message_key(len(self.fragments), learner, round_index, kind,
                           shard=None if to is None else self.mode.position(to))
