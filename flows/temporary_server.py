"""The Prefect API of one `archipelago run` or `resume`: the user's (`PREFECT_API_URL`), or a temporary
server of the command's own.

Not Prefect's ephemeral mode, whose server is a child in the command's own process group: a Ctrl-C
in the terminal kills it while the learners train on, and a SIGKILL of the command leaves it
running. The temporary server is `flows.serve.prefect_server`: a session of its own, dead with the
command even on SIGKILL, on loopback, asking for a random auth string that only this process and
the server's environment hold (learners inherit no Prefect credential, infra/supervision.py), with no UI
and cross-origin requests from its own origin only, its PREFECT_HOME in a folder of this process's
(mode 0700, removed on exit; a SIGKILL leaves it in the system's temporary folder) and its database
readable by its user only.
"""

from __future__ import annotations

import socket
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from flows.serve import SERVER_LOG, new_auth_string, prefect_server

# `prefect server start` answers its health check 5 to 12 s after it starts on an idle machine; a
# first start creates its database, and a busy machine is slower.
STARTUP_TIMEOUT_S = 120


class ServerDidNotStart(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def prefect_api():
    """This thread's Prefect client pointed at an API for the body: $PREFECT_API_URL's when it is set
    (as it is), else a temporary server's, stopped on exit. `ServerDidNotStart` with the end of its log
    when it does not answer."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="archipelago-prefect-") as folder, ExitStack() as stack:
        home = Path(folder) / "home"
        home.mkdir(mode=0o700)
        auth_string = new_auth_string()
        try:
            api_url = stack.enter_context(prefect_server(free_port(), home, Path(folder), auth_string,
                                                         STARTUP_TIMEOUT_S, ui=False))
        except TimeoutError as err:
            log = (Path(folder) / SERVER_LOG).read_text(errors="replace").strip().splitlines()[-5:]
            raise ServerDidNotStart(f"{err}; its log ends: " + " | ".join(log)) from None
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}))
        stack.callback(_send_what_is_queued)
        yield


def _send_what_is_queued() -> None:
    """Send the logs and events the flow queued for the API while the server still answers (at exit,
    Prefect's workers would find it gone and print connection errors)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)
    EventsWorker.drain_all(timeout=5)
