"""`archipelago serve`: a Prefect server, one process work pool and worker per island, and the deployments.

Work pools: `archipelago` runs the lifecycle (`archipelago/lifecycle`); `island-<name>` runs that
island's segments (`segment/island-<name>`). Locally each pool is a process pool with one worker;
on real infrastructure each island's worker runs at the island, and an island whose spec says
`pool.type: kubernetes` gets a Kubernetes pool (flows/cluster_pools.py) served by a Kubernetes
worker in its cluster.

The API asks every client for an auth string (Prefect's basic auth), and the pools' job template
offers no variable that picks what a worker executes (`locked_job_template`): whoever can reach the
UI without the string can do nothing, and one holding it can start the registered flows, not a
command of their choosing through a run's job variables.
"""

from __future__ import annotations

import asyncio
import copy
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from dateutil.rrule import DAILY, rrule
from prefect.deployments.runner import EntrypointType

from infra.guard import PARENT_PID, guarded_module
from infra.local_keys import SIGNING_KEY_PREFIX, owner_only_folder
from infra.spec import RunSpec
from infra.spec.windows import CapacityWindow
from tasks.segments import baseline_deployment, island_pool, segment_deployment

REPO_ROOT = Path(__file__).resolve().parents[1]
CONTROL_POOL = "archipelago"
# Seconds a stopped server has to close its database, and a stopped worker to end: a worker keeps
# nothing, and one shutting down may wait on a flow run it cancels, which its process group's kill ends.
SERVER_GRACE_S = 15
WORKER_GRACE_S = 5
LIFECYCLE_DEPLOYMENT = "archipelago/lifecycle"
PLAN_DEPLOYMENT = "plan/plan"
# The setting every client of the API (CLI, workers, flow runs) reads the auth string from; the
# server reads its own from PREFECT_SERVER_API_AUTH_STRING.
AUTH_STRING_ENV = "PREFECT_API_AUTH_STRING"
AUTH_STRING_FILE = "api-auth-string"
AUTH_USER = "archipelago"
# Job variables that choose what a worker executes or how: the command itself, the environment it
# runs in (PYTHONPATH or PYTHONSTARTUP name code to run) and the folder it starts in (its files join
# the flow run's import path).
EXECUTION_VARIABLES = ("command", "env", "working_dir")


# The server's log file, in the `log_dir` that `prefect_server` is given.
SERVER_LOG = "prefect-server.log"


def new_auth_string() -> str:
    """A fresh auth string, in the user:password form the UI's login takes."""
    return f"{AUTH_USER}:{secrets.token_urlsafe(32)}"


def api_auth_string(home: Path) -> str:
    """The string the API asks for: $PREFECT_API_AUTH_STRING if set, else the one kept in
    `home`/api-auth-string (mode 0600, made on first use, so a restarted server keeps it)."""
    if given := os.environ.get(AUTH_STRING_ENV):
        return given
    path = home / AUTH_STRING_FILE
    owner_only_folder(home)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise PermissionError(f"{path} is readable by other users: chmod 600 it, or delete it for a new one")
        return path.read_text().strip()
    with os.fdopen(fd, "w") as out:
        out.write(new_auth_string() + "\n")
    return path.read_text().strip()


def locked_job_template() -> dict:
    """Prefect's process job template without the variables in `EXECUTION_VARIABLES`: a flow run
    always starts as the worker's own engine command, in the worker's environment, in a fresh
    folder (its deployment's pull step moves it to the code). Other variables are refused: the
    server validates a run's job variables against this schema (422) before it exists."""
    from prefect.workers.process import ProcessWorker

    template = copy.deepcopy(ProcessWorker.get_default_base_job_template())
    for name in EXECUTION_VARIABLES:
        del template["job_configuration"][name], template["variables"]["properties"][name]
    template["variables"]["additionalProperties"] = False
    return template


def pools_of(spec: RunSpec) -> dict[str, str]:
    """Each work pool of the spec and its type (`archipelago` is a process pool)."""
    return {CONTROL_POOL: "process", **{island_pool(island.name): island.pool.type for island in spec.islands}}


def process_pools(spec: RunSpec) -> list[str]:
    return [pool for pool, kind in pools_of(spec).items() if kind == "process"]


def wait_healthy(api_url: str, timeout_s: float, server: subprocess.Popen | None = None) -> None:
    """Until the API at `api_url` answers; TimeoutError after `timeout_s`, or as soon as `server` exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise TimeoutError(f"the Prefect server for {api_url} exited (status {server.returncode}) "
                               "before it answered")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no Prefect server answered at {api_url}/health within {timeout_s:.0f} s")


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Stop processes we started, and their children (each leads its own process group): all are
    asked at once and given `grace_s` together, so a slow one does not hold up the others'."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def _started(commands: list[list[str]], env: dict, logs: list[Path], grace_s: float = SERVER_GRACE_S,
             umask: int = -1):
    """`commands` started, each in its own session with its output to its log (and the file mode mask
    `umask`, -1: this process's); stopped together on exit, with `grace_s` to end before they are killed."""
    processes = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with log.open("ab") as out:
                processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True, umask=umask))
        yield processes
    finally:
        _stop(processes, grace_s)


@contextmanager
def prefect_server(port: int, home: Path, log_dir: Path, auth_string: str, startup_timeout_s: float = 120,
                   host: str = "127.0.0.1", wrapper: tuple[str, ...] = (), ui: bool = True):
    """A `prefect server` bound to `host` (loopback, or an address inside a namespace of the caller's
    own, as the shaped-link bench gives its first island), started under the command prefix
    `wrapper` (which must exec it), answering only requests that carry `auth_string` (its health check
    excepted); yields its API URL. It answers cross-origin requests from its own origin only (and, with
    the `ui`, from the same port under the name localhost, which a browser may open it as), so no other
    web page the operator has open can use it. It runs in a session of its own (a Ctrl-C to the
    terminal's process group does not reach it), keeps its home (mode 0700) and files (its database)
    readable by its user only, and dies with the calling thread (`infra.guard`)."""
    owner_only_folder(home)
    origin = f"http://{host}:{port}"
    origins = [origin, f"http://localhost:{port}"] if ui and host == "127.0.0.1" else [origin]
    # The server signs nothing: no writer's key of this host's (infra/local_keys.py) reaches it.
    env = {**{name: value for name, value in os.environ.items() if not name.startswith(SIGNING_KEY_PREFIX)},
           "PREFECT_HOME": str(home), "PREFECT_SERVER_API_AUTH_STRING": auth_string, "PREFECT_SERVER_API_HOST": host,
           "PREFECT_SERVER_UI_ENABLED": str(ui).lower(), "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", PARENT_PID: str(os.getpid()), "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": ",".join(origins)}
    env.pop("PREFECT_API_URL", None)
    api_url = f"{origin}/api"
    with _started([[*wrapper, *guarded_module("prefect"), "server", "start"]], env, [log_dir / SERVER_LOG],
                  umask=0o077) as (server,):
        wait_healthy(api_url, startup_timeout_s, server)
        yield api_url


@contextmanager
def workers(pools: list[str], api_url: str, auth_string: str, log_dir: Path,
            wrappers: dict[str, tuple[str, ...]] | None = None, query_seconds: float = 2, prefetch_seconds: float = 10, log_batch_seconds: float = 2):
    """One process worker per work pool, each polling every `query_seconds` for runs scheduled up to
    `prefetch_seconds` ahead (it starts their processes early; Prefect holds each flow to its scheduled
    start); its flow runs send their logs to the API in batches every `log_batch_seconds`.
    `wrappers[pool]`: a command prefix the pool's worker starts under (the shaped-link bench
    starts each island's worker inside the island's network namespace, so its flow runs and learners
    live there)."""
    env = {**os.environ, "PREFECT_API_URL": api_url, AUTH_STRING_ENV: auth_string,
           "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds),
           "PREFECT_WORKER_PREFETCH_SECONDS": str(prefetch_seconds),
           "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": str(log_batch_seconds),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO_ROOT)}
    with _started([[*(wrappers or {}).get(pool, ()), sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                    "--type", "process", "--name", f"{pool}-worker"] for pool in pools],
                  env, [log_dir / f"worker-{pool}.log" for pool in pools], WORKER_GRACE_S):
        yield


class PoolTypeConflict(RuntimeError):
    pass


def pool_templates(spec: RunSpec) -> dict[str, tuple[str, dict]]:
    """Each pool's type and base job template: the locked process template, or for an island on
    Kubernetes the one generated from its spec."""
    from flows.cluster_pools import kubernetes_job_template

    process = ("process", locked_job_template())
    return {CONTROL_POOL: process, **{
        island_pool(island.name): ("kubernetes", kubernetes_job_template(spec, island.name))
        if island.pool.type == "kubernetes" else process for island in spec.islands}}


async def _ensure_pools(spec: RunSpec) -> None:
    """Create the spec's pools, or give pools made before the template the spec asks for; a pool of
    another type is refused (Prefect cannot change a pool's type)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        for name, (kind, template) in pool_templates(spec).items():
            try:
                existing = await client.read_work_pool(name)
            except ObjectNotFound:
                await client.create_work_pool(WorkPoolCreate(
                    name=name, type=kind, base_job_template=template,
                    description="Archipelago control plane" if name == CONTROL_POOL else f"Island {name[7:]}"))
                continue
            if existing.type != kind:
                raise PoolTypeConflict(f"work pool {name} exists as a {existing.type} pool and the spec asks for "
                                 f"{kind}: delete it (prefect work-pool delete {name}) and deploy again")
            if existing.base_job_template != template:
                await client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))


def _first_window(spec: RunSpec, now: datetime) -> tuple[str, int, CapacityWindow] | None:
    """The island, number and window that start first after `now`, if any."""
    ahead = [(island.name, n, w) for island in spec.islands for n, w in enumerate(island.ordered_windows)
             if w.start_at > now]
    return min(ahead, key=lambda item: item[2].start_at) if ahead else None


def capacity_schedules(spec: RunSpec, now: datetime) -> list:
    """The lifecycle's schedule when islands have capacity windows: once, at the earliest window's start.

    Each island's segments are then scheduled by the run itself at its own windows' starts.
    """
    from prefect.schedules import RRule

    first = _first_window(spec, now)
    if first is None:
        return []
    _, _, window = first
    local_start = window.local(window.start_at).replace(tzinfo=None)
    return [RRule(str(rrule(DAILY, count=1, dtstart=local_start)), timezone=window.timezone)]


def lifecycle_description(spec: RunSpec, now: datetime) -> str:
    """The `lifecycle` deployment's description: with capacity windows, when its schedule starts the
    run and which island trains when, which its RRule alone does not say."""
    from training.planning.markdown import windows_table
    from training.planning.windows import window_rows

    description = "Start an Archipelago run: its parameters form is the run spec."
    if not any(island.windows for island in spec.islands):
        return description
    first = _first_window(spec, now)
    if first is None:
        when = "No window starts after this deployment was made, so no run is scheduled: start one with Run."
    else:
        island, n, window = first
        when = (f"Scheduled once, at the start of island {island}'s window {n}: "
                f"{window.local(window.start_at):%Y-%m-%d %H:%M:%S} {window.timezone}.")
    return (f"{description}\n\n{when} Each island trains only inside its capacity windows, resuming in its next "
            f"one; its segments are flow runs `<run id>-<island>-window-<window>` on work pool `island-<island>`:"
            f"\n\n{windows_table(window_rows(spec))}")


def register(spec: RunSpec) -> dict[str, str]:
    """Work pools (with the locked job template) and deployments for this spec's islands, on the server
    the Prefect client is pointed at; returns {deployment name: id}.

    Each deployment's entrypoint is its flow's module path (`flows.deployments.segment`): a worker runs
    it from the project as installed in the worker's Python, with no pull step and no path of the
    machine that registered it, so a remote site needs only `pip install` of the same commit."""
    from flows.deployments import archipelago, baseline, plan, segment

    asyncio.run(_ensure_pools(spec))
    now = datetime.now(timezone.utc)

    ids: dict[str, str] = {}

    def deploy(deployment: str, flow, pool: str, **options) -> None:
        """`deployment` (`<flow name>/<name>`, the name runs of it are asked for by) of `flow`, on `pool`."""
        flow_name, _, name = deployment.partition("/")
        if flow_name != flow.name:
            raise ValueError(f"deployment {deployment} is not one of flow {flow.name}")
        ids[deployment] = str(flow.to_deployment(name=name, work_pool_name=pool,
                                                 entrypoint_type=EntrypointType.MODULE_PATH, **options).apply())

    deploy(LIFECYCLE_DEPLOYMENT, archipelago, CONTROL_POOL, parameters={"spec": spec.model_dump(mode="json")},
           schedules=capacity_schedules(spec, now), description=lifecycle_description(spec, now))
    deploy(PLAN_DEPLOYMENT, plan, CONTROL_POOL, parameters={"spec": spec.model_dump(mode="json")},
           description="Predict a run's utilisation, bytes and wall time on a link, without training it; with "
                       "capacity windows, the rounds each window holds and where an island waits on another.")
    for island in spec.islands:
        pool = island_pool(island.name)
        deploy(segment_deployment(island.name), segment, pool,
               description=f"Training segments of island {island.name}, started by the lifecycle per capacity window.")
        deploy(baseline_deployment(island.name), baseline, pool,
               description=f"Standard training on island {island.name}, when the spec's evaluation.baseline_island "
                           "names it.")
    return ids


@contextmanager
def served(spec: RunSpec, port: int, home: Path, log_dir: Path):
    """What `archipelago serve` runs: the server (asking for the auth string `api_auth_string(home)`),
    the pools and deployments, a worker per pool; yields (API URL, {deployment name: id}) with this
    thread's Prefect client pointed at the server and holding the string."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    log_dir.mkdir(parents=True, exist_ok=True)
    auth_string = api_auth_string(home)
    with prefect_server(port, home, log_dir, auth_string) as api_url, \
            temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}):
        deployments = register(spec)
        with workers(process_pools(spec), api_url, auth_string, log_dir):
            yield api_url, deployments


def serve(spec: RunSpec, port: int, home: Path, log_dir: Path) -> None:
    """Bring everything up and keep it up until interrupted."""
    with served(spec, port, home, log_dir) as (api_url, deployments):
        ui = api_url.removesuffix("/api")
        print(f"Prefect UI: {ui}", flush=True)
        secret = f"${AUTH_STRING_ENV}" if os.environ.get(AUTH_STRING_ENV) else home / AUTH_STRING_FILE
        print(f"  the UI and API ask for the auth string in {secret} (the UI's login takes it whole, "
              f"user:password); clients and workers read it from ${AUTH_STRING_ENV}", flush=True)
        for name, deployment_id in deployments.items():
            print(f"  deployment {name}: {ui}/deployments/deployment/{deployment_id}", flush=True)
        kinds = pools_of(spec)
        print(f"  work pools: {', '.join(p for p, k in kinds.items() if k == 'process')} (one worker each); "
              f"logs in {log_dir}", flush=True)
        if cluster := [pool for pool, kind in kinds.items() if kind != "process"]:
            print(f"  kubernetes pools: {', '.join(cluster)} (their workers run in the clusters)", flush=True)
        print("Ctrl-C stops the server and the workers.", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
