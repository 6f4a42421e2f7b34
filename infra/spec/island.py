"""A compute island of a run spec: its learners, how each shares its model over its processes, and
the memory and capacity they have; and a writer's signing keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.authority import public_key_of
from infra.spec.base import MAX_BATCH, MAX_LEARNER_PROCESSES, MAX_LIST, MAX_STEPS, SpecModel
from infra.spec.pool import PoolSpec
from infra.spec.store import StoreSpec
from infra.spec.windows import CapacityWindow


class SigningSpec(SpecModel):
    """A writer's signing keys (see infra/authority.py): the public key travels with the spec, the private
    key stays in the writer's environment."""

    public_key: str = Field(description="The writer's Ed25519 public key, base64 (`archipelago keys`).")
    private_key_env: str = Field(
        pattern=r"^[A-Z][A-Z0-9_]{0,63}$",
        description="Environment variable that holds the writer's Ed25519 private key (base64) where it runs; "
                    "only the variable's name is in the spec.")

    @field_validator("public_key")
    @classmethod
    def _an_ed25519_key(cls, text: str) -> str:
        public_key_of(text)
        return text


class IslandSpec(SpecModel):
    """A compute island (a site or cluster): its learners and their batch, how each learner spreads over
    processes and nodes, the memory it has, its own store, its capacity windows and its work pool."""

    name: str = Field(description="Island name, unique in the run (a site or cluster).",
                      pattern=r"^[a-z0-9][a-z0-9-]{0,31}$")
    accelerator: str = Field("cpu", description="Accelerator label, for reports (e.g. GB300, B300, cpu).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Torch device the island's learners train on.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Arithmetic of the inner steps' forward and backward passes: bf16 runs them under "
                            "autocast (the matrix units' fast format on current GPUs); weights, optimizer state, "
                            "messages and checkpoints stay fp32.")
    learners: int = Field(ge=1, le=64, description="Number of learners (model replicas) on this island.")
    batch_size: int = Field(ge=1, le=MAX_BATCH, description="Sequences per inner step, per learner.")
    seq_len: int = Field(ge=8, le=4096, description="Bytes per training sequence.")
    inner_steps: int = Field(ge=1, le=MAX_STEPS, description="Inner AdamW steps per round (H).")
    processes_per_learner: int = Field(
        1, ge=1, le=MAX_LEARNER_PROCESSES,
        description="Processes (one per accelerator) per learner, over all its nodes; more than one runs the "
                    "learner under torchrun.")
    parallelism: Literal["data_parallel", "fsdp"] = Field(
        "data_parallel",
        description="How a learner's processes share its model: data_parallel (every process a full replica, "
                    "gradients averaged) or fsdp (weights, gradients and optimizer state sharded over the "
                    "processes with FSDP2). Exchanges and checkpoints keep one canonical flat layout either way, "
                    "so islands of different parallelism train together and resume each other's checkpoints.")
    nodes_per_learner: int = Field(
        1, ge=1, le=MAX_LEARNER_PROCESSES,
        description="Hosts one learner spans; its processes are split evenly over them.")
    network_interface: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,14}$",
        description="Network interface the learner's processes rendezvous and communicate on (e.g. the "
                    "island's fabric); empty: loopback, which allows one node per learner only.")
    device_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one accelerator, GB: `plan` and `run` refuse a run whose ranks would not "
                                "fit it (training/planning/fit.py). Empty: not checked.")
    host_memory_gb: float | None = Field(
        None, gt=0, description="Memory of the host that holds a learner's rank 0, GB: the exchange's state (initial "
                                "weights, anchors, the outer optimizer's state, error-feedback residuals), staged "
                                "checkpoints and messages live there, and under device cpu the ranks themselves; "
                                "`plan` and `run` refuse a run that would not fit it (training/planning/host_memory.py). "
                                "Empty: the island runs here, its learners sharing this host's memory with those of "
                                "every other island that leaves it empty.")
    fsdp_mixed_precision: bool = Field(
        False, description="FSDP2's mixed precision, under parallelism fsdp with precision bf16: each layer's "
                           "parameters are gathered in bf16 for forward and backward and gradients reduced in fp32, "
                           "while the fp32 shards stay the weights the inner optimizer steps and exchanges read. "
                           "Drops autocast's whole bf16 copies of the weights on every rank and shrinks the gathered "
                           "layers; the residual stream runs in bf16.")
    activation_checkpointing: bool = Field(
        False, description="Keep only each transformer block's input through the forward pass and recompute the "
                           "block's activations in backward: activation memory of one block instead of all of "
                           "them, for about one more forward pass of compute per step.")
    store: StoreSpec | None = Field(
        None, description="The island's own object store (a bucket near its accelerators): its learners' shards, "
                          "checkpoints and messages live there, and only the messages partners on other islands "
                          "read cross the link. Empty: the run's store.")
    windows: list[CapacityWindow] = Field(
        default_factory=list, max_length=MAX_LIST,
        description="Reserved capacity windows; the island trains only inside them, resuming in the next one. "
                    "Empty: always available.")
    signing: SigningSpec | None = Field(
        None, description="The island's signing keys: its learners sign every record they write with them, and "
                          "readers refuse what they did not sign. Needs the run's `signing` too.")
    pool: PoolSpec = Field(
        default_factory=PoolSpec,
        description="The island's work pool (`island-<name>`), which `archipelago deploy` creates: a process pool "
                    "(learners on the worker's host, or through srun) or a kubernetes pool (a Job per segment).")

    @model_validator(mode="after")
    def _fits_its_pool(self) -> "IslandSpec":
        if self.pool.type == "kubernetes" and self.nodes_per_learner > 1:
            raise ValueError(f"island {self.name}: a kubernetes pool runs a segment in one pod, on one node: "
                             f"nodes_per_learner must be 1, not {self.nodes_per_learner}")
        return self

    @model_validator(mode="after")
    def _mixed_precision_needs_sharded_bf16(self) -> "IslandSpec":
        if self.fsdp_mixed_precision and not (self.parallelism == "fsdp" and self.processes_per_learner > 1
                                              and self.precision == "bf16"):
            raise ValueError(f"island {self.name}: fsdp_mixed_precision needs parallelism fsdp over more than one "
                             f"process and precision bf16 (not {self.parallelism} over {self.processes_per_learner} "
                             f"and {self.precision})")
        return self

    @model_validator(mode="after")
    def _batch_splits_over_processes(self) -> "IslandSpec":
        if self.batch_size % self.processes_per_learner:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by "
                             f"processes_per_learner {self.processes_per_learner}")
        return self

    @model_validator(mode="after")
    def _processes_split_over_nodes(self) -> "IslandSpec":
        if self.processes_per_learner % self.nodes_per_learner:
            raise ValueError(f"island {self.name}: processes_per_learner {self.processes_per_learner} must be "
                             f"divisible by nodes_per_learner {self.nodes_per_learner}")
        if self.nodes_per_learner > 1 and self.network_interface is None:
            raise ValueError(f"island {self.name}: a learner on {self.nodes_per_learner} nodes needs the "
                             f"network_interface its nodes reach each other on")
        return self

    @property
    def processes_per_node(self) -> int:
        return self.processes_per_learner // self.nodes_per_learner

    @model_validator(mode="after")
    def _windows_do_not_overlap(self) -> "IslandSpec":
        ordered = sorted(self.windows, key=lambda w: w.start_at)
        for earlier, later in zip(ordered, ordered[1:]):
            if later.start_at < earlier.end_at:
                raise ValueError(f"island {self.name}: window {later.describe()} overlaps {earlier.describe()}")
        return self

    @property
    def ordered_windows(self) -> list[CapacityWindow]:
        return sorted(self.windows, key=lambda w: w.start_at)
