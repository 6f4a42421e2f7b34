"""The exchange, attached to a learner's loop as one object.

The loop hands it each round's end (`end_round`): it sends the round's fragment to the exchanger
(`training.exchange.exchanger`), which mixes on the transport thread while the next round computes.
A hook after every inner optimizer step (`after_step`) applies the exchange in flight once it is due,
`sync.transport.tau` steps later; with tau 0, and in the last round, it is applied at once. Rank 0 talks
to the stores and computes the fragment's new weights; every rank takes part in gathering the fragment
and receives its new weights.
"""

from __future__ import annotations

import math
import time

import torch

from training.exchange.exchanger import Exchanger
from training.exchange.plan import Exchange, partner_wait_s
from training.learner.ledger import Ledger
from training.model.parallel import LearnerParallelism


class LearnerDiverged(RuntimeError):
    """The learner's own training produced non-finite values; a message of them would poison every peer."""


class RoundSync:
    def __init__(self, exchanger: Exchanger, parallel: LearnerParallelism, fragment_parameters: list[list],
                 ledger: Ledger, sync_spec, lead: bool):
        self.exchanger, self.parallel, self.ledger, self.sync_spec = exchanger, parallel, ledger, sync_spec
        # Each fragment's parameters in flat order: a fragment's weights are read and written through
        # them, never through a copy of the whole model.
        self.fragment_parameters, self.lead = fragment_parameters, lead
        self.pending: Exchange | None = None
        self.steps_since_sent = 0
        self.seconds = 0.0  # this round's time spent syncing rather than computing

    def begin_round(self) -> None:
        self.seconds = 0.0

    def after_step(self, round_index: int, steps_done: int) -> None:
        """After an inner optimizer step: apply the exchange in flight once it is due."""
        self.steps_since_sent += 1
        if self.pending is not None and self.exchanger.due(self.steps_since_sent):
            self.apply()

    def end_round(self, round_index: int, loss: float, round_started: float, last: bool) -> None:
        """Send the round's fragment (after applying an exchange still in flight: tau equals the
        round's inner steps); apply it at once with tau 0 or in the last round, whose mix the final
        checkpoint holds. `round_started` (monotonic): the round's computing bounds the wait for peers."""
        if self.pending is not None:
            self.apply()
        sending = time.monotonic()
        wait = partner_wait_s(self.sync_spec, sending - round_started - self.seconds)
        fragment = self.exchanger.fragment_of(round_index).number
        sent = self.fragment_weights(fragment)
        if self.lead:
            if not math.isfinite(loss) or not bool(torch.isfinite(sent).all()):
                raise LearnerDiverged(f"learner {self.exchanger.me} round {round_index + 1}: its inner loss ({loss}) "
                                      "or weights are not finite; stopping instead of sending them to its peers")
            self.pending = self.exchanger.start(round_index, sent, None if wait is None else sending + wait)
        else:
            self.pending = Exchange(round_index, fragment)
        self.steps_since_sent = 0
        self.seconds += time.monotonic() - sending
        if self.exchanger.due(0) or last:
            self.apply()

    def resume(self, pending: dict | None) -> None:
        """Send again the exchange a checkpoint held in flight (the same bytes: write-once makes the re-send
        a no-op), to be applied at the same point, so its mix is applied exactly once."""
        if pending is None:
            return
        self.pending, self.steps_since_sent = Exchange(pending["round"], pending["fragment"]), 0
        sent = self.fragment_weights(self.pending.fragment)
        if self.lead:
            self.pending = self.exchanger.start(self.pending.round, sent)

    def apply(self) -> None:
        """Apply the exchange in flight; rank 0 computes the fragment's new weights and tells the others."""
        exchange, self.pending = self.pending, None
        began = time.monotonic()
        fragment_weights = self.fragment_weights(exchange.fragment)
        if self.lead:
            fragment_weights, result = self.exchanger.apply(exchange, fragment_weights)
            self.ledger.book_exchange(exchange.round, exchange.fragment, result, time.monotonic() - began)
        self.parallel.scatter(fragment_weights, self.fragment_parameters[exchange.fragment])
        self.seconds += time.monotonic() - began

    def fragment_weights(self, fragment: int) -> torch.Tensor | None:
        """A copy of a fragment's weights, on the CPU, in the order of its index in the flat vector, on
        rank 0 (None on the others). Every rank calls it: a sharded learner gathers the fragment."""
        return self.parallel.gather(self.fragment_parameters[fragment])
