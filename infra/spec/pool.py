"""Where an island's segments run: the `islands[].pool` section of a run spec.

A process pool runs a segment as a process of the island's worker, which starts the learners on its
own host (`launcher: local`) or through Slurm's `srun` from a login node (`launcher: srun`). A
Kubernetes pool runs each segment as a Job whose pod holds the island's learners; its job template
is generated from this section (flows/cluster_pools.py), and nothing a run passes can change it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.spec.base import SpecModel

# Kubernetes names: a DNS-1123 label (namespaces), a DNS-1123 subdomain (secrets, service accounts).
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
# A resource quantity as Kubernetes writes one: 500m, 2, 1.5, 16Gi.
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
_KUBERNETES_FIELDS = ("image", "namespace", "image_pull_policy", "service_account", "gpu_resource", "cpu",
                      "memory", "node_selector", "secret")


class PoolSpec(SpecModel):
    """An island's work pool: where and how its segments run. The default, a process pool launching
    locally, needs nothing but a worker on the island's host."""

    type: Literal["process", "kubernetes"] = Field(
        "process", description="process: a Prefect process worker runs each segment as a process on its host; "
                               "kubernetes: a Prefect Kubernetes worker runs each segment as a Job, one pod "
                               "holding the island's learners.")
    launcher: Literal["local", "srun"] = Field(
        "local", description="How a process pool's segment starts each learner: local (processes on the worker's "
                             "host) or srun (a Slurm job per learner, one task on each node it spans, from a worker "
                             "on the cluster's login node; the project's Python at the same path on every node).")
    image: str | None = Field(
        None, max_length=512, pattern=r"^[^\s]+$",
        description="Container image of a kubernetes pool's segments, with the project installed (the repository's "
                    "Dockerfile builds one); a run cannot choose another.")
    namespace: str = Field("default", pattern=_DNS_LABEL, description="Kubernetes namespace of the segments' Jobs.")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the image.")
    service_account: str | None = Field(
        None, pattern=_DNS_SUBDOMAIN, description="Service account of the segments' pods. Empty: the namespace's default.")
    gpu_resource: str = Field(
        "nvidia.com/gpu", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Extended resource a cuda island's pod asks for its GPUs: processes_per_learner of them, "
                    "which the island's learners share (rank r of each learner on GPU r).")
    cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU the pod requests, as Kubernetes writes it (e.g. 16, 500m).")
    memory: str | None = Field(None, pattern=_QUANTITY, description="Memory the pod requests (e.g. 64Gi).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=16,
        description="Node labels the pod must run on (e.g. a GPU model's label).")
    secret: str | None = Field(
        None, pattern=_DNS_SUBDOMAIN,
        description="Kubernetes Secret in the namespace holding the island's store keys, one key per environment "
                    "variable (`archipelago deploy` lists them); the pod reads them by reference. "
                    "Empty: archipelago-<island>.")

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "PoolSpec":
        if self.type == "kubernetes":
            if self.image is None:
                raise ValueError("a kubernetes pool needs image: the container image its segments run in")
            if self.launcher != "local":
                raise ValueError(f"launcher {self.launcher} is for process pools; a kubernetes pool starts the "
                                 "learners in its pod")
        else:
            # Compared with the defaults, not the fields given: a spec read back from its JSON has every field.
            misplaced = [name for name in _KUBERNETES_FIELDS
                         if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: only for type kubernetes (this pool is a process pool)")
        return self
