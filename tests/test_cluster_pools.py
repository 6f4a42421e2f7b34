"""Islands on the schedulers clusters have: a Kubernetes work pool generated from the spec, rendered
into a segment's Job by prefect-kubernetes against a real Prefect server (no cluster needed), and the
srun launcher of a process pool on a Slurm login node."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main as archipelago
from flows.cli_run import load_spec_or_say_why
from infra.launch import (GUARDED, LEARNER_MODULE, NODE_LAUNCHER_MODULE, PARENT_PID, SLURM_STEP_DAEMON, LearnerProcess,
                          srun_wrapper)
from infra.spec import SpecError, parse_spec, spec_sha256
from training.stages import train_learner

REPO = Path(__file__).resolve().parents[1]
K8S_CONFIG = REPO / "configs" / "two-sites-k8s.yaml"


def shipped_k8s_spec(tmp_path: Path, prefix: str) -> Path:
    """configs/two-sites-k8s.yaml with its islands renamed `<prefix>-east` and `<prefix>-west`: the
    session's Prefect server is shared, and other tests make process pools named after east and west."""
    raw = yaml.safe_load(K8S_CONFIG.read_text())
    for island in raw["islands"]:
        island["name"] = f"{prefix}-{island['name']}"
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_kubernetes_pool_renders_a_segment_job_with_the_specs_gpus_secret_references_and_no_command(
        prefect_api, tmp_path, monkeypatch, capsys):
    """`archipelago deploy` of the shipped Kubernetes example makes east's pool a Kubernetes pool whose
    template prefect-kubernetes renders, for a real flow run of east's segment deployment, into a Job
    that runs the spec's image with its GPUs and reads every store key by reference; a run that tries
    to pick the command, environment, image or namespace is refused by the server."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from flows.cluster_pools import RUN_VARIABLES, secret_key_variables

    config = shipped_k8s_spec(tmp_path, "k8s")
    spec = load_spec_or_say_why(str(config), host_keys="read")  # signed with this host's keys, as deploy does
    east, west = spec.islands
    keys = secret_key_variables(spec, east.name)
    # East's signing key is a key of its Secret too, so its pods sign; west's and the control plane's are not.
    assert keys == sorted(["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "EAST_AWS_ACCESS_KEY_ID",
                           "EAST_AWS_SECRET_ACCESS_KEY", "WEST_READ_AWS_ACCESS_KEY_ID", "WEST_READ_AWS_SECRET_ACCESS_KEY",
                           east.signing.private_key_env])
    assert east.signing.private_key_env == "ARCHIPELAGO_SIGNING_KEY_K8S_EAST"
    # The keys' values are in the environment of the process that deploys and renders: none may reach the Job.
    values = {name: f"value-of-{name}-do-not-leak" for name in keys}
    for name, value in values.items():
        monkeypatch.setenv(name, value)

    assert archipelago(["deploy", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "prefect worker start --pool island-k8s-east --type kubernetes" in printed
    assert "prefect worker start --pool island-k8s-west --type process" in printed
    assert ("kubectl -n archipelago create secret generic archipelago-k8s-east "
            + " ".join(f"--from-literal={name}=..." for name in keys)) in printed

    async def render(job_variables: dict | None = None):
        async with get_client() as client:
            pool = await client.read_work_pool("island-k8s-east")
            deployment = await client.read_deployment_by_name("segment/island-k8s-east")
            flow_run = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": spec.model_dump(mode="json"), "run_id": "r", "island": east.name},
                job_variables=job_variables)
            flow = await client.read_flow(deployment.flow_id)
            configuration = await KubernetesWorkerJobConfiguration.from_template_and_values(
                pool.base_job_template, {**(deployment.job_variables or {}), **(flow_run.job_variables or {})})
            configuration.prepare_for_flow_run(flow_run, deployment, flow, pool)
            return pool, (await client.read_work_pool("island-k8s-west")).type, configuration

    pool, west_type, configuration = asyncio.run(render())
    assert (pool.type, west_type) == ("kubernetes", "process")
    assert set(pool.base_job_template["variables"]["properties"]) == set(RUN_VARIABLES)
    manifest = configuration.job_manifest
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == east.pool.image == "registry.example.com/archipelago:0.1.0"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": east.processes_per_learner},
                                      "requests": {"cpu": "8", "memory": "64Gi"}}
    assert east.processes_per_learner == 2
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert manifest["metadata"]["namespace"] == "archipelago" and configuration.namespace == "archipelago"
    # No command of the template's: the worker's own engine command, which the run cannot change.
    assert "command" not in container and container["args"] == ["prefect", "flow-run", "execute"]
    references = {entry["name"]: entry["valueFrom"] for entry in container["env"] if "valueFrom" in entry}
    assert references == {name: {"secretKeyRef": {"name": "archipelago-k8s-east", "key": name}} for name in keys}
    plain = {entry["name"]: entry["value"] for entry in container["env"] if "value" in entry}
    assert plain["PREFECT__FLOW_RUN_ID"] and not set(plain) & set(keys)
    rendered = json.dumps(manifest)
    assert not [name for name, value in values.items() if value in rendered]

    async def refused(job_variables: dict) -> tuple[int, str]:
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("segment/island-k8s-east")
            with pytest.raises(PrefectHTTPStatusError) as refusal:
                await client.create_flow_run_from_deployment(
                    deployment.id, parameters={"spec": spec.model_dump(mode="json"), "run_id": "r", "island": east.name},
                    job_variables=job_variables)
            return refusal.value.response.status_code, refusal.value.response.json()["detail"]

    attacks = {"command": "touch /tmp/never", "env": {"PYTHONPATH": "/tmp"}, "image": "attacker/image",
               "namespace": "kube-system", "service_account_name": "admin", "cluster_config": {}}
    for name, value in attacks.items():
        status, detail = asyncio.run(refused({name: value}))
        assert status == 422 and f"'{name}' was unexpected" in detail, (name, detail)
    # What a run may set still reaches its Job.
    _, _, kept = asyncio.run(render({"finished_job_ttl": 600}))
    assert kept.job_manifest["spec"]["ttlSecondsAfterFinished"] == 600


def test_deploy_refuses_to_turn_a_process_pool_into_a_kubernetes_one(prefect_api, tmp_path, capsys):
    raw = yaml.safe_load(shipped_k8s_spec(tmp_path, "moved").read_text())
    east_pool = raw["islands"][0].pop("pool")
    process = tmp_path / "process.yaml"
    process.write_text(yaml.safe_dump(raw))
    assert archipelago(["deploy", str(process)]) == 0
    raw["islands"][0]["pool"] = east_pool
    kubernetes = tmp_path / "kubernetes.yaml"
    kubernetes.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert archipelago(["deploy", str(kubernetes)]) == 2
    assert ("work pool island-moved-east exists as a process pool and the spec asks for kubernetes: delete it "
            "(prefect work-pool delete island-moved-east)") in capsys.readouterr().err


def k8s_raw(**island) -> dict:
    return {"islands": [{"name": "east", "learners": 1, "batch_size": 4, "seq_len": 16, "inner_steps": 2,
                         "pool": {"type": "kubernetes", "image": "archipelago:1"}, **island}],
            "data": {"corpora": [{"name": "prose", "source": "shakespeare"}]}, "sync": {"mode": "butterfly", "rounds": 2},
            "store": {"url": "s3://runs/archipelago"}}


@pytest.mark.parametrize("change, problem", [
    ({"pool": {"type": "kubernetes"}}, "islands.0.pool: Value error, a kubernetes pool needs image"),
    ({"pool": {"image": "archipelago:1"}}, "image: only for type kubernetes (this pool is a process pool)"),
    ({"pool": {"type": "kubernetes", "image": "archipelago:1", "launcher": "srun"}},
     "launcher srun is for process pools"),
    ({"pool": {"type": "kubernetes", "image": "archipelago:1", "memory": "lots"}}, "islands.0.pool.memory"),
    ({"processes_per_learner": 4, "nodes_per_learner": 2, "network_interface": "ib0"},
     "island east: a kubernetes pool runs a segment in one pod, on one node: nodes_per_learner must be 1, not 2"),
    ({"store": {"url": "/data/east"}},
     "islands.0.store.url: islands ['east'] run in Kubernetes pods, which reach no local folder of another host"),
])
def test_a_pool_that_cannot_work_is_refused_when_the_spec_loads(change, problem):
    with pytest.raises(SpecError) as refusal:
        parse_spec(k8s_raw(**change))
    assert problem in str(refusal.value)


@pytest.mark.parametrize("pool", [{"type": "kubernetes", "image": "archipelago:1"}, {}, {"launcher": "srun"}])
def test_a_pool_reads_back_from_the_json_a_run_keeps_of_its_spec(pool):
    spec = parse_spec(k8s_raw(pool=pool))
    assert parse_spec(spec.model_dump(mode="json")) == spec


def test_the_srun_launcher_starts_a_learner_as_a_slurm_job_from_a_guarded_srun():
    """A cuda island with `pool.launcher: srun`: the learner's command is srun (in a guarded process,
    so it dies with the segment) on one node with the learner's GPUs, then the usual guarded learner;
    the learner's node sees it started by slurmstepd. Keys travel in the environment, never here."""
    spec = parse_spec({**k8s_raw(device="cuda", processes_per_learner=4, pool={"launcher": "srun"}),
                       "store": {"url": "s3://runs/archipelago", "credentials_env": "RUNS"}})
    (island,) = spec.islands
    learner = LearnerProcess(0, island.processes_per_learner, 8, wrapper=srun_wrapper(island), spec_sha256="0" * 64)
    command = learner.command("s3://runs/archipelago", None, "r", "RUNS")
    srun = [*GUARDED, "srun", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=4", "--job-name=archipelago-east",
            "--kill-on-bad-exit=1", f"--export=ALL,{PARENT_PID}={SLURM_STEP_DAEMON}"]
    assert command[:len(srun)] == srun
    rest = command[len(srun):]
    assert rest[:len(GUARDED) + 1] == [*GUARDED, "torch.distributed.run"]
    assert rest[rest.index("--nproc-per-node=4") + 1:][:3] == ["-m", "infra.launch", LEARNER_MODULE]
    assert "RUNS" in rest and not any("AWS" in part for part in command)
    cpu = parse_spec(k8s_raw(pool={"launcher": "srun"})).islands[0]
    assert not any(part.startswith("--gpus") for part in srun_wrapper(cpu))


def test_a_learner_on_several_nodes_under_srun_is_one_job_with_a_node_launcher_on_each(tmp_path, monkeypatch):
    """A cuda learner of 8 processes on 2 nodes: the segment runs one srun, a task on each node with
    that node's 4 GPUs, and the task is the node launcher (training/node.py), which takes its node rank
    from Slurm. The srun here records what it was given: its command line, and the store key that
    reached it through the environment and nowhere else."""
    record = tmp_path / "srun-arguments"
    (tmp_path / "bin").mkdir()
    fake_srun = tmp_path / "bin" / "srun"
    fake_srun.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\n"
                         f"printf '%s' \"$RUNS_AWS_SECRET_ACCESS_KEY\" > {record}.key\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_srun.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("RUNS_AWS_SECRET_ACCESS_KEY", "runs-secret-key")
    spec = parse_spec({**k8s_raw(device="cuda", batch_size=8, processes_per_learner=8, nodes_per_learner=2,
                                 network_interface="ib0", pool={"launcher": "srun"}),
                       "store": {"url": str(tmp_path / "store"), "credentials_env": "RUNS"}})
    assert train_learner(spec, "r", 0, print)["finished"] is False
    arguments = record.read_text().splitlines()
    assert arguments == ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--job-name=archipelago-east",
                         "--kill-on-bad-exit=1", f"--export=ALL,{PARENT_PID}={SLURM_STEP_DAEMON}",
                         *GUARDED, NODE_LAUNCHER_MODULE, "--store", str(tmp_path / "store"), "--run-id", "r",
                         "--spec-sha256", spec_sha256(spec), "--learner", "0", "--credentials-env", "RUNS"]
    assert (tmp_path / "srun-arguments.key").read_text() == "runs-secret-key"


@pytest.mark.integration  # guarded learner processes of its own, each importing torch
def test_a_learner_told_srun_started_it_runs_only_under_slurmstepd(tmp_path):
    """The parent check a learner makes: under srun its parent is Slurm's step daemon (here a shell
    named slurmstepd) and it starts; a process merely claiming srun started it is refused."""
    env = {**os.environ, PARENT_PID: SLURM_STEP_DAEMON, "PYTHONPATH": str(REPO)}
    learner = [*GUARDED, "platform"]  # a guarded process running the stdlib's `python -m platform`
    claimed = subprocess.run(learner, env=env, capture_output=True, text=True, timeout=120)
    assert claimed.returncode != 0 and f"is not {SLURM_STEP_DAEMON}; not starting" in claimed.stderr
    step_daemon = tmp_path / SLURM_STEP_DAEMON
    step_daemon.symlink_to("/bin/sh")
    script = " ".join(f"'{part}'" for part in learner) + "; exit $?"  # a child, not an exec
    started = subprocess.run([str(step_daemon), "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().startswith(("Linux", "linux"))


def test_the_dockerfile_installs_the_project_with_cuda_torch_and_its_extras_as_a_non_root_user():
    """What can be checked without a Docker daemon or registry: the instructions, the torch it pins
    (the same command the build runs, run here; a CUDA build unless TORCH_VARIANT says cpu), that the image
    gets every package pyproject.toml ships and every extra but the tests'."""
    import shlex
    import tomllib

    text = (REPO / "Dockerfile").read_text().replace("\\\n", "")
    instructions = [line.split(maxsplit=1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert instructions[0] == ["FROM", "python:3.11-slim"]
    assert ["ARG", "TORCH_VARIANT=cu128"] in instructions
    assert ["ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}"] in instructions
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    (torch_run,) = [run for run in runs if "$TORCH_INDEX_URL" in run]
    with_python = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `python`, as in the image
    pinned = subprocess.run(["sh", "-c", "echo " + torch_run.split('"$TORCH_INDEX_URL" ', 1)[1]], cwd=REPO,
                            env=with_python, capture_output=True, text=True, check=True).stdout.strip()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pinned.startswith("torch==") and pinned in pyproject["project"]["dependencies"]
    (extras,) = [run.split('pip install ".[', 1)[1].split("]")[0] for run in runs if 'pip install ".[' in run]
    assert set(extras.split(",")) == set(pyproject["project"]["optional-dependencies"]) - {"test"}
    copied = {shlex.split(rest)[0] for keyword, rest in instructions if keyword == "COPY"}
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignored and all(f"!{path}" in ignored for path in copied)
    user = [rest for keyword, rest in instructions if keyword == "USER"][-1]
    assert user.isdigit() and int(user) > 0
