"""The README's two-site quick start, followed on one machine the way a user follows it: a SeaweedFS
server per site, one Prefect server asking for an auth string (started as `archipelago serve` starts
it), the sites' keys as Secret blocks, the pools and deployments made by `archipelago deploy`, one
worker per pool with the environment the quick start names, started outside the repository (a site
has the project installed, not this checkout's path), and the run started from the `lifecycle`
deployment with `prefect deployment run`; standard training runs on west's pool (`evaluation.baseline_island`)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import pytest
import yaml

from flows.serve import AUTH_STRING_ENV, WORKER_GRACE_S, _started, prefect_server
from infra import layout
from infra.seaweed import seaweed_server
from infra.spec import load_spec
from infra.store import run_store
from tests.corpora import corpus_folder
from tests.test_ui import free_port

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 420
POOLS = ("archipelago", "island-east", "island-west")


def command(*args: str, env: dict, cwd, timeout: float = 120) -> str:
    """A command of the quick start (`prefect`, `archipelago`) run from `cwd`; its output."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def worker_environment(client_env: dict, run_store_server) -> dict:
    """A worker's environment as step 5 gives it: the Prefect client's settings and the run's store's key,
    no other AWS key, and no PYTHONPATH (the project is installed in the venv)."""
    env = {name: value for name, value in client_env.items() if not name.startswith("AWS_") and name != "PYTHONPATH"}
    return {**env, "AWS_ACCESS_KEY_ID": run_store_server.access_key,
            "AWS_SECRET_ACCESS_KEY": run_store_server.secret_key,
            # Faster polls than Prefect's default 10 s, so the test waits less between stages.
            "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "2"}


def test_the_two_site_quick_start_runs_a_deployment_to_its_report(tmp_path, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 400)
    logs = tmp_path / "logs"
    logs.mkdir()
    # 1. A bucket per site, each with its own key; the run's store is east's bucket.
    with seaweed_server(tmp_path / "east-s3", buckets=("east-runs",)) as east, \
            seaweed_server(tmp_path / "west-s3", buckets=("west-runs",)) as west:
        # 2. One Prefect server that asks every client for an auth string; the sites' keys as Secret blocks.
        auth_string = f"archipelago:{secrets.token_urlsafe(32)}"
        with prefect_server(free_port(), tmp_path / "server-home", logs, auth_string) as api_url:
            client_env = {**os.environ, "PREFECT_HOME": str(tmp_path / "client-home"), "PREFECT_API_URL": api_url,
                          AUTH_STRING_ENV: auth_string}
            with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}):
                for site, server in (("east", east), ("west", west)):
                    Secret(value={"aws_access_key_id": server.access_key,
                                   "aws_secret_access_key": server.secret_key}).save(f"{site}-store-keys")
            # 4. The spec: each island's store on its own site, keys from its block; the signing sections
            # `archipelago keys` prints (a key pair per writer, the private keys into files).
            keys = yaml.safe_load(command("flows.cli", "keys", "east", "west", "--out", str(tmp_path / "keys"),
                                          env=client_env, cwd=tmp_path))
            signing = {island["name"]: island["signing"] for island in keys["islands"]}
            config = tmp_path / "two-sites.yaml"
            config.write_text(yaml.safe_dump({
                "name": "quickstart",
                "islands": [{"name": site, "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 2,
                             "store": {"url": f"s3://{site}-runs/islands", "endpoint_url": server.endpoint_url,
                                       "credentials_env": site.upper(), "credentials_block": f"{site}-store-keys",
                                       "read_credentials_env": f"{site.upper()}_READ",
                                       "read_credentials_block": f"{site}-store-keys"},
                             "signing": signing[site]}
                            for site, server in (("east", east), ("west", west))],
                "model": {"layers": 1, "width": 32, "heads": 2},
                "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                                      "eval_fraction": 0.2}]},
                "training": {"warmup_steps": 1},
                # Standard training on west's pool, not on the control plane's.
                "evaluation": {"baseline_island": "west"},
                "sync": {"mode": "butterfly", "rounds": 3, "partner_timeout_s": 60},
                "store": {"url": "s3://east-runs/archipelago", "endpoint_url": east.endpoint_url},
                "signing": keys["signing"],
            }))
            spec = load_spec(config)
            # 5. The pools, with the job template that lets no run choose its command, environment or folder,
            # and the deployments, from the spec.
            command("flows.cli", "deploy", str(config), env=client_env, cwd=tmp_path)
            # 6. A worker per pool, in a folder of its own. Each needs the run store's key; an island's own keys come from its block.
            # The control plane's needs the data root too (this session's, already in the environment).
            worker_env = worker_environment(client_env, east)
            # Each writer's private key, from the file `archipelago keys` made. At real sites each worker holds
            # only its own writer's; here one machine plays every site, and its learners inherit only their own.
            for writer, section in [("control", keys["signing"]), *signing.items()]:
                worker_env[section["private_key_env"]] = (tmp_path / "keys" / f"{writer}.key").read_text().strip()
            for pool in POOLS:
                (tmp_path / f"site-{pool}").mkdir()
            with _started([["env", "-C", str(tmp_path / f"site-{pool}"), sys.executable, "-m", "prefect", "worker",
                            "start", "--pool", pool] for pool in POOLS], worker_env,
                          [logs / f"worker-{pool}.log" for pool in POOLS], WORKER_GRACE_S):
                # 7. The run, from the lifecycle deployment, whose form defaults to the spec.
                started = command("prefect", "deployment", "run", "archipelago/lifecycle", "--watch",
                                  "--watch-interval", "2", "--watch-timeout", str(RUN_TIMEOUT_S), env=client_env,
                                  cwd=tmp_path, timeout=RUN_TIMEOUT_S + 60)
                with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}), \
                        get_client(sync_client=True) as client:
                    baselines = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["baseline"])))
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started).group(1)  # `command()` saw it end Completed
        assert [(run.work_pool_name, run.state.name) for run in baselines] == [("island-west", "Completed")]

        # Where the results appear: the report in the run's store, each learner's summary in its island's.
        run_id = f"quickstart-{flow_run_id.replace('-', '')}"
        for prefix, server in (("", east), ("EAST_", east), ("WEST_", west)):
            for name, value in server.env().items():
                monkeypatch.setenv(prefix + name, value)
        report = run_store(spec.store, run_id).get_json(layout.REPORT)
        assert set(report["evals"]) == {"text"}
        assert all(0 < scores["islands_bpb"] < 8 and 0 < scores["baseline_bpb"] < 8
                   for scores in report["evals"].values())
        assert report["faults"]["missed_exchanges"] == 0  # each site read the other's messages with its read key
        for learner, island in enumerate(spec.islands):
            summary = run_store(island.store, run_id).get_json(layout.learner_summary(learner))
            assert sorted(r["round"] for r in summary["rounds"]) == list(range(spec.sync.rounds)), island.name
