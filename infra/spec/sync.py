"""The `sync` section of a run spec: how learners synchronise (the mode, its rounds and waits), the
outer optimizer, and the transport of their exchanges. training/exchange/ reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.spec.base import MAX_STEPS, MAX_WAIT_S, SpecModel


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
    """The optimizer learners apply to the mixed pseudo-gradients once a round; the defaults are DiLoCo's."""

    name: Literal["nesterov", "shampoo"] = Field(
        "nesterov", description="Outer optimizer applied to mixed pseudo-gradients: nesterov (DiLoCo's SGD with "
                                "Nesterov momentum) or shampoo (Shampoo with grafting).")
    lr: float = Field(0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum (DiLoCo: 0.9); shampoo's beta1.")
    shampoo: ShampooSpec = Field(default_factory=ShampooSpec, description="Shampoo settings, used when name is shampoo.")


class BandwidthSpec(SpecModel):
    """A bandwidth budget per link class, enforced by each learner's transport: for drills and for
    measuring how a run fares on a slower link than the one it has."""

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


class SyncSpec(SpecModel):
    """How learners synchronise: the mode (who mixes with whom), the rounds, the outer optimizer, how
    long a learner waits for its peers, and the transport of their messages."""

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
    shard_outer_step: bool = Field(
        True, description="Allreduce and hierarchical, whose learners share an anchor (the run's, or the island's): "
                          "each of them takes the outer step of its own shard of every fragment (whole parameters, "
                          "about 1/N of it), keeps only that shard's outer optimizer state, and shares the shard of "
                          "the new anchor with the others; the anchor is the one the whole step gives. Off: every "
                          "learner takes the whole step, as each holds the whole state.")
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
