"""One learner's account of its run: bytes moved by link class, seconds computing and syncing,
rounds (with their inner steps' values), exchanges and the exchanges it missed, over all its lives.

Only the learner's main thread writes it: the transport thread hands what an exchange moved back
in the exchange's result, and the learner books it when it applies the exchange. A checkpoint
carries the ledger, so a restarted learner's totals still count its earlier lives.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from infra import layout
from infra.store import IntegrityError, ObjectExists, ObjectMissing, StoreError
from infra.stores import RunStores


# A round's entry keeps its inner steps' values: every k-th inner step of the learner's run (the k-th,
# the 2k-th, ...; `step` is its index over the whole run, from 0 as `round` is), k the smallest that
# keeps the run within STEP_POINTS steps. At this project's sizes that is every step; at any size the
# record in checkpoints and summaries stays bounded.
STEP_POINTS = 4096


def step_stride(total_steps: int) -> int:
    return max(1, -(-total_steps // STEP_POINTS))


def peak_memory_bytes(device: torch.device) -> int:
    """The learner process's peak memory so far: what torch allocated on a CUDA device, the resident set
    on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class StepValues:
    """A round's kept inner steps: their global index, loss, learning rate, gradient norm (before clipping)
    and peak memory. The norms stay tensors until the round ends, so keeping them waits for no device."""

    def __init__(self):
        self.step, self.loss, self.learning_rate, self.peak_memory_bytes = [], [], [], []
        self.grad_norms: list[torch.Tensor] = []

    def keep(self, step: int, loss: float, learning_rate: float, grad_norm: torch.Tensor, memory: int) -> None:
        self.step.append(step)
        self.loss.append(loss)
        self.learning_rate.append(learning_rate)
        self.grad_norms.append(grad_norm.detach())
        self.peak_memory_bytes.append(memory)

    def to_json(self) -> dict | None:
        if not self.step:
            return None
        return {"step": self.step, "loss": self.loss, "learning_rate": self.learning_rate,
                "grad_norm": torch.stack(self.grad_norms).float().cpu().tolist(),
                "peak_memory_bytes": self.peak_memory_bytes}


@dataclass
class Ledger:
    bytes_written: int = 0  # messages
    bytes_read_intra: int = 0
    bytes_read_inter: int = 0
    checkpoint_bytes: int = 0  # checkpoints, and the weights-only objects of the bpb curve's rounds
    objects_retired: int = 0  # checkpoints and messages no one will read again (training/learner/retention.py)
    seconds_computing: float = 0.0
    seconds_syncing: float = 0.0
    seconds_blocked: float = 0.0  # waiting for an exchange still on the link
    rounds: list[dict] = field(default_factory=list)
    exchanges: list[dict] = field(default_factory=list)
    missed_exchanges: list[dict] = field(default_factory=list)
    corrupt_reads_detected: int = 0
    links: dict = field(default_factory=dict)  # the transport's per-link counters, as of the last checkpoint
    stores: dict = field(default_factory=dict)  # message bytes by store URL, written and read, likewise

    def book_round(self, round_index: int, fragment: int, loss: float, compute_s: float, sync_s: float,
                   steps: StepValues | None = None) -> None:
        self.seconds_computing += compute_s
        self.seconds_syncing += sync_s
        # `ended_at` (Unix seconds): a benchmark that starts learners through Prefect workers, and so never
        # sees their output, still times their rounds from the summary.
        entry = {"round": round_index, "loss": loss, "compute_s": compute_s, "sync_s": sync_s,
                 "fragment": fragment, "ended_at": time.time()}
        kept = steps.to_json() if steps is not None else None
        if kept is not None:
            entry["steps"] = kept
        self.rounds.append(entry)

    def book_checkpoint(self, seconds: float) -> None:
        """The latest round's checkpoint: seconds it held the learner (its state copied and queued, or
        written, without `checkpoint_in_background`)."""
        self.rounds[-1]["checkpoint_s"] = seconds

    def book_exchange(self, round_index: int, fragment: int, result, blocked_s: float) -> None:
        """What an applied exchange (a `training.exchange.plan.ExchangeResult`) sent, read and missed."""
        self.bytes_written += result.bytes_sent
        self.bytes_read_intra += result.bytes_read["intra"]
        self.bytes_read_inter += result.bytes_read["inter"]
        self.corrupt_reads_detected += result.corrupt_reads
        self.missed_exchanges.extend(result.missed)
        self.seconds_blocked += blocked_s
        # `seconds`: the exchange's parts on the transport thread, off the learner's path unless it waited
        # (`blocked_s`) for them.
        self.exchanges.append({"round": round_index, "fragment": fragment, "bytes_sent": result.bytes_sent,
                               "bytes_received": sum(result.bytes_read.values()),
                               "bytes_read_intra": result.bytes_read["intra"],
                               "bytes_read_inter": result.bytes_read["inter"],
                               "peers": [r.peer for r in result.received], "blocked_s": blocked_s,
                               "missed": len(result.missed),
                               "refused": result.refused,
                               "seconds": dict(result.seconds)})

    def mark(self) -> tuple[int, int]:
        """Where the ledger's rounds and exchanges end now: `booked_since` it gives what came after."""
        return len(self.rounds), len(self.exchanges)

    def booked_since(self, mark: tuple[int, int]) -> dict:
        """The rounds and exchanges booked since `mark`: what a `round` event carries to the island's relay."""
        return {"rounds": self.rounds[mark[0]:], "exchanges": self.exchanges[mark[1]:]}

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in Ledger(**state).__dict__.items():
            setattr(self, name, value)


@dataclass
class LearnerSummary(Ledger):
    """What a learner that trained every round writes once at the end (`layout.learner_summary`):
    its ledger and who it was. The contract the report, its figures and the benchmarks read."""

    learner: int = 0
    island: str = ""
    processes: int = 1
    tokens: int = 0  # of the rounds it trained in all its lives; rounds skipped by rejoining are not compute
    rejoined_from: dict | None = None
    lives: list[dict] = field(default_factory=list)
    fragment_sizes: list[int] = field(default_factory=list)
    store: dict = field(default_factory=dict)  # the store client's request, retry and byte counters
    store_url: str = ""  # the learner's own store: its island's, where its checkpoints and messages went
    store_faults_injected: dict = field(default_factory=dict)
    # The checkpoint consolidation reads as this learner's final state: its key and the sha256 of its tensors.
    final_checkpoint: dict | None = None
    # Per peer: its messages mixed as they came, clipped (with the factors) and refused (`training.exchange.influence`).
    influence: dict = field(default_factory=dict)

    @classmethod
    def of(cls, ledger: Ledger, tokens_per_round: int, **rest) -> "LearnerSummary":
        return cls(**{**ledger.state_dict(), **rest}, tokens=tokens_per_round * len(ledger.rounds))

    def to_json(self) -> dict:
        return asdict(self)


def read_summary(store, spec, learner: int) -> LearnerSummary:
    """A learner's summary from its store: the first of its slots that verifies and is the summary of
    that learner, with the fields a summary has (ObjectMissing otherwise: a forged one finishes no one).
    The later slots are listed only when something else sits in slot 0; each is read once."""
    def slots():
        yield 0
        yield from layout.summary_slots(store.list(layout.learner_prefix(learner)))

    refusals = []
    for slot in slots():
        try:
            return _summary_at(store, spec, learner, layout.learner_summary(learner, slot))
        except ObjectMissing:
            if slot == 0:
                break  # slot 0 free: the learner has not finished
        except IntegrityError as err:
            refusals.append(str(err))
    raise ObjectMissing(f"learner {learner} has no summary in {store.url}" +
                        (f" ({len(refusals)} refused: {'; '.join(refusals[:3])})" if refusals else ""))


def write_summary(store, spec, summary: LearnerSummary) -> None:
    """Write a learner's summary once (an earlier life's stands): in slot 0, or, where something it did
    not write took that, in the slot past every one its store lists (however many are squatted)."""
    try:
        read_summary(store, spec, summary.learner)
        return
    except ObjectMissing:
        pass
    slot = 0
    while True:
        try:
            store.put_json(layout.learner_summary(summary.learner, slot), summary.to_json())
            return
        except ObjectExists:
            slot = max([slot, *layout.summary_slots(store.list(layout.learner_prefix(summary.learner)))]) + 1


def _summary_at(store, spec, learner: int, key: str) -> LearnerSummary:
    body = store.get_json(key)
    try:
        summary = LearnerSummary(**body)
    except TypeError:
        store.refused(key)
        raise IntegrityError(f"object {key} in {store.url} is not a learner's summary") from None
    if summary.learner != learner or summary.island != spec.learners[learner].island.name:
        store.refused(key)
        raise IntegrityError(f"object {key} in {store.url} is the summary of another learner")
    return summary


def finished(stores, spec, learner: int) -> bool:
    """Whether a learner has trained every round: its summary is there and is its own."""
    try:
        read_summary(stores.learner(learner), spec, learner)
        return True
    except StoreError:
        return False


def read_summaries(spec, run) -> list[LearnerSummary]:
    """Every learner's summary, each from its island's store (`run`: the run's own store)."""
    stores = RunStores(spec, run)
    return [read_summary(stores.learner(i), spec, i) for i in range(len(spec.learners))]
