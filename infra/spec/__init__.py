"""The run specification: one typed document that describes a whole run.

Everything a run does is derived from a `RunSpec`; it is validated before any work starts, so a
typo in a YAML file fails at load time with the offending field named, not halfway through
training. Every field carries a description because the Prefect UI renders this model as the
form a user fills in to start a run.

This package is the schema alone: each section in a module of its own (`infra.spec.sync`,
`infra.spec.island`, ...), the whole document and its loading here. It reads YAML and imports no
store, process or Prefect code, so anything may check a spec without reaching a store.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from infra.authority import CONTROL
from infra.objects import canonical_json, sha256
from infra.spec.base import MAX_ISLANDS, MAX_LEARNER_PROCESSES, MAX_LIST, SEED_LIMIT, SpecModel
from infra.spec.data import DataSpec
from infra.spec.evaluation import EvaluationSpec
from infra.spec.faults import Fault
from infra.spec.island import IslandSpec, SigningSpec
from infra.spec.model import BOS, BYTE_VOCAB, ModelSpec
from infra.spec.overrides import OverrideError, apply_overrides
from infra.spec.store import StoreSpec
from infra.spec.sync import SyncSpec
from infra.spec.tracking import TrackingSpec
from infra.spec.training import BaselineSpec, TrainingSpec

# What a learner's stall limit allows beyond its deadlines by default: its start, a slow inner step.
_STALL_MARGIN_S = 600.0


class RunSpec(SpecModel):
    """A whole run: its islands and their learners, the model, the data, how learners train and synchronise,
    where their objects live, and what the run is measured against."""

    name: str = Field("archipelago", pattern=r"^[a-z0-9][a-z0-9-]{0,47}$", description="Run name; prefixes the run id.")
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="Seed for initialisation and sampling (data.split_seed decides the split).")
    islands: list[IslandSpec] = Field(min_length=1, max_length=MAX_ISLANDS,
                                      description="Compute islands taking part in the run.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model: the built-in byte GPT or a transformers causal LM.")
    data: DataSpec = Field(description="Training corpora and held-out evaluations.")
    training: TrainingSpec = Field(default_factory=TrainingSpec,
                                   description="How each learner trains between exchanges, and checkpoints.")
    sync: SyncSpec = Field(description="How learners synchronise.")
    baseline: BaselineSpec = Field(default_factory=BaselineSpec, description="Standard training it is measured against.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="Where learners exchange state.")
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec, description="Evaluation settings.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec,
                                   description="Experiment tracker (TensorBoard, MLflow, W&B) the run is logged to.")
    faults: list[Fault] = Field(default_factory=list, max_length=MAX_LIST,
                                description="Faults to inject, for tests and drills.")
    signing: SigningSpec | None = Field(
        None, description="The control plane's signing keys. With them (and each island's), every record in the "
                          "stores is signed by its writer and checked by its readers; without, the run is "
                          "unauthenticated and says so when it starts and in its report. `archipelago run`, "
                          "`serve` and `deploy` fill it (and each island's) from keys of their own when a spec has "
                          "none and does not say unauthenticated.")
    unauthenticated: bool = Field(
        False, description="Run without signing keys: any writer of the run's stores could plant the records it "
                           "acts on. A spec with more than one store (islands with stores of their own) and no "
                           "signing keys must say so.")

    @model_validator(mode="after")
    def _every_writer_signs_or_none(self) -> "RunSpec":
        unsigned = [i.name for i in self.islands if i.signing is None]
        if self.signing is not None and unsigned:
            raise ValueError(f"signing: islands {unsigned} have no signing keys; give every island its own, or none")
        if self.signing is None and len(unsigned) < len(self.islands):
            raise ValueError("islands[].signing needs the control plane's keys too (signing)")
        if self.signing is not None and self.unauthenticated:
            raise ValueError("unauthenticated: true, but the spec has signing keys; drop one or the other")
        return self

    @model_validator(mode="after")
    def _run_store_credentials_from_the_environment(self) -> "RunSpec":
        # Prefect opens the run's store for the lifecycle's results before any flow code can load a block.
        if self.store.credentials_block:
            raise ValueError("store.credentials_block: the run's store is the control plane's; give its credentials "
                             "in the control plane's environment (credentials_env); blocks are for islands[].store")
        return self

    @model_validator(mode="after")
    def _pods_reach_every_store(self) -> "RunSpec":
        in_pods = [i.name for i in self.islands if i.pool.type == "kubernetes"]
        folders = [where for where, store in [("store.url", self.store)] + [
            (f"islands.{n}.store.url", i.store) for n, i in enumerate(self.islands) if i.store is not None]
            if not store.url.startswith("s3://")]
        if in_pods and folders:
            raise ValueError(f"{', '.join(folders)}: islands {in_pods} run in Kubernetes pods, which reach no "
                             f"local folder of another host; their stores must be s3://")
        return self

    @model_validator(mode="after")
    def _layout(self) -> "RunSpec":
        names = [i.name for i in self.islands]
        if len(set(names)) != len(names):
            raise ValueError(f"island names must be unique, got {names}")
        if CONTROL in names:
            raise ValueError(f"islands: {CONTROL!r} names the control plane's writer (its signing key), not an island")
        learners = sum(i.learners for i in self.islands)
        for n, fault in enumerate(self.faults):
            if getattr(fault, "learner", 0) >= learners:
                raise ValueError(f"faults.{n}.learner: {fault.learner} but the run has {learners} learners")
            if getattr(fault, "round", 0) >= self.sync.rounds:
                raise ValueError(f"faults.{n}.round: {fault.round} but the run has {self.sync.rounds} rounds")
        return self

    @model_validator(mode="after")
    def _baseline_island_exists(self) -> "RunSpec":
        island = self.evaluation.baseline_island
        if island is not None and island not in {i.name for i in self.islands}:
            raise ValueError(f"evaluation.baseline_island: {island!r} is not one of the islands "
                             f"{[i.name for i in self.islands]}")
        if island is not None and self.evaluation.baseline == "none":
            raise ValueError("evaluation.baseline_island: there is no baseline to place (evaluation.baseline: none)")
        return self

    @model_validator(mode="after")
    def _transport_fits(self) -> "RunSpec":
        transport = self.sync.transport
        if transport.fragments > self.model.blocks:
            raise ValueError(f"sync.transport.fragments: {transport.fragments} but the model has "
                             f"{self.model.blocks} blocks")
        shortest = min(i.inner_steps for i in self.islands)
        if transport.tau > shortest:
            raise ValueError(f"sync.transport.tau: {transport.tau} exceeds the fewest inner_steps of an island ({shortest})")
        return self

    @model_validator(mode="after")
    def _totals_fit(self, info: ValidationInfo) -> "RunSpec":
        # The model's size is bounded by the memory plan per rank and per host (training/planning/fit.py).
        if (info.context or {}).get("purpose") == "plan":
            return self  # a plan on paper trains nothing here: any number of processes may be planned
        processes = sum(i.learners * i.processes_per_learner for i in self.islands)
        if processes > MAX_LEARNER_PROCESSES:
            raise ValueError(f"islands: {processes} learner processes (learners x processes_per_learner over all "
                             f"islands), more than the {MAX_LEARNER_PROCESSES} a run may have")
        return self

    @model_validator(mode="after")
    def _stall_limit_outlasts_deadlines(self) -> "RunSpec":
        if self.sync.stall_limit_s is not None and self.sync.stall_limit_s < self._longest_legitimate_stall_s:
            raise ValueError(f"sync.stall_limit_s: {self.sync.stall_limit_s:g} s is shorter than a partner wait and "
                             f"two store calls may take (partner_timeout_s plus twice the longest retry_budget_s: "
                             f"{self._longest_legitimate_stall_s:g} s)")
        return self

    @model_validator(mode="after")
    def _several_stores_sign(self) -> "RunSpec":
        # Checked last: a store that cannot work at all is the first thing to say.
        stores = [i.name for i in self.islands if i.store is not None]
        if self.signing is None and stores and not self.unauthenticated:
            raise ValueError(f"islands {stores} have stores of their own, and the spec has no signing keys: add the "
                             "`signing` sections `archipelago keys` prints, or say unauthenticated: true")
        return self

    @property
    def _longest_legitimate_stall_s(self) -> float:
        budgets = [self.store.retry_budget_s, *(i.store.retry_budget_s for i in self.islands if i.store)]
        return self.sync.partner_timeout_s + 2 * max(budgets)

    @property
    def learner_stall_limit_s(self) -> float:
        """How long a learner process may go without progress before its watchdog ends it (infra/watchdog.py)."""
        if self.sync.stall_limit_s is not None:
            return self.sync.stall_limit_s
        return self._longest_legitimate_stall_s + _STALL_MARGIN_S

    def faults_of(self, kind: type) -> list:
        return [f for f in self.faults if isinstance(f, kind)]

    def fault_at(self, kind: type, learner: int, round_index: int):
        """The fault of this kind aimed at this learner in this round, if the spec has one."""
        return next((f for f in self.faults_of(kind) if (f.learner, f.round) == (learner, round_index)), None)

    @property
    def learners(self) -> list["LearnerSlot"]:
        """Global learner indices, island by island, so that butterfly's early stages stay on-island."""
        slots, index = [], 0
        for island in self.islands:
            for _ in range(island.learners):
                slots.append(LearnerSlot(index=index, island=island))
                index += 1
        return slots

    @property
    def max_seq_len(self) -> int:
        return max(i.seq_len for i in self.islands)

    @property
    def vocab_size(self) -> int:
        """Ids the model predicts: the bytes or the tokenizer's vocabulary, and the document separator."""
        return BYTE_VOCAB if self.data.tokenizer is None else self.data.tokenizer.vocab_size + 1

    @property
    def separator(self) -> int:
        """The id that starts every document in a stream: never a scored target."""
        return BOS if self.data.tokenizer is None else self.data.tokenizer.vocab_size


class LearnerSlot(BaseModel):
    """A learner's place in the run: its global index and the island hosting it."""

    model_config = ConfigDict(frozen=True)
    index: int
    island: IslandSpec

    @property
    def rows_per_round(self) -> int:
        return self.island.batch_size * self.island.inner_steps

    def tokens_per_round(self) -> int:
        return self.rows_per_round * self.island.seq_len


class SpecError(ValueError):
    """A run specification that cannot run; the message names the offending field."""


def check_windows_ahead(spec: RunSpec, now: datetime) -> None:
    """At submission, a window that has already ended cannot be reserved capacity for this run."""
    for n, island in enumerate(spec.islands):
        for w, window in enumerate(island.windows):
            if window.end_at <= now:
                raise SpecError(f"islands.{n}.windows.{w}: island {island.name}'s window {window.describe()} "
                                f"has already ended (now {now.isoformat()})")


def spec_sha256(spec: "RunSpec | dict") -> str:
    """The sha256 of a spec's canonical JSON (a RunSpec, or its JSON as the store holds it): what the
    control plane pins its learners to, so that a spec.json written by anyone else is refused."""
    return sha256(canonical_json(spec.model_dump(mode="json") if isinstance(spec, RunSpec) else spec))


def parse_spec(raw: dict, purpose: Literal["train", "plan"] = "train") -> RunSpec:
    """`purpose` "plan": a spec only planned, never trained here, so not held to what a learner here can hold."""
    try:
        return RunSpec.model_validate(raw, context={"purpose": purpose})
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors())
        raise SpecError(f"invalid run spec: {problems}") from None


def load_spec(path: str | Path, purpose: Literal["train", "plan"] = "train", overrides: Sequence[str] = ()) -> RunSpec:
    """The spec of a YAML file, with the command line's `--set` `overrides` (infra/spec/overrides.py) laid over it."""
    return parse_spec(load_raw_spec(path, overrides), purpose)


def load_raw_spec(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """A spec file's YAML with `overrides` laid over it, not yet validated."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"run spec not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"run spec {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"run spec {path} must be a mapping at the top level")
    try:
        raw = apply_overrides(raw, overrides)
    except OverrideError as err:
        raise SpecError(str(err)) from None
    return raw

