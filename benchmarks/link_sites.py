"""How the islands sit on the shaped link: each island's cores, its Prefect worker polling a server
across the link, its own store's spec and credentials, and the threads a standard-arm rank gets."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from benchmarks.netns import LinkPlan, log
from infra.launch import island_cores

# Prefect across the link, for the second island: its worker polls every 10 s (its runs are scheduled
# ahead, so a quicker poll only starts their processes sooner) and its flow runs ship logs in 10 s
# batches (Prefect's default, 2 s, is a request every 2 s while learners log every round).
WORKER_POLL_S = 10
LOG_BATCH_S = 10
# An islands arm schedules both islands' segments this far ahead, as a capacity window's start would,
# and the workers prefetch that far: each picks its run up at its next poll and starts its process
# (imports take seconds on busy cores), and Prefect holds both flows to the same start. Started as
# soon as each worker polled, or picked up only 10 s ahead (Prefect's default prefetch), one island
# began up to 8 s after the other, and its partners spent those seconds polling for it across the link.
SEGMENT_LEAD_S = 30.0
# Prefect's server, workers and flow-run processes would run on hosts' CPUs beside the accelerators,
# not on them; here they share the learners' cores. Each starts its own session, and the kernel
# shares CPU between sessions (autogroups) before processes, so the session gets the lowest priority:
# it takes what the learners leave. Learners start sessions of their own, at the normal priority.
# With the islands' processes on the same cores, one island's learners, started first, left the other
# island's segment (at that priority) next to no CPU until they waited on it: the second island's
# learners began 6 to 10 s after the first's. Hence `island_cores`.
CONTROL_PLANE_PRIORITY = ("sh", "-c", 'echo 19 > /proc/self/autogroup && exec "$@"', "control-plane")


def dp_threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


def warm_data_cache(specs) -> None:
    from training.data.corpora import shakespeare_files
    if any(c.source == "shakespeare" for spec in specs for c in spec.data.corpora):
        shakespeare_files()


def credentials_env(island: str) -> str:
    return f"ISLAND_{island.upper().replace('-', '_')}"


def arm_spec(path: str, rounds: int | None, endpoint_url: str, island_stores: dict[str, dict],
             checkpoint_every: int | None = None):
    from infra.spec import load_spec, parse_spec
    raw = load_spec(path).model_dump(mode="json")
    raw["store"] = {**raw["store"], "url": "s3://archipelago/shaped", "endpoint_url": endpoint_url}
    for island in raw["islands"]:
        if island["name"] in island_stores:
            island["store"] = {**raw["store"], **island_stores[island["name"]]}
    if rounds:
        raw["sync"]["rounds"] = rounds
    # As the shaped-link results were measured: the bench measures the link, and its spec has no keys.
    raw["unauthenticated"] = not raw.get("signing")
    if checkpoint_every:
        raw.setdefault("training", {})["checkpoint_every"] = checkpoint_every
    return parse_spec(raw)


@contextlib.contextmanager
def island_sites(plan: LinkPlan, spec, workdir: Path):
    """The islands as separate sites: a Prefect server in the first island's namespace, bound to its
    end of the link, and per island a worker polling that server from inside the island's own namespace
    (over the link, for the second island). The island's `segment` deployment, the one `make ui`
    registers, runs on that worker, so its learners start there. Yields the server's API URL."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.serve import api_auth_string, prefect_server, register, workers
    from tasks.segments import island_pool

    port = free_port(plan.server.address)
    auth_string = api_auth_string(workdir / "prefect-home")
    with prefect_server(port, workdir / "prefect-home", workdir, auth_string, host=plan.server.address,
                        wrapper=CONTROL_PLANE_PRIORITY) as api_url, \
            temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}):
        register(spec)
        pools = {island_pool(end.island): (*plan.exec_in(end.island), *island_cores(n, len(plan.ends)),
                                           *CONTROL_PLANE_PRIORITY) for n, end in enumerate(plan.ends)}
        # Not `make ui`'s 2 s: a poll from the second island crosses the link.
        with workers(list(pools), api_url, auth_string, workdir, wrappers=pools, query_seconds=WORKER_POLL_S,
                     prefetch_seconds=SEGMENT_LEAD_S + WORKER_POLL_S, log_batch_seconds=LOG_BATCH_S):
            log(f"Prefect server {api_url} in {plan.server.namespace}; a worker per island in its namespace: "
                f"{', '.join(pools)} (logs in {workdir})")
            yield api_url


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
