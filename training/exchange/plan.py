"""The message plan: the kinds of message a round's exchange writes, where each lies, what its reader
expects of it, and the records an exchange leaves behind.

A learner's messages of a round: its round's message (`ROUND`); in hierarchical mode, in a round that
crosses islands, its slice of its island's anchor for the other islands (`CROSSING`), then that slice's
islands' mean for its own island (`MIXED`); where learners that share an anchor each step their own shard
of it, its pseudo-gradient on each of their shards for its owner (`SCATTERED`, in place of the round's
message) and then its own shard of the new anchor for them (`STEPPED`). Which of them a round has, and who reads whose, is the
sync mode's (`training.exchange.modes`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from infra import layout
from training.exchange.fragments import fragment_of_round
from training.exchange.messages import ExpectedMessage

ROUND, CROSSING, MIXED, STEPPED, SCATTERED = "round", "crossing", "mixed", "stepped", "scattered"
CROSSING_FIELDS = ("anchor",)  # the fields of a crossing's and of a mixed slice's message
CROSSING_RESIDUALS = "crossing."  # where a crossing's message keeps its error-feedback residuals


def message_key(fragments: int, learner: int, round_index: int, kind: str = ROUND, shard: int | None = None) -> str:
    """Where learner `learner`'s message of `kind` of a round lies; a scattered one's, for the owner of
    shard `shard`."""
    fragment = fragment_of_round(round_index, fragments) if fragments > 1 else None
    if kind == SCATTERED:
        return layout.scattered_message(learner, round_index, fragment, shard)
    key = {ROUND: layout.message, CROSSING: layout.crossing_message, MIXED: layout.mixed_slice_message,
           STEPPED: layout.stepped_slice_message}[kind]
    return key(learner, round_index, fragment)


def expected_message(mode, learner: int, round_index: int, numel: int, kind: str = ROUND,
                     to: int | None = None) -> ExpectedMessage:
    """What learner `learner`'s message of `kind` of a round is by the run's plan (`mode`: the run's
    `SyncMode`), `numel` elements a field. A crossing's message carries the learner's slice of its
    island's anchor, a mixed slice's the islands' mean of that slice, a stepped shard's the anchor its
    outer step gave there, a scattered one its pseudo-gradient on the shard of learner `to`."""
    sliced = kind != ROUND
    fields = ("delta",) if kind == SCATTERED else CROSSING_FIELDS if sliced else mode.fields
    return ExpectedMessage(learner=learner, round=round_index, fragment=fragment_of_round(round_index, mode.fragments),
                           tokens=mode.topology.tokens[learner], numel=numel, fields=fields,
                           anchor_from_initial=mode.codec(kind).anchor_relative,
                           slice_index=mode.position(learner if to is None else to) if sliced else None,
                           mixed=kind == MIXED, stepped=kind == STEPPED)


def partner_wait_s(sync, round_compute_s: float) -> float | None:
    """With `sync.partner_wait_rounds`, how long after its inner steps a learner waits for all of this
    round's peers together; None: each peer gets `sync.partner_timeout_s`."""
    if sync.partner_wait_rounds is None:
        return None
    return min(sync.partner_timeout_s, sync.partner_wait_rounds * round_compute_s)


@dataclass(frozen=True)
class Received:
    peer: int
    fields: dict[str, torch.Tensor]
    tokens: int  # what the receiver's plan weighs the peer by, never the message's word


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
    influence: object = None  # the exchanger's `Influence` records after this mix (a snapshot)
    crossing_residual: dict[str, torch.Tensor] = field(default_factory=dict)  # over this learner's slice
    seconds: dict[str, float] = field(default_factory=dict)  # the job's parts: publish, receive, cross, outer_step


@dataclass
class Exchange:
    """A fragment's exchange in flight: sent at the end of `round`, applied `tau` steps later."""

    round: int
    fragment: int
    sent_weights: torch.Tensor | None = None  # the fragment's weights when it was sent
    result: Future | None = None  # the transport job's ExchangeResult
