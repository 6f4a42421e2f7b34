"""An island's Kubernetes work pool: its base job template, generated from the run spec.

It starts from prefect-kubernetes' own template and fixes, from `islands[].pool`, everything that
decides what a segment's pod runs and as whom: the image (the project installed in it; code never
comes from a path of the deploying machine), the namespace, service account, node selector, CPU,
memory and GPUs, a non-root user, and the environment, which holds only references to the island's
Kubernetes Secret for its store keys and its signing key (the worker adds Prefect's own settings). No `command` or
`args` is set: the worker runs its own engine command. A run's job variables may set only how its Job is named,
retried, kept and watched (`RUN_VARIABLES`); the server refuses any other (422).
"""

from __future__ import annotations

import copy

from infra.authority import signing_section
from infra.s3 import CREDENTIAL_VARIABLES
from infra.spec import RunSpec
from infra.spec.island import IslandSpec
from infra.stores import island_credential_prefixes

# The Kubernetes template's variables a run may still set: none changes what runs, where, as whom, with
# which environment or resources.
RUN_VARIABLES = ("name", "backoff_limit", "finished_job_ttl", "job_watch_timeout_seconds",
                 "pod_watch_timeout_seconds", "stream_output")
# The S3 key a store's credentials_env prefixes (infra.s3.credentials_from_env reads these two; the
# session token is optional, and a pod cannot reference a Secret's key that is not there).
_KEY_VARIABLES = CREDENTIAL_VARIABLES[:2]


def _island(spec: RunSpec, name: str) -> IslandSpec:
    return next(i for i in spec.islands if i.name == name)


def store_secret(spec: RunSpec, island: str) -> str:
    """The Kubernetes Secret holding `island`'s store keys: `pool.secret`, else archipelago-<island>."""
    return _island(spec, island).pool.secret or f"archipelago-{island}"


def secret_key_variables(spec: RunSpec, island: str) -> list[str]:
    """The environment variables a segment of `island` reads from its Secret, each a key of it: the keys it
    opens its stores with (the run's store's, its own store's, and other islands' read-only keys,
    infra.stores) and, in a signed run, the island's own signing key, which its learners sign with."""
    prefixes = island_credential_prefixes(spec, island)
    variables = {f"{prefix}_{name}" if prefix else name for prefix in prefixes for name in _KEY_VARIABLES}
    if (signing := signing_section(spec, island)) is not None:
        variables.add(signing.private_key_env)
    return sorted(variables)


def pod_gpus(island: IslandSpec) -> int:
    """GPUs a segment's pod asks for: one per process of a learner (its learners share them), none on CPU."""
    return island.processes_per_learner if island.device == "cuda" else 0


def kubernetes_job_template(spec: RunSpec, island: str) -> dict:
    """The base job template of `island`'s Kubernetes work pool."""
    from prefect_kubernetes.worker import KubernetesWorker

    spec_island = _island(spec, island)
    pool, secret = spec_island.pool, store_secret(spec, island)
    template = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    configuration, variables = template["job_configuration"], template["variables"]
    env = [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}}
           for name in secret_key_variables(spec, island)]
    for name in ("command", "labels", "annotations", "cluster_config"):
        del configuration[name]
    configuration.update(env=env, namespace=pool.namespace)
    manifest = configuration["job_manifest"]
    manifest["metadata"].update(namespace=pool.namespace, labels={}, annotations={})
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    del container["args"]
    requests = {name: value for name, value in (("cpu", pool.cpu), ("memory", pool.memory)) if value}
    limits = {pool.gpu_resource: gpus} if (gpus := pod_gpus(spec_island)) else {}
    container.update(image=pool.image, imagePullPolicy=pool.image_pull_policy, env=env,
                     resources={key: value for key, value in (("requests", requests), ("limits", limits)) if value},
                     securityContext={"allowPrivilegeEscalation": False},
                     # A learner's processes share tensors and NCCL buffers through /dev/shm, which a
                     # container gets only 64 MB of unless it mounts its own.
                     volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}])
    pod.update(securityContext={"runAsNonRoot": True}, volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}])
    del pod["serviceAccountName"]
    if pool.service_account:
        pod["serviceAccountName"] = pool.service_account
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    variables["properties"] = {name: schema for name, schema in variables["properties"].items() if name in RUN_VARIABLES}
    variables["additionalProperties"] = False
    del variables["definitions"]  # the cluster_config block's schema, no longer offered
    return template
