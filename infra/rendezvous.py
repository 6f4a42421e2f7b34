"""Where the nodes of a learner that spans several hosts meet (`islands[].nodes_per_learner`).

Every node of a learner runs torchrun, and torchrun needs one address all of them reach: node 0's
rendezvous store. Node 0's torchrun binds it on the island's `network_interface` and announces
the address on its output (`BoundRendezvous` below); node 0's launcher publishes it, write-once and signed
like the learner's other records, in the island's store under `layout.rendezvous(learner, life)`;
the other nodes' launchers wait for it, check it, and hand it to their torchrun.

A life is the learner's count of recorded lives when its nodes start (training/learner/state.py).
A start that dies before its learner records the life (a node that never came) leaves a record
nobody will answer; the next start publishes at the next free number, so no record is ever
rewritten, and a joining node passes over a record whose address does not answer.

What a record holds is only ever used as an address to connect to: an IP address and a port.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from infra import layout
from infra.store import ObjectExists, ObjectStore
from infra.store_errors import IntegrityError, StoreError

# torchrun's name for `BoundRendezvous` (`--rdzv-backend`).
BOUND_RENDEZVOUS = "archipelago-bound"
# How long a node waits for the others: node 0's store for them to join, the others for its address.
RENDEZVOUS_TIMEOUT_S = 600
# How long a joining node gives a published address to answer before passing over it.
ANSWER_TIMEOUT_S = 2.0
# Starts in a row that may die before their learner records its life; a learner stuck there needs a person.
MAX_UNRECORDED_STARTS = 64


class RendezvousRejected(ValueError):
    """A rendezvous address that is not an IP address and port to connect to; says which part."""


class RendezvousTimeout(RuntimeError):
    """No rendezvous address that answers appeared in time."""


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


# How node 0's torchrun tells its launcher where its rendezvous store listens: a line of its output.
ANNOUNCEMENT = "archipelago-rendezvous"


def announcement(endpoint: Endpoint) -> str:
    return f"{ANNOUNCEMENT} {endpoint.address} {endpoint.port}"


def announced(line: str) -> Endpoint:
    """The endpoint an `announcement` line names, or RendezvousRejected."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != ANNOUNCEMENT or not parts[2].isdigit():
        raise RendezvousRejected(f"not a rendezvous announcement: {line[:120]!r}")
    return checked_endpoint(parts[1], int(parts[2]))


def checked_endpoint(address: object, port: object) -> Endpoint:
    """`address` and `port` as an endpoint to connect to, or RendezvousRejected: an IPv4 or IPv6
    address in its canonical text (no name, no scope, neither unspecified nor multicast) and a TCP port."""
    if not isinstance(address, str) or len(address) > 45:
        raise RendezvousRejected("rendezvous address is not an IP address")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise RendezvousRejected("rendezvous address is not an IP address") from None
    if str(ip) != address or ip.is_unspecified or ip.is_multicast:
        raise RendezvousRejected(f"rendezvous address {ip} is not one address to connect to")
    if type(port) is not int or not 0 < port < 65536:
        raise RendezvousRejected("rendezvous port is not a TCP port")
    return Endpoint(address, port)


def publish(store: ObjectStore, learner: int, life: int, endpoint: Endpoint) -> int:
    """Publish node 0's address for a life of `learner` in its island's `store`, at the first number
    from `life` that no earlier start took; returns that number."""
    for number in range(life, life + MAX_UNRECORDED_STARTS):
        try:
            store.put_json(layout.rendezvous(learner, number), {
                "learner": learner, "life": number, "address": endpoint.address, "port": endpoint.port})
            return number
        except ObjectExists:
            continue
    raise StoreError(f"learner {learner}: rendezvous records of lives {life} to {number} are all taken: "
                     f"{MAX_UNRECORDED_STARTS} starts in a row died before their learner began; see its nodes' logs")


def await_endpoint(store: ObjectStore, learner: int, life: int, wrapper: tuple[str, ...] = (),
                   timeout_s: float = RENDEZVOUS_TIMEOUT_S, poll_s: float = 0.2,
                   give_up: Callable[[], bool] = lambda: False) -> tuple[int, Endpoint]:
    """The newest rendezvous of `learner` from life `life` on that checks out and answers where the
    node runs (under `wrapper`, as its torchrun will), with its life; RendezvousTimeout when none does
    within `timeout_s`, or once `give_up()` says none will."""
    deadline = time.monotonic() + timeout_s
    passed_over: set[int] = set()
    while True:
        keys = store.list(layout.liveness_prefix(learner))
        candidates = [n for n in layout.rendezvous_lives(keys) if n >= life and n not in passed_over]
        if candidates:
            number = max(candidates)
            endpoint = _published(store, learner, number)
            if endpoint is not None and answers(endpoint, wrapper):
                return number, endpoint
            passed_over.add(number)
            continue
        gave_up = give_up()
        if gave_up or time.monotonic() >= deadline:
            raise RendezvousTimeout(
                f"learner {learner}: node 0 published no rendezvous address that answers for life {life} or later "
                f"{'before it ended' if gave_up else f'within {timeout_s:.0f} s'} (it publishes {layout.rendezvous(learner, life)} in {store.url} once its "
                f"torchrun listens; passed over: {sorted(passed_over) or 'none'})")
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        poll_s = min(poll_s * 1.5, 2.0)


def _published(store: ObjectStore, learner: int, number: int) -> Endpoint | None:
    """The endpoint a rendezvous record holds, or None for one that does not verify or is not a
    rendezvous of this learner's life (counted as refused)."""
    key = layout.rendezvous(learner, number)
    try:
        record = store.get_json(key, max_bytes=4096)
        if record.get("learner") != learner or record.get("life") != number:
            raise RendezvousRejected(f"record {key} is not learner {learner}'s rendezvous of life {number}")
        return checked_endpoint(record.get("address"), record.get("port"))
    except IntegrityError:
        return None
    except RendezvousRejected:
        store.refused(key)
        return None


_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))"


def answers(endpoint: Endpoint, wrapper: tuple[str, ...] = ()) -> bool:
    """Whether something accepts a TCP connection at `endpoint` from where `wrapper` runs a command (a
    node's host or network namespace; without one, here): a start that died leaves a record no store
    answers. A process of its own, since the launcher itself may sit on another network than its node."""
    command = [*wrapper, sys.executable, "-I", "-c", _CONNECT, endpoint.address, str(endpoint.port), str(ANSWER_TIMEOUT_S)]
    try:
        return subprocess.run(command, capture_output=True, timeout=ANSWER_TIMEOUT_S + 30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class BoundRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous with its store listening on one address only (port 0: one the
    kernel picks): 127.0.0.1, or for a learner on several nodes node 0's address on their network
    interface, which node 0 announces on its output for its launcher to publish. torch binds a
    store server to every interface unless handed a bound socket. The other nodes join it."""

    def get_backend(self) -> str:
        return BOUND_RENDEZVOUS

    def next_rendezvous(self):
        if not self._store and self.rank == 0:
            family = socket.AF_INET6 if ":" in self.master_addr else socket.AF_INET
            listener = socket.create_server((self.master_addr, 0), family=family)
            self.master_port = listener.getsockname()[1]
            if self.world_size > 1:
                print(announcement(Endpoint(self.master_addr, self.master_port)), flush=True)
            self._store = TCPStore(self.master_addr, self.master_port, self.world_size, True, self.timeout,
                                   master_listen_fd=listener.detach())
        return super().next_rendezvous()


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` as this process sees it (its network namespace),
    else its IPv6 address that is not link-local."""
    addresses = psutil.net_if_addrs().get(name)
    if addresses is None:
        raise ValueError(f"network interface {name!r} does not exist here (there are "
                         f"{', '.join(sorted(psutil.net_if_addrs()))}): see islands[].network_interface")
    for family in (socket.AF_INET, socket.AF_INET6):
        for entry in addresses:
            if entry.family == family and not ipaddress.ip_address(entry.address.split("%")[0]).is_link_local:
                return entry.address
    raise ValueError(f"network interface {name!r} has no IP address to listen on")


def bound_rendezvous(params: RendezvousParameters) -> BoundRendezvous:
    rank, interface = params.get_as_int("rank", 0), params.get("interface")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    if rank == 0 and interface:
        host = interface_address(interface)
    return BoundRendezvous(host, port, rank=rank, world_size=params.max_nodes, run_id=params.run_id,
                           timeout=RENDEZVOUS_TIMEOUT_S)


def register_bound_rendezvous() -> None:
    """Make `BoundRendezvous` the backend torchrun starts under the name `BOUND_RENDEZVOUS`."""
    rendezvous_handler_registry.register(BOUND_RENDEZVOUS, bound_rendezvous)
