"""Deadlines that hold against a slow store: a server that answers a byte every 2 s, and a learner that hangs.

botocore's read timeout is an idle timeout, which a server trickling a byte at a time never trips;
before every store request had a total deadline, one GET under a 3 s retry budget lasted as long as
the server liked (minutes here). Each test measures a give-up against its budget plus 10%.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from infra.retry import RetryPolicy
from infra.spec import parse_spec
from infra.store import ObjectMissing, ObjectStore, StoreUnavailable
from training.exchange.transport import Transport
from infra.watchdog import STALLED, Watchdog
from training.model.registry import build_model
from training.model.params import flat_parameters
from training.learner.state import Lives
from training.exchange.exchanger import Exchanger

BYTE_EVERY_S = 2.0
NO_SUCH_KEY = (b'<?xml version="1.0" encoding="UTF-8"?>\n'
               b"<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>")


class TricklingServer:
    """Answers S3 requests on loopback: those `trickles(request line)` picks with a 200 sent a byte every
    2 s, the others at once with 404 NoSuchKey."""

    def __init__(self, trickles: Callable[[str], bool]):
        self.trickles = trickles
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:  # closed at the end of the test
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """One request after another on the connection (keep-alive), until the client closes it; a client
        that gives up mid-request or mid-answer, or resets the connection, ends it too."""
        with conn, contextlib.suppress(OSError):
            while (request_line := self._request(conn)) is not None:
                if self.trickles(request_line):
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000:
                        conn.sendall(bytes([byte]))
                        time.sleep(BYTE_EVERY_S)
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(NO_SUCH_KEY), NO_SUCH_KEY))

    @staticmethod
    def _request(conn: socket.socket) -> str | None:
        """The next request's first line, its headers and body read; None once the client has closed."""
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            head += chunk
        headers, _, body = head.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        return headers.split(b"\r\n")[0].decode()

    def store(self, budget_s: float) -> ObjectStore:
        return ObjectStore("s3://slow/run", self.endpoint_url, RetryPolicy(attempts=8, budget_s=budget_s),
                           credentials_env="TRICKLE")


@pytest.fixture
def trickling(monkeypatch):
    """A factory of trickling servers, with the (unchecked) credentials their store is opened with."""
    monkeypatch.setenv("TRICKLE_AWS_ACCESS_KEY_ID", "trickle")
    monkeypatch.setenv("TRICKLE_AWS_SECRET_ACCESS_KEY", "trickle-secret")
    servers = []

    def start(trickles: Callable[[str], bool] = lambda request_line: True) -> TricklingServer:
        servers.append(TricklingServer(trickles))
        return servers[-1]

    yield start
    for server in servers:
        server.socket.close()


def timed(fn: Callable) -> tuple[object, float]:
    began = time.monotonic()
    try:
        outcome = fn()
    except StoreUnavailable as err:
        outcome = err
    return outcome, time.monotonic() - began


@pytest.mark.parametrize("request_of", [
    lambda store: store.get_bytes("learners/000/round-00000/message.json"),
    lambda store: store.put_bytes("learners/000/round-00000/message.json", b"{}"),
    lambda store: store.list("liveness"),
], ids=["get", "put", "list"])
def test_a_store_request_gives_up_within_its_budget(trickling, request_of):
    store = trickling().store(budget_s=2.0)
    outcome, seconds = timed(lambda: request_of(store))
    assert isinstance(outcome, StoreUnavailable), outcome
    assert "no complete answer" in str(outcome)
    # It gives up at its budget, not before; after it, waking the waiting thread and closing the connection
    # wait for a core, seconds on a busy 2-core machine. Without a budget the request waits for botocore's
    # 60 s read timeout.
    assert 2.0 <= seconds <= 5.0


def partner_spec(partner_timeout_s: float):
    return parse_spec({
        "name": "slow",
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 8, "inner_steps": 2}
                    for name in ("east", "west")],
        "model": {"layers": 1, "width": 8, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]},
        "sync": {"rounds": 2, "partner_timeout_s": partner_timeout_s},
    })


@pytest.mark.parametrize("wait_s, deadline_given", [(1.0, True), (2.5, False)])
def test_a_partner_wait_ends_at_its_deadline_while_the_peers_records_trickle(trickling, wait_s, deadline_given):
    """The peer's message is not there (404 at once) and its liveness records trickle: the wait asks them
    after a second whether the peer skipped the round, and that question ends with the wait."""
    server = trickling(lambda request_line: "list-type=2" in request_line)
    store = server.store(budget_s=60.0)
    spec = partner_spec(wait_s)
    model = build_model(spec)
    east = Exchanger(spec, spec.learners[0], Transport(store), model, flat_parameters(model),
                     skipped=Lives(lambda learner: store, spec.sync.rounds).skipped_by)
    with pytest.raises(ObjectMissing):  # the store's client is made on its first request: not part of the wait
        store.get_bytes("learners/001/round-00000/message.json")
    began = time.monotonic()
    receipt = east.receive(1, 0, began + wait_s if deadline_given else None)
    seconds = time.monotonic() - began
    assert receipt.message is None and receipt.reason == "deadline"
    assert east.channel.counters["inter"].polls >= 2  # it looked more than once, then asked the peer's records
    assert wait_s <= seconds <= wait_s * 1.1


def test_the_watchdog_ends_a_process_that_stops_making_progress():
    ended = []
    watchdog = Watchdog(0.5, "learner 3 (rank 0)", end=ended.append).start()
    for _ in range(10):  # 1 s of progress, twice the limit
        time.sleep(0.1)
        watchdog.beat()
    assert ended == []
    last_beat = time.monotonic()
    while not ended and time.monotonic() - last_beat < 5:
        time.sleep(0.01)
    assert ended == [STALLED]
    assert 0.5 <= time.monotonic() - last_beat <= 0.55


def test_a_hung_learner_process_exits_with_a_clear_error_within_its_limit():
    hang = ("import time; from infra import watchdog; watchdog.arm(1.0, 'learner 3 (rank 0)'); "
            "print('armed', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", hang], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "armed\n"
    armed = time.monotonic()
    proc.wait(timeout=30)
    seconds = time.monotonic() - armed
    assert proc.returncode == STALLED
    assert "learner 3 (rank 0): no progress for 1.0s" in proc.stderr.read()
    assert seconds <= 1.1


def test_the_stall_limit_outlasts_a_partner_wait_and_two_store_calls():
    spec = partner_spec(60)
    assert spec.learner_stall_limit_s == 60 + 2 * spec.store.retry_budget_s + 600
    raw = spec.model_dump(mode="json")
    raw["sync"]["stall_limit_s"] = 60 + 2 * spec.store.retry_budget_s
    assert parse_spec(raw).learner_stall_limit_s == raw["sync"]["stall_limit_s"]
    raw["sync"]["stall_limit_s"] -= 1
    with pytest.raises(ValueError, match="stall_limit_s: .* shorter than a partner wait and two store calls"):
        parse_spec(raw)
