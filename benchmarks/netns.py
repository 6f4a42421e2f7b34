"""Two islands on one machine: network namespaces joined by one veth pair that `tc tbf` shapes.

Nothing else is connected, so every byte that moves between the islands crosses that pair and its
interface counters (read inside each namespace) are the inter-island bytes, headers included. A
benchmark process never touches the host's interfaces, and tears down only namespaces it made.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

NAMESPACE_PREFIX = "arch-"
IFNAME_MAX = 15  # Linux IFNAMSIZ - 1
SUBNET = "10.77.0"  # only inside the benchmark's own namespaces, which have no other routes

def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def tbf_burst_bytes(rate_bps: float) -> int:
    """A token bucket deep enough for 10 ms at the rate (tbf needs at least rate / HZ) and never
    below 16 KiB, so full-size segments pass."""
    return max(16 * 1024, int(rate_bps / 8 / 100))


@dataclass(frozen=True)
class IslandEnd:
    island: str
    namespace: str
    device: str
    address: str


@dataclass(frozen=True)
class LinkPlan:
    """Two island namespaces and the veth pair between them; the first island hosts the store."""

    tag: str
    ends: tuple[IslandEnd, IslandEnd]
    rate_bps: int

    @classmethod
    def for_islands(cls, islands: list[str], rate_bps: float, tag: str | None = None) -> "LinkPlan":
        if len(islands) != 2 or len(set(islands)) != 2:
            raise ValueError(f"the shaped-link benchmark joins exactly two distinct islands, got {islands}")
        tag = tag or secrets.token_hex(3)
        ends = tuple(IslandEnd(island=name, namespace=f"{NAMESPACE_PREFIX}{tag}-{name}",
                               device=f"arch{tag}{k}", address=f"{SUBNET}.{k + 1}")
                     for k, name in enumerate(islands))
        plan = cls(tag=tag, ends=ends, rate_bps=int(rate_bps))
        plan.validate()
        return plan

    def validate(self, existing_namespaces: set[str] = frozenset()) -> None:
        if not re.fullmatch(r"[a-z0-9]{1,8}", self.tag):
            raise ValueError(f"tag {self.tag!r}: use 1-8 lowercase letters or digits")
        if self.rate_bps < 8_000:
            raise ValueError(f"rate {self.rate_bps} bit/s is below tbf's useful range (8 kbit/s)")
        for end in self.ends:
            if len(end.device) > IFNAME_MAX:
                raise ValueError(f"interface name {end.device!r} is longer than {IFNAME_MAX} characters")
            if end.namespace in existing_namespaces:
                raise ValueError(f"network namespace {end.namespace!r} already exists; not touching it")

    @property
    def server(self) -> IslandEnd:
        return self.ends[0]

    def end(self, island: str) -> IslandEnd:
        return next(e for e in self.ends if e.island == island)

    def exec_in(self, island: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.end(island).namespace)

    def setup_commands(self) -> list[list[str]]:
        a, b = self.ends
        burst = tbf_burst_bytes(self.rate_bps)
        commands = [["ip", "netns", "add", e.namespace] for e in self.ends]
        commands.append(["ip", "link", "add", a.device, "netns", a.namespace, "type", "veth",
                         "peer", "name", b.device, "netns", b.namespace])
        for e in self.ends:
            commands += [["ip", "-n", e.namespace, "addr", "add", f"{e.address}/30", "dev", e.device],
                         ["ip", "-n", e.namespace, "link", "set", "lo", "up"],
                         ["ip", "-n", e.namespace, "link", "set", e.device, "up"],
                         # Egress of each end: the two directions of the link, each at the full rate.
                         ["tc", "-n", e.namespace, "qdisc", "add", "dev", e.device, "root", "tbf",
                          "rate", f"{self.rate_bps}bit", "burst", str(burst), "latency", "100ms"]]
        return commands

    def counters(self) -> dict[str, dict[str, int]]:
        """Each end's veth byte counters, read inside its namespace."""
        out = {}
        for e in self.ends:
            values = subprocess.run(
                [*self.exec_in(e.island), "cat", f"/sys/class/net/{e.device}/statistics/tx_bytes",
                 f"/sys/class/net/{e.device}/statistics/rx_bytes"],
                check=True, capture_output=True, text=True).stdout.split()
            out[e.island] = {"tx_bytes": int(values[0]), "rx_bytes": int(values[1])}
        return out


def link_bytes(before: dict, after: dict, plan: LinkPlan) -> dict:
    """Bytes over the link between two counter readings, each direction, from both ends."""
    a, b = (e.island for e in plan.ends)
    delta = {i: {k: after[i][k] - before[i][k] for k in after[i]} for i in after}
    return {f"{a}_to_{b}": delta[a]["tx_bytes"], f"{b}_to_{a}": delta[b]["tx_bytes"],
            "total": delta[a]["tx_bytes"] + delta[b]["tx_bytes"],
            # the other end's receive counters, as a check
            "total_seen_by_receivers": delta[b]["rx_bytes"] + delta[a]["rx_bytes"]}


def run_concurrently(plan: LinkPlan, calls: list[tuple]) -> tuple[float, dict]:
    """Run each (function, *args) on its own thread; wall seconds and the link bytes they moved."""
    before, began = plan.counters(), time.monotonic()
    workers = [threading.Thread(target=call[0], args=call[1:]) for call in calls]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - began, link_bytes(before, plan.counters(), plan)


# Ethernet (14), IPv4 (20) and TCP with timestamps (32): what each segment adds on the veth.
SEGMENT_HEADER_BYTES = 66


class Sampling:
    """Calls `sample()` every `every_s` seconds on a thread while in its `with` block, and once more at its end."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class ConnectionBytes(Sampling):
    """Bytes on the wire of the TCP connections that a peer address opens to a local port, read from
    the kernel's own per-socket counters (`ss -ti`) every `every_s` seconds on a thread: payload both
    ways, retransmissions included, plus the headers of every segment. A connection opened and closed
    between two readings is missed, so the figure is a floor."""

    def __init__(self, port: int, peer: str, every_s: float = 1.0):
        super().__init__(every_s)
        self.port, self.peer = port, peer
        self.seen: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def sample(self) -> None:
        listed = subprocess.run(["ss", "-tinH", "state", "all", f"( sport = :{self.port} )"],
                                capture_output=True, text=True).stdout.splitlines()
        for head, info in zip(listed, listed[1:]):
            fields = head.split()
            if head[:1].isspace() or len(fields) < 5 or not fields[4].startswith(f"{self.peer}:"):
                continue
            counters = {k: int(v) for k, v in re.findall(r"\b(bytes_sent|bytes_received|segs_out|segs_in):(\d+)", info)}
            on_wire = counters.get("bytes_sent", 0) + counters.get("bytes_received", 0) + SEGMENT_HEADER_BYTES * (
                counters.get("segs_out", 0) + counters.get("segs_in", 0))
            self.seen[fields[4]] = max(self.seen.get(fields[4], 0), on_wire)


def require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/shaped_link.py must run as root: it creates network namespaces and tc qdiscs")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: install iproute2 (apt-get install -y iproute2)")


def run_checked(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip()}")


def existing_namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def teardown(plan: LinkPlan, driver: subprocess.Popen | None) -> None:
    """Stop the driver's process group, then anything still inside our namespaces, then delete them."""
    if driver is not None and driver.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGTERM)
        try:
            driver.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    remove_namespaces([e.namespace for e in plan.ends])
    log(f"torn down namespaces {', '.join(e.namespace for e in plan.ends)}")


def remove_namespaces(namespaces: list[str]) -> None:
    """Kill every process inside each of `namespaces` that exists, then delete it. Only for namespaces
    the caller made: nothing else lives in them."""
    ours = existing_namespaces()
    for namespace in namespaces:
        if namespace not in ours:
            continue
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        # Deleting a namespace destroys its end of a veth pair, and with it the pair.
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
