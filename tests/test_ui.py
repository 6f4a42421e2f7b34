"""The Prefect UI path, end to end, in a real browser.

A real `prefect server`, one process worker per work pool and the deployments `archipelago serve`
registers; a tiny run started through the API the UI uses, failing once at evaluation, retried the
way the UI's Retry button does it; then headless Chromium renders the run, its task graph, the
island segments and the artifacts. Screenshots are kept under tests/output/ui.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import itertools
import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from infra.spec import parse_spec
from tests.test_lifecycle import TINY

pytestmark = pytest.mark.ui

OUTPUT = Path(__file__).resolve().parent / "output" / "ui"
RUN_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4: no port to reach
    it by), one page."""

    def __init__(self, profile: str):
        browser = shutil.which("chromium")
        assert browser, "chromium is missing: `apt-get install -y --no-install-recommends chromium` (make test does)"
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()

        def pipe_as_fds_3_and_4():
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self._process = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1400,1000", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4), preexec_fn=pipe_as_fds_3_and_4, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._ids = itertools.count(1)
        self._pending = b""
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def _call(self, method: str, session: str | None = None, **params) -> dict:
        call_id = next(self._ids)
        message = {"id": call_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while True:
            while b"\0" not in self._pending:
                assert time.monotonic() < deadline, f"chromium did not answer {method}"
                if select.select([self._from_browser], [], [], 1)[0]:
                    chunk = os.read(self._from_browser, 1 << 20)
                    assert chunk, f"chromium exited during {method}"
                    self._pending += chunk
            raw, self._pending = self._pending.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == call_id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def page(self, method: str, **params) -> dict:
        return self._call(method, self._session, **params)

    def evaluate(self, expression: str):
        return self.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, timeout_s: float = 60) -> None:
        """Go to `url` (it answers once the new document is committed) and wait until it has loaded."""
        self.page("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while self.evaluate("document.readyState") != "complete":
            assert time.monotonic() < deadline, f"{url} did not load"
            time.sleep(0.2)

    def log_in(self, origin: str, auth_string: str) -> None:
        """As the UI's login form does it: the auth string, base64-encoded, in the origin's localStorage
        (`prefect-password`), which the app sends as basic auth."""
        self.open(f"{origin}/robots.txt")
        token = base64.b64encode(auth_string.encode()).decode()
        self.evaluate(f"localStorage.setItem('prefect-password', {json.dumps(token)})")

    def render(self, url: str, screenshot: Path, expect: list[str], timeout_s: float = 90) -> str:
        """The page's DOM once the single-page app shows every text in `expect` (or after `timeout_s`),
        and a screenshot of it."""
        self.open(url)
        deadline = time.monotonic() + timeout_s
        while not all(text in (dom := self.evaluate("document.documentElement.outerHTML")) for text in expect) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1)  # the last fetched parts drawn
        dom = self.evaluate("document.documentElement.outerHTML")
        screenshot.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))
        return dom

    def close(self) -> None:
        with contextlib.suppress(OSError, AssertionError):
            self._call("Browser.close")
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@contextlib.contextmanager
def chromium():
    """One browser, with a profile of its own, for every page a test renders."""
    with tempfile.TemporaryDirectory() as profile:
        browser = Chromium(profile)
        try:
            yield browser
        finally:
            browser.close()


def wait_final(client, flow_run_id, after_run_count: int = 0):
    async def poll():
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            run = await client.read_flow_run(flow_run_id)
            if run.state.is_final() and run.run_count > after_run_count:
                return run
            await asyncio.sleep(2)
        raise TimeoutError(f"flow run {flow_run_id} still {run.state.name} after {RUN_TIMEOUT_S} s")
    return poll()


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory):
    """What `archipelago serve` starts: a Prefect server asking for an auth string, the work pools with a
    worker each, the deployments; yields (api url, spec, auth string)."""
    from flows.serve import api_auth_string, served

    root = tmp_path_factory.mktemp("ui")
    now = datetime.now(timezone.utc)
    spec = parse_spec({
        **TINY, "name": "ui",
        "islands": [{**TINY["islands"][0], "learners": 1,
                     "windows": [{"start": (now - timedelta(minutes=1)).isoformat(),
                                  "end": (now + timedelta(hours=2)).isoformat()}]},
                    {**TINY["islands"][1], "processes_per_learner": 1}],
        "sync": {**TINY["sync"], "rounds": 2},
        "store": {"url": str(root / "store")},
        "tracking": {"backend": "tensorboard", "uri": str(root / "tensorboard")},
        "faults": [{"kind": "fail_stage", "stage": "evaluate"}]})
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with served(spec, free_port(), root / "prefect-home", root) as (api_url, _):
        yield api_url, spec, api_auth_string(root / "prefect-home")


def test_a_run_from_the_ui_runs_islands_on_their_pools_reruns_what_failed_and_renders(ui_stack):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName,
                                                FlowRunFilter, FlowRunFilterId)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.states import State

    from flows.serve import LIFECYCLE_DEPLOYMENT

    api_url, spec, auth_string = ui_stack
    ui = api_url.removesuffix("/api")

    async def scenario():
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(LIFECYCLE_DEPLOYMENT)
            assert "spec" in deployment.parameter_openapi_schema["properties"]
            started = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": spec.model_dump(mode="json")})
            failed = await wait_final(client, started.id)
            assert failed.state.is_failed() and "evaluate failed on purpose" in failed.state.message
            # What the UI's Retry button sends.
            await client.set_flow_run_state(started.id, State(type=StateType.SCHEDULED, name="AwaitingRetry",
                                                              message="Retry from the UI"), force=True)
            done = await wait_final(client, started.id, after_run_count=failed.run_count)
            segments = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["segment"])))
            lifecycles = await client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["lifecycle"])), sort=FlowRunSort.START_TIME_DESC)
            retried = lifecycles[0]
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[retried.id])))
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=["bpb-table", "bpb-curve", "bpb-vs-tokens", "communication", "utilisation", "run-report",
                      "bpb-vs-tokens-png", "progress-learner-0", "progress-learner-1", "plan-vs-measured",
                      "tracker-run"])))
            return deployment, done, segments, retried, tasks, artifacts

    deployment, done, segments, retried, tasks, artifacts = asyncio.run(scenario())
    assert done.state.is_completed(), done.state.message
    run_id = f"ui-{done.id.hex}"

    # Each island's segment ran on that island's own work pool, once: the retry did not redo training.
    assert sorted((s.name, s.work_pool_name, s.state.name) for s in segments) == [
        (f"{run_id}-east-window-0", "island-east", "Completed"),
        (f"{run_id}-west-window-0", "island-west", "Completed")]
    assert done.work_pool_name == "archipelago"

    # The retry re-executed only what had not completed.
    states = {t.name: t.state.name for t in tasks}
    assert {n for n, s in states.items() if s == "Completed"} == {"evaluate", "evaluate-curve", "report", "figures"}
    assert {n for n, s in states.items() if s == "Cached"} == {
        "start-run", "prepare-data", "segments-east", "segments-west", "consolidate", "train-standard-baseline"}
    by_key = {a.key: a for a in artifacts}
    assert set(by_key) == {"bpb-table", "bpb-curve", "bpb-vs-tokens", "communication", "utilisation", "run-report",
                           "bpb-vs-tokens-png", "progress-learner-0", "progress-learner-1", "plan-vs-measured",
                           "tracker-run"}
    assert "| inter-island exchange bytes |" in by_key["plan-vs-measured"].data
    assert by_key["bpb-vs-tokens"].data.startswith("data:image/png;base64,")
    assert by_key["bpb-vs-tokens-png"].data.startswith("[bpb-vs-tokens.png in the run's store](file://")
    assert {a.data for k, a in by_key.items() if k.startswith("progress-")} == {100.0}

    # Without the auth string the UI shows nothing of the runs (its login form, or a 404 page: both say
    # "Authentication failed.")...
    with chromium() as browser:
        refused = browser.render(f"{ui}/runs/flow-run/{done.id}", OUTPUT / "0-unauthenticated.png",
                                 ["Authentication failed."])
        browser.log_in(ui, auth_string)
        # ...with it, what a person sees: the run spec as the deployment's run form (titles, descriptions, dropdowns)...
        form = browser.render(f"{ui}/deployments/deployment/{deployment.id}/run", OUTPUT / "0-run-form.png",
                              ["Inner Steps", "Bytes per training sequence."])
        # ...the run, its task graph, an island's segment on its work pool, and the artifacts...
        run_page = browser.render(f"{ui}/runs/flow-run/{done.id}", OUTPUT / "1-run.png", [done.name, "Completed"])
        graph_page = browser.render(f"{ui}/runs/flow-run/{retried.id}?tab=Task%20Runs",
                                    OUTPUT / "2-lifecycle-task-graph.png", ["figures", "segments-east"])
        east = next(s for s in segments if s.work_pool_name == "island-east")
        segment_page = browser.render(f"{ui}/runs/flow-run/{east.id}", OUTPUT / "3-east-segment.png", [east.name])
        plot_page = browser.render(f"{ui}/artifacts/artifact/{by_key['bpb-vs-tokens'].id}",
                                   OUTPUT / "4-bpb-vs-tokens.png", ["data:image/png;base64,"])
        table_page = browser.render(f"{ui}/artifacts/artifact/{by_key['bpb-table'].id}", OUTPUT / "5-bpb-table.png",
                                    ["islands_bpb"])
        # ...and, with tracking on, the link to the run's tracker run, whose event files the islands wrote.
        tracker = by_key["tracker-run"]
        tracker_page = browser.render(f"{ui}/artifacts/artifact/{tracker.id}", OUTPUT / "6-tracker-run.png",
                                      [f"tensorboard run {run_id}"])
    assert "Authentication failed." in refused and done.name not in refused
    assert "Inner Steps" in form and "Bytes per training sequence." in form and "Windows" in form
    assert re.search(r'<option[^>]*value="allreduce"', form), "the sync mode is not a dropdown"
    assert done.name in run_page and "Completed" in run_page
    assert "<canvas" in graph_page, "the task graph did not render"
    for name in ("segments-east", "segments-west", "evaluate-curve", "figures", "train-standard-baseline"):
        assert name in graph_page
    assert east.name in segment_page and "Work Pool" in segment_page and "island-east" in segment_page
    assert re.search(r'<img[^>]+src="data:image/png;base64,', plot_page), "the plot did not render as an image"
    assert "islands_bpb" in table_page and "prose" in table_page and "code" in table_page
    link = re.fullmatch(r"\[(.+)\]\((file://\S+)\)", tracker.data)
    assert link and link[1] == f"tensorboard run {run_id}" and link[2].endswith(f"/tensorboard/{run_id}")
    assert f"tensorboard run {run_id}" in tracker_page and f'href="{link[2]}"' in tracker_page
    assert list((Path(spec.tracking.uri) / run_id).rglob("events.out.tfevents.*"))
    assert all((OUTPUT / f).stat().st_size > 10_000 for f in (
        "0-run-form.png", "1-run.png", "2-lifecycle-task-graph.png", "3-east-segment.png", "4-bpb-vs-tokens.png",
        "5-bpb-table.png", "6-tracker-run.png"))
