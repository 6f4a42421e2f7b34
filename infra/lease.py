"""A run's lease: at most one lifecycle drives a run id at a time.

The store is write-once, so the lease is a chain of objects in the run's prefix, each created once:

    lease/<term>/claim.json          who took the run: host, pid, flow run, since when, until when
    lease/<term>/renewal-<n>.json    the holder's n-th renewal, with a later expiry
    lease/<term>/released.json       the holder let go

The newest term decides. It is live until released or past its newest expiry; then the next
lifecycle takes the run by creating the claim of the next term. A live term whose holder is provably
gone is taken at once: its claim names this host and this machine's pid space (boot and pid
namespace), and its pid runs no process here (a lifecycle killed with SIGKILL). A holder that runs,
or on another host, or whose claim does not say where, still holds the run until its lease expires:
a claim is trusted no further than before (signed by the control plane in a signed run), and one
that names a live process blocks as it always did. Two lifecycles racing for the same
term both try to create the same claim object: the store creates an object at most once (local
folders by an atomic hard link, S3 by a conditional PUT), so exactly one wins and the other is
refused, naming the winner.

Expiry is judged by the reader's clock against the holder's (both UTC), so hosts' clocks must
agree to well within the lease's lifetime. A holder that stalls past its expiry may find its run
taken over; its next renewal notices and it stops renewing (`LeaseLost`).

A lease fences the run's work only if the holder stops that work while the lease is still its own:
`held_lease` calls its `on_lost` as soon as the run was taken, or as soon as renewals have failed
for so long that the next try would leave less than `stop_margin_s` before expiry.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil

from infra.store import IntegrityError, ObjectExists, ObjectMissing, ObjectStore, StoreError

LEASE_TTL_S = 120.0
# A learner started under a term looks this often whether a newer term has taken the run.
FENCE_EVERY_S = 30.0
# Exit status of a learner whose lifecycle no longer holds the run: another one has taken it.
SUPERSEDED = 87
MAX_LEASE_S = 3600.0  # no lease is taken or renewed for longer: a record that says otherwise is not one
LEASE_RECORD_MAX_BYTES = 64 << 10
RENEW_EVERY_S = 30.0
# What a holder leaves itself to stop the run's work (end its learners' process groups, have the
# islands' workers cancel its segment flow runs: a worker's poll, then up to its 30 s grace for a
# flow-run process that does not exit on SIGTERM) before its lease expires. With the defaults, one
# failed renewal is retried; after a second the run's work stops with 60 s left.
STOP_MARGIN_S = 60.0

# Numbers have six digits or more: a term or renewal past a planted 999999 is still one.
_CLAIM = re.compile(r"^lease/(\d{6,})/claim\.json$")
_RENEWAL = re.compile(r"^lease/(\d{6,})/renewal-(\d{6,})\.json$")


def claim_key(term: int) -> str:
    return f"lease/{term:06d}/claim.json"


def renewal_key(term: int, renewal: int) -> str:
    return f"lease/{term:06d}/renewal-{renewal:06d}.json"


def released_key(term: int) -> str:
    return f"lease/{term:06d}/released.json"


class LeaseHeld(StoreError):
    """Another lifecycle holds the run's lease; the message names it and when its lease expires."""


class LeaseLost(StoreError):
    """This lifecycle's lease expired and another lifecycle took the run."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _stamp(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds")


# The holder's field naming where its pid means a process: this machine's boot and its pid namespace.
PID_SPACE = "pid space"


def _pid_space() -> str | None:
    """This machine's current boot and this process's pid namespace (Linux); None where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def this_process(**details: str) -> dict[str, str]:
    """A holder's description: this host and process, plus whatever names it further (a flow run)."""
    space = _pid_space()
    return {**details, "host": socket.gethostname(), "pid": str(os.getpid()),
            **({PID_SPACE: space} if space else {})}


def _process_runs(pid: int) -> bool:
    """Whether `pid` is a process here that has not exited (a zombie has; one we may not inspect runs)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass(frozen=True)
class _Term:
    term: int
    claim: dict
    expires_at: datetime
    released: bool

    def live(self, now: datetime) -> bool:
        return not self.released and now < self.expires_at

    def holder_gone(self) -> bool:
        """Whether the holder is provably gone: a process of this host and pid space whose pid runs no
        process. Anything else (another host, a claim that does not say, a live pid) is not proof."""
        holder, space = self.claim["holder"], _pid_space()
        pid = holder.get("pid")
        if space is None or holder.get("host") != socket.gethostname() or holder.get(PID_SPACE) != space:
            return False
        return isinstance(pid, str) and pid.isascii() and pid.isdigit() and not _process_runs(int(pid))

    def describe(self, run_id: str) -> str:
        holder = ", ".join(f"{name} {value}" for name, value in self.claim["holder"].items() if name != PID_SPACE)
        return (f"run {run_id} is being driven by another lifecycle ({holder}) since {self.claim['claimed_at']}; "
                f"its lease expires at {_stamp(self.expires_at)} unless renewed. If that lifecycle is gone, "
                "resume after that time")


def _expiry(record: dict, now: datetime) -> datetime:
    """A record's `expires_at`: a timestamp with a UTC offset, at most `MAX_LEASE_S` ahead. A record
    that says anything else is no lease (ValueError): a planted expiry in 9999 would block the run."""
    value = record.get("expires_at") if isinstance(record, dict) else None
    moment = datetime.fromisoformat(value) if isinstance(value, str) and len(value) <= 64 else None
    if moment is None or moment.tzinfo is None or moment > now + timedelta(seconds=MAX_LEASE_S):
        raise ValueError("expires_at is not a timestamp with an offset within the longest lease")
    return moment


def _record(store: ObjectStore, key: str, refused: set[str], check=lambda record: record) -> dict | None:
    """A lease record that verifies and passes `check` (ValueError otherwise), or None. A record refused
    once is remembered in `refused` and never read again by the same reader: junk costs one read."""
    if key in refused:
        return None
    try:
        return check(store.get_json(key, max_bytes=LEASE_RECORD_MAX_BYTES))
    except ObjectMissing:
        return None
    except IntegrityError:
        refused.add(key)
    except ValueError:
        store.refused(key)
        refused.add(key)
    return None


def _claim(record: dict, now: datetime) -> dict:
    _expiry(record, now)
    if not isinstance(record.get("holder"), dict) or not isinstance(record.get("claimed_at"), str):
        raise ValueError("a claim names its holder and when it claimed")
    return record


def _renewal(record: dict, now: datetime) -> dict:
    _expiry(record, now)
    return record


def _renewals(keys: list[str], term: int) -> list[int]:
    """The renewal numbers of `term` among the lease's keys, oldest first."""
    return sorted(int(m.group(2)) for m in map(_RENEWAL.match, keys) if m and int(m.group(1)) == term)


def _read_term(store: ObjectStore, term: int, keys: list[str], refused: set[str],
               now: datetime | None = None) -> _Term | None:
    """A term of the lease as its records (among the lease's listed `keys`) say, or None when its claim does
    not verify or does not read as a claim (counted as refused): a record the store holds is no lease
    unless its holder wrote it. Its expiry is its newest renewal that verifies, and it is released only
    by a `released.json` that verifies."""
    now = now or _now()
    claim = _record(store, claim_key(term), refused, lambda record: _claim(record, now))
    if claim is None:
        return None
    expires_at = _expiry(claim, now)
    for renewal in reversed(_renewals(keys, term)):
        record = _record(store, renewal_key(term, renewal), refused, lambda record: _renewal(record, now))
        if record is not None:
            expires_at = max(expires_at, _expiry(record, now))
            break
    released = released_key(term) in keys and _record(store, released_key(term), refused) is not None
    return _Term(term, claim, expires_at, released)


def _terms(keys: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_CLAIM.match, keys) if m)


def _newest_term(store: ObjectStore, keys: list[str], refused: set[str], after: int = -1) -> _Term | None:
    """The newest term past `after` among the lease's listed `keys` whose records read as a lease; terms
    planted past it are skipped, each read once by a reader that keeps its `refused` set."""
    return next((read for term in reversed(_terms(keys)) if term > after
                 and (read := _read_term(store, term, keys, refused)) is not None), None)


def newest_term_number(store: ObjectStore, refused: set[str] | None = None) -> int | None:
    """The term of the run's newest lease that reads as one; None before the first claim. `refused`: the
    records this reader found not to verify before, kept between its looks."""
    newest = _newest_term(store, store.list("lease"), set() if refused is None else refused)
    return None if newest is None else newest.term


class LeaseFence:
    """A learner's half of the lease: it was started under `term`, and once a newer term reads as the
    run's lease (another lifecycle took the run after this one lost it) the learner ends itself
    instead of training beside that lifecycle's learners. It looks at start and every `every_s`; a
    store out of reach is no reason to stop (the learner's own deadlines and watchdog cover it)."""

    def __init__(self, store: ObjectStore, term: int, what: str, every_s: float = FENCE_EVERY_S,
                 end: Callable[[int], None] = os._exit):
        self.store, self.term, self.what, self.every_s, self.end = store, term, what, every_s, end
        self._refused: set[str] = set()
        self._thread = threading.Thread(target=self._watch, name="lease-fence", daemon=True)

    def start(self) -> "LeaseFence":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            try:
                newest = newest_term_number(self.store, self._refused)
            except StoreError:
                newest = None
            if newest is not None and newest > self.term:
                print(f"{self.what}: started under lease term {self.term}, but term {newest} now holds the run; "
                      "exiting so that only that lifecycle's learners train", file=sys.stderr, flush=True)
                self.end(SUPERSEDED)
                return
            time.sleep(self.every_s)


class RunLease:
    """The lease one lifecycle holds on a run: acquire it, renew it, release it."""

    def __init__(self, store: ObjectStore, run_id: str, term: int, ttl_s: float, expires_at: datetime,
                 taken_from: str | None = None):
        self.store, self.run_id, self.term, self.ttl_s = store, run_id, term, ttl_s
        self.expires_at = expires_at
        self.renewals = 0  # the number of this holder's newest renewal
        self._refused: set[str] = set()  # lease records this holder found not to verify
        # The previous term's holder, when this lease took the run from a holder that is gone before its expiry.
        self.taken_from = taken_from

    @classmethod
    def acquire(cls, store: ObjectStore, run_id: str, holder: dict[str, str],
                ttl_s: float = LEASE_TTL_S) -> "RunLease":
        """Take the run's lease, or raise `LeaseHeld` naming the lifecycle that holds it (one that is
        provably gone holds nothing).

        `store` is the run's own prefix."""
        now = _now()
        # One listing decides both: with a second one, a claim landing between them would be seen by the
        # second alone, and this lifecycle would take the term after a live one.
        keys = store.list("lease")
        terms = _terms(keys)
        newest = _newest_term(store, keys, set())
        taken_from = None
        if newest is not None and newest.live(now):
            if not newest.holder_gone():
                raise LeaseHeld(newest.describe(run_id))
            taken_from = (f"term {newest.term}, held by " + ", ".join(
                f"{name} {value}" for name, value in newest.claim["holder"].items() if name != PID_SPACE))
        # Past every listed term, read or not: a planted claim squats its term number, not the run.
        term = max(terms, default=-1) + 1
        expires_at = now + timedelta(seconds=ttl_s)
        try:
            store.put_json(claim_key(term), {"holder": holder, "claimed_at": _stamp(now),
                                             "expires_at": _stamp(expires_at), "nonce": uuid.uuid4().hex})
        except ObjectExists:
            taken = _read_term(store, term, store.list("lease"), set())
            raise LeaseHeld(taken.describe(run_id) if taken else f"run {run_id}: lease term {term} was taken while "
                            "this lifecycle claimed it; try again") from None
        return cls(store, run_id, term, ttl_s, expires_at, taken_from)

    def renew(self) -> None:
        """Push the expiry out by the lease's lifetime, as a new object; `LeaseLost` if the run was taken.
        One listing, and a read of each record past this term not read before: junk claims cost one read
        each, once. A renewal whose key is taken goes past every listed one."""
        keys = self.store.list("lease")
        taken = _newest_term(self.store, keys, self._refused, after=self.term)
        if taken is not None:
            taker = taken.claim
            raise LeaseLost(f"run {self.run_id}: this lifecycle's lease (term {self.term}) expired at "
                            f"{_stamp(self.expires_at)} and was taken by {taker['holder']} at {taker['claimed_at']}")
        expires_at, number = _now() + timedelta(seconds=self.ttl_s), self.renewals + 1
        while True:
            try:
                self.store.put_json(renewal_key(self.term, number), {"expires_at": _stamp(expires_at)})
                break
            except ObjectExists:
                number = max([number, *_renewals(self.store.list("lease"), self.term)]) + 1
        self.renewals, self.expires_at = number, expires_at

    def release(self) -> None:
        self.store.put_json(released_key(self.term), {"released_at": _stamp(_now())})


@contextmanager
def held_lease(store: ObjectStore, run_id: str, holder: dict[str, str], warn=logging.getLogger(__name__).warning,
               ttl_s: float = LEASE_TTL_S, renew_every_s: float = RENEW_EVERY_S, stop_margin_s: float = STOP_MARGIN_S,
               on_lost: Callable[[str], None] = lambda reason: None):
    """Hold the run's lease for the body, renewed by a background thread, released at the end.

    When the run was taken, or renewals failed (any error: a store outage, an expired token, a full
    disk) until the next try would leave less than `stop_margin_s` before expiry, the thread stops
    renewing and calls `on_lost(reason)`, which must stop the run's work; the body then ends by
    raising `LeaseLost`. `warn` receives renewal problems as they happen. The thread runs in a copy
    of the caller's context (its Prefect settings and run)."""
    lease = RunLease.acquire(store, run_id, holder, ttl_s)
    if lease.taken_from:
        warn("run %s: its lease (%s) was not released, and that process no longer runs on this host: "
             "taken over without waiting for it to expire", run_id, lease.taken_from)
    stop = threading.Event()
    lost: list[LeaseLost] = []

    def give_up(err: LeaseLost) -> None:
        warn("%s; stopped renewing, stopping the run's work", err)
        lost.append(err)
        try:
            on_lost(str(err))
        except Exception as stop_err:  # noqa: BLE001 - the thread must outlive any failure to report it
            warn("run %s: stopping its work failed: %r", run_id, stop_err)

    def keep_renewed() -> None:
        while not stop.wait(renew_every_s):
            try:
                lease.renew()
            except LeaseLost as err:
                give_up(err)
                return
            except Exception as err:  # noqa: BLE001 - any failure to renew is a renewal not made
                left_s = (lease.expires_at - _now()).total_seconds()
                if left_s - renew_every_s < stop_margin_s:
                    give_up(LeaseLost(f"run {run_id}: its lease (term {lease.term}) could not be renewed ({err!r}) "
                                      f"and expires at {_stamp(lease.expires_at)}, {left_s:.0f} s from now"))
                    return
                warn("run %s: renewing its lease failed (%r); it expires at %s unless a renewal succeeds",
                     run_id, err, _stamp(lease.expires_at))

    renewer = threading.Thread(target=contextvars.copy_context().run, args=(keep_renewed,), name=f"lease-{run_id}",
                               daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        if not lost:
            try:
                lease.release()
            except StoreError as err:
                warn("run %s: releasing its lease failed (%s); it expires at %s", run_id, err,
                     _stamp(lease.expires_at))
    if lost:
        raise lost[0]
