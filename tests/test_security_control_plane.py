"""The control plane as a hostile user of the UI would try it, against a server started the way
`archipelago serve` starts it: without the auth string nothing answers; with it, a custom run
cannot choose what a worker executes."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra import layout
from infra.spec import parse_spec
from infra.store import ObjectStore
from tests.corpora import corpus_folder
from tests.test_lifecycle import TINY
from tests.test_security_processes import learner_pids
from tests.test_ui import free_port
from training.data.shards import prepare_dataset

RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """`archipelago serve` of a two-island spec; yields (API URL, deployment ids, its Prefect home, its log folder)."""
    from flows.serve import served

    root = tmp_path_factory.mktemp("control-plane")
    spec = parse_spec({**TINY, "name": "hostile", "store": {"url": str(root / "store")}})
    with served(spec, free_port(), root / "prefect-home", root / "logs") as (api_url, deployments):
        yield api_url, deployments, root / "prefect-home", root / "logs"


def status_of(url: str, body: dict | None = None, auth: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_without_the_auth_string_the_api_answers_nothing_but_its_health(control_plane):
    """Attack: whoever reaches the port lists runs, reads Secret blocks with include_secrets=true,
    starts a run with a command of their own; before, all of it answered 200/201."""
    import base64

    from flows.serve import AUTH_STRING_FILE

    api_url, deployments, home, logs = control_plane
    deployment = deployments["segment/island-east"]
    requests = [(f"{api_url}/flow_runs/filter", {}), (f"{api_url}/block_documents/filter?include_secrets=true", {}),
                (f"{api_url}/variables/filter", {}), (f"{api_url}/work_pools/island-east", None),
                (f"{api_url}/deployments/{deployment}/create_flow_run",
                 {"job_variables": {"command": "touch /tmp/never"}})]
    wrong = "Basic " + base64.b64encode(b"archipelago:guess").decode()
    for url, body in requests:
        assert [status_of(url, body), status_of(url, body, wrong), status_of(url, body, "Bearer x")] == [401] * 3, url
    assert status_of(f"{api_url}/health") == 200  # Prefect leaves its health probe open

    # The string: a file only its owner reads, on no process's command line and in no log.
    secret_file = home / AUTH_STRING_FILE
    assert secret_file.stat().st_mode & 0o777 == 0o600
    password = secret_file.read_text().strip().split(":", 1)[1]
    assert len(password) >= 32
    right = "Basic " + base64.b64encode(secret_file.read_text().strip().encode()).decode()
    assert status_of(f"{api_url}/work_pools/island-east", auth=right) == 200
    command_lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command_lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    assert len(command_lines) > 5 and not any(password.encode() in line for line in command_lines)
    assert sorted(p.name for p in logs.iterdir()) and not any(password in p.read_text(errors="replace")
                                                              for p in logs.iterdir())


def test_a_custom_run_cannot_choose_the_command_environment_or_folder_a_worker_runs(control_plane, tmp_path):
    """Attack, holding the auth string: a custom run of a deployment that sets the job variable
    `command` (run anything), `env` (PYTHONPATH to a planted sitecustomize.py) or `working_dir`;
    before, the worker executed each. Through the deployment the server refuses them (422: the
    pools' schema has no such variables); a run made through the bare flow-run route, which the
    server does not validate, carries them to the worker, which ignores them: its template has no
    place for them, so the run executes the deployment's own flow, and nothing of the attacker's."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from flows.serve import CONTROL_POOL, PLAN_DEPLOYMENT

    marker = tmp_path / "marker"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('env')\n")
    attacks = {"command": f"touch {marker}", "env": {"PYTHONPATH": str(planted)}, "working_dir": str(planted)}

    async def attack():
        async with get_client() as client:
            plan = await client.read_deployment_by_name(PLAN_DEPLOYMENT)
            parameters = {**plan.parameters, "step_seconds": {"east": 0.1, "west": 0.1}}
            refusals = {}
            for name, value in attacks.items():
                with pytest.raises(PrefectHTTPStatusError) as refused:
                    await client.create_flow_run_from_deployment(plan.id, parameters=parameters,
                                                                 job_variables={name: value})
                refusals[name] = (refused.value.response.status_code, refused.value.response.json()["detail"])
            bare = await client._client.post("/flow_runs/", json={
                "flow_id": str(plan.flow_id), "deployment_id": str(plan.id), "work_pool_name": CONTROL_POOL,
                "parameters": parameters, "state": {"type": "SCHEDULED"}, "job_variables": attacks})
            assert bare.status_code == 201, bare.text
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not (run := await client.read_flow_run(bare.json()["id"])).state.is_final():
                assert time.monotonic() < deadline, f"the bare run is still {run.state.name}"
                await asyncio.sleep(2)
            return refusals, run

    refusals, run = asyncio.run(attack())
    for name, (status, detail) in refusals.items():
        assert status == 422 and f"'{name}' was unexpected" in detail, (name, detail)
    assert run.job_variables == attacks  # the server kept them; the worker had no use for them
    assert run.state.is_completed(), run.state.message  # the plan flow ran, by the worker's own command
    assert run.work_pool_name == CONTROL_POOL
    assert not marker.exists()


def test_an_island_runs_one_segment_of_a_run_at_a_time(control_plane, tmp_path):
    """Fault: a lifecycle dies (killed, or it lost its lease) while its island segments train, and
    the run is resumed; before, the resumed lifecycle started each island's segment beside the one
    still running, a second copy of every learner. East's learner here waits minutes for a partner
    in west that never starts, so its segment runs until cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from tasks.segments import run_segment, segment_tags, stop_segments

    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 400)
    spec = parse_spec({
        "name": "twice",
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}
                    for name in ("east", "west")],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"rounds": 100_000, "partner_timeout_s": 300},
        "store": {"url": str(tmp_path / "store")},
    })
    store = ObjectStore(spec.store.url).child("runs/twice")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    ended: dict[int, BaseException | None] = {}

    def segment(n: int) -> threading.Thread:
        def run() -> None:
            try:
                run_segment(spec, "twice", "east", n)
                ended[n] = None
            except BaseException as err:  # noqa: BLE001 - examined below
                ended[n] = err
        thread = threading.Thread(target=contextvars.copy_context().run, args=(run,))  # this thread's API settings
        thread.start()
        return thread

    def learner_started(other_than: set[int], thread: threading.Thread) -> set[int]:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (pids := set(learner_pids(spec.store.url)) - other_than):
            assert thread.is_alive() and time.monotonic() < deadline, f"no learner started: {ended}"
            time.sleep(0.2)
        return pids

    most = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            most.append(len(learner_pids(spec.store.url)))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    first = segment(0)
    first_learner = learner_started(set(), first)
    sampler.start()
    second = segment(1)  # what a resumed lifecycle asks for
    second_learner = learner_started(first_learner, second)
    stop_segments("twice", "the test is over", timeout_s=120)
    first.join(60)
    second.join(60)
    sampling.set()
    sampler.join()

    async def segments():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=segment_tags("twice", "east"))))
            return {run.name: run for run in runs}

    runs = asyncio.run(segments())
    window_0, window_1 = runs["twice-east-window-0"], runs["twice-east-window-1"]
    assert len(runs) == 2 and first_learner != second_learner
    assert max(most) == 1 and learner_pids(spec.store.url) == []
    for run in (window_0, window_1):  # Prefect calls a SIGTERM it cannot match to the cancel request a crash
        assert run.state.name == "Cancelled" or "termination signal" in run.state.message, run.state
    assert window_1.start_time > window_0.end_time  # the second began once the first was over
    assert all(isinstance(ended[n], RuntimeError) and ("ended Cancelled" in str(ended[n]) or "termination signal"
                                                       in str(ended[n])) for n in (0, 1)), ended


def test_the_served_control_plane_keeps_its_home_to_its_user_and_answers_no_other_origin(control_plane):
    """Attack: a web page the operator has open calls the API from its own origin. `archipelago serve`'s
    server grants no other origin (before, CORS `*`); its home is 0700 and its database 0600."""
    import stat

    api_url, _, home, _ = control_plane
    port = api_url.rsplit(":", 1)[1].split("/")[0]
    for origin, allowed in [("http://elsewhere.example", None), (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}")]:
        request = urllib.request.Request(f"{api_url}/health", headers={"Origin": origin})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.headers.get("access-control-allow-origin") == allowed, origin
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "prefect.db").stat().st_mode) == 0o600
