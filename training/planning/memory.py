"""Memory per rank: whether an island's learners fit their accelerators, before anything is rented.

A learner's rank holds, on its device (`rank_memory`):
  * resident: the weights (fp32), their gradients (fp32) and AdamW's two fp32 moments; under
    `data_parallel` all of them whole on every rank, under `fsdp` each divided by the learner's
    processes (FSDP2 shards every parameter over them, `training.model.parallel`);
  * while it steps, the largest of what comes and goes:
      - forward and backward: the activations saved for backward at the rank's share of the batch
        (`activation_bytes`; with `activation_checkpointing`, each block's input and one block's
        activations while backward recomputes them); with bf16, the bf16 copies of the matrix weights
        that autocast makes and keeps until the forward pass ends, whole under either parallelism
        (autocast casts the weights FSDP2 has gathered, and the copies outlive the reshard), unless
        `fsdp_mixed_precision` gathers the weights in bf16 themselves; under `fsdp`, the layers FSDP2
        gathers whole (`gathered_layer_bytes`);
      - the optimizer step: torch's foreach AdamW makes one temporary the size of the rank's
        parameters (the square roots of the second moments);
      - applying an exchange under `data_parallel`: the fragment's new weights, whole, on the device
        (rank 0 broadcasts them; under `fsdp` they travel parameter by parameter).
Peak = resident + the largest of those. Left out: the CUDA context, NCCL's buffers and the
allocator's fragmentation (together a few GB), so a plan that fits by less than that does not.

Host memory, where the exchange's state lives, is `training.planning.host_memory`'s; the memory plan
(`training.planning.fit`) holds both, and refuses a run that does not fit either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache

import torch

from infra.spec import RunSpec
from infra.spec.island import IslandSpec
from infra.spec.model import BUILT_IN

GB = 1e9
FP32 = 4
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}  # an element of what the forward pass computes in its precision
INT64 = 8


@dataclass(frozen=True)
class ModelShape:
    """What a transformer's activations depend on: its sizes, and how its blocks are written.

    `norm_saved`: fp32 tensors of width h each norm saves (1: LayerNorm, its input; 2: an RMSNorm in
    Python, its input and the normalized values). `attention_inputs`, `ffn_inputs`: under bf16, the
    copies of a norm's output that the matrix products save (autocast casts it once per product: one
    for a fused qkv, three for separate q, k, v); in fp32 they share one tensor. `ffn_saved`: tensors
    of the feed-forward's hidden width saved per token (2 for up, GELU; 4 for gated: gate, up,
    activation, product). `routed_copies`: tensors of width h per token routed to an expert."""

    layers: int
    width: int
    heads: int
    ffn_width: int
    vocab: int
    norm_saved: int = 1
    attention_inputs: int = 1
    ffn_inputs: int = 1
    ffn_saved: int = 2
    experts: int = 0
    top_k: int = 1
    routed_copies: int = 3
    shared_ffn_width: int = 0  # a dense expert every token also goes through (Qwen2-MoE)
    qk_norm: bool = False  # LayerNorm on each head's queries and keys
    z_loss: bool = False  # the squared log-partition term, which keeps the logits for backward


@dataclass(frozen=True)
class ModelSizes:
    """Element counts of the model and its outer optimizer, from the model built on the meta device."""

    parameters: int
    active: int
    largest_layer: int  # the largest transformer block, or everything outside the blocks if larger
    largest_fragment: int  # the most parameters one exchange moves (sync.transport.fragments)
    matrix_parameters: int  # in matrix products: what autocast copies to bf16
    outer_state: int  # the outer optimizer's state, as the library builds it


@dataclass
class RankMemory:
    """Bytes one rank of a learner holds on its device, by part."""

    parallelism: str
    processes: int
    rows: int  # sequences per rank per inner step
    options: tuple[str, ...]  # the island's memory options in effect (`island_options`)
    resident: dict[str, int]
    transient: dict[str, dict[str, int]]  # phase -> its parts; the phases never overlap

    @property
    def peak(self) -> int:
        return sum(self.resident.values()) + max(sum(parts.values()) for parts in self.transient.values())

    def fits(self, device_memory_gb: float) -> bool:
        return self.peak <= device_memory_gb * GB


def model_shape(spec: RunSpec) -> ModelShape | None:
    """The shape of the spec's model; None for a registered model, whose blocks are its own."""
    model = spec.model
    if model.kind == "byte_gpt":
        moe = model.moe
        return ModelShape(model.layers, model.width, model.heads, 4 * model.width, spec.vocab_size,
                          experts=moe.experts if moe else 0, top_k=moe.top_k if moe else 1,
                          qk_norm=model.qk_norm, z_loss=model.z_loss_weight > 0)
    if model.kind not in BUILT_IN:
        return None
    config = model.transformers.library_config(spec.vocab_size, spec.max_seq_len)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    ffn = (getattr(config, "moe_intermediate_size", None) if experts else None) or config.intermediate_size
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, ffn,
                      spec.vocab_size, norm_saved=2, attention_inputs=3, ffn_inputs=1 if experts else 2,
                      ffn_saved=4, experts=experts, top_k=getattr(config, "num_experts_per_tok", 1) if experts else 1,
                      routed_copies=2, shared_ffn_width=getattr(config, "shared_expert_intermediate_size", 0) or 0)


def model_sizes(spec: RunSpec) -> ModelSizes:
    """Counts from the model as the learners build it, on the meta device (nothing allocated); kept
    per model and outer optimizer, as a large model takes seconds to build even there."""
    transport = spec.sync.transport
    key = json.dumps([spec.model.model_dump(mode="json"), spec.vocab_size, spec.max_seq_len,
                      spec.sync.outer.model_dump(mode="json"), transport.fragments, transport.layout], sort_keys=True)
    if key not in _SIZES:
        _SIZES[key] = _count(spec)
    return _SIZES[key]


_SIZES: dict[str, ModelSizes] = {}


def _count(spec: RunSpec) -> ModelSizes:
    from training.model.registry import build_model
    from training.planning.planner import fragment_sizes_of

    with torch.device("meta"):
        model = build_model(spec)
    named = list(model.named_parameters())
    layers: dict[int | None, int] = {}
    for name, p in named:
        block = model.block_of(name)
        layers[block] = layers.get(block, 0) + p.numel()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    in_products = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    matrices = sum(p.numel() for _, p in named if p.dim() >= 2 and (id(p) not in embeddings or id(p) in in_products))
    counts = model.parameter_counts()
    return ModelSizes(counts["total"], counts["active"], max(layers.values()), max(fragment_sizes_of(model, spec)),
                      matrices, sum(outer_state_elements(spec.sync.outer, p.shape) for _, p in named))


def outer_state_elements(outer_spec, shape: torch.Size) -> int:
    """Elements of the outer optimizer's state for one parameter of `shape`: the library's own state,
    built on the meta device (Shampoo's blocks of `shampoo.block_size` included)."""
    return _outer_state_elements(outer_spec.model_dump_json(), tuple(shape))


@cache
def _outer_state_elements(outer_json: str, shape: tuple[int, ...]) -> int:
    from infra.spec.sync import OuterOptimizerSpec
    from training.exchange.outer import OuterOptimizer

    with torch.device("meta"):
        outer = OuterOptimizer.from_spec(OuterOptimizerSpec.model_validate_json(outer_json), [torch.Size(shape)])
        outer.materialise_state()
        tensors, _ = outer.state()
    return sum(t.numel() for t in tensors.values())


def norm_bytes(shape: ModelShape, bf16_parameters: bool) -> int:
    """Bytes a norm saves per element of the width: its input, in the residual stream's precision (fp32;
    bf16 under FSDP2's mixed precision), and an RMSNorm in Python its fp32 normalized values as well."""
    return (ACTIVATION_BYTES["bf16"] if bf16_parameters else FP32) + (shape.norm_saved - 1) * FP32


def layer_activation_bytes_per_token(shape: ModelShape, precision: str, bf16_parameters: bool = False) -> int:
    """Bytes one transformer block saves for backward per token (pre-norm attention with fused
    scaled-dot-product attention, then a feed-forward), with p bytes an element of the forward's
    precision (2 for bf16, 4 for fp32) and the names of `ModelShape`:

        2 N h                       the two norms' saved tensors (`norm_bytes`: N = 4 n in fp32 weights'
                                    residual stream; 2 + 4 (n - 1) with `bf16_parameters`)
      + p (a h + 4h + m h + F)      the attention's inputs, q, k, v and its output, the feed-forward's
                                    inputs (a = attention_inputs, m = ffn_inputs under bf16 autocast of
                                    fp32 weights; 1 in fp32 or with bf16 weights, whose products share
                                    the norm's bf16 output)
      + 4 (heads + 4)               attention's log-sum-exp per head, the norms' statistics (fp32)
      F = s f                       dense: the feed-forward's s saved tensors of hidden width f
      F = k (r h + s f)             mixture of experts, top-k: each routed copy's gathered input, hidden
          + m' h + s f_shared         tensors and weighted output; a shared expert's inputs and hidden
      + 4E + 12k                    mixture of experts: router probabilities (fp32), per routed copy its
                                    row index and gate
      + p 3h + 16 heads             QK-LayerNorm: normalized queries and keys, the attention output kept
                                    apart from its projection's input, the norms' statistics

    `bf16_parameters`: FSDP2's mixed precision gathers the weights in bf16, so the residual stream is
    bf16 and autocast copies nothing. Fused attention keeps no seq x seq scores (Korthikanti et al.'s
    5 a s / h term); k and v count at full width (an overcount under grouped-query attention). Checked
    against the tensors autograd saves, in tests/test_plan_memory.py."""
    h, p = shape.width, ACTIVATION_BYTES[precision]
    copies = (shape.attention_inputs, shape.ffn_inputs) if precision == "bf16" and not bf16_parameters else (1, 1)
    ffn, router = shape.ffn_saved * shape.ffn_width, 0
    if shape.experts:
        ffn = shape.top_k * (shape.routed_copies * h + ffn)
        if shape.shared_ffn_width:
            ffn += copies[1] * h + shape.ffn_saved * shape.shared_ffn_width
        router = FP32 * shape.experts + 12 * shape.top_k
    qk_norm = p * 3 * h + 4 * FP32 * shape.heads if shape.qk_norm else 0
    return 2 * norm_bytes(shape, bf16_parameters) * h + p * (copies[0] * h + 4 * h + copies[1] * h + ffn) \
        + FP32 * (shape.heads + 4) + router + qk_norm


def head_activation_bytes_per_token(shape: ModelShape, precision: str, bf16_parameters: bool = False) -> int:
    """Bytes saved per token outside the blocks: the final norm's saved tensors and output, the
    log-softmax over the vocabulary (fp32, as cross-entropy computes it), the input ids and targets;
    with the z-loss, the logits and their log-partition."""
    p = ACTIVATION_BYTES[precision]
    return shape.width * (norm_bytes(shape, bf16_parameters) + p) + FP32 * shape.vocab + 2 * INT64 \
        + (p * (shape.vocab + 1) if shape.z_loss else 0)


def activation_bytes(shape: ModelShape, rows: int, seq_len: int, precision: str, bf16_parameters: bool = False,
                     checkpointed: bool = False) -> int:
    """Activations one rank keeps between its forward and backward pass: `rows` sequences of `seq_len`.
    `checkpointed` (activation checkpointing): each block keeps its input, in the residual stream's
    precision, and backward recomputes one block's activations at a time."""
    tokens = rows * seq_len
    layer = layer_activation_bytes_per_token(shape, precision, bf16_parameters)
    residual = (ACTIVATION_BYTES["bf16"] if bf16_parameters else FP32) * shape.width
    blocks = shape.layers * residual + layer if checkpointed else shape.layers * layer
    return tokens * (blocks + head_activation_bytes_per_token(shape, precision, bf16_parameters))


def gathered_layer_bytes(sizes: ModelSizes, bf16_parameters: bool = False) -> int:
    """What FSDP2 holds whole for a while: two layers' weights (the one computing, the next one it
    prefetches) and one layer's gradient before its reduce-scatter; fp32 (the learner shards fp32
    parameters), or with `bf16_parameters` (mixed precision) the weights and gradient in bf16 and the
    gradient's fp32 copy that is reduce-scattered."""
    if bf16_parameters:
        return sizes.largest_layer * (3 * ACTIVATION_BYTES["bf16"] + FP32)
    return 3 * sizes.largest_layer * FP32


def sharded(nbytes: int, processes: int) -> int:
    """A rank's share of state sharded over `processes`, rounded up (FSDP2's padding of each parameter's
    rows to a multiple of `processes` is left out: a fraction of a percent for the models here)."""
    return -(-nbytes // processes)


def island_options(island: IslandSpec, parallelism: str, processes: int) -> tuple[str, ...]:
    """The island's memory options that take effect under `parallelism` over `processes`: FSDP2's mixed
    precision only where FSDP2 shards (`training.model.parallel`)."""
    mixed = island.fsdp_mixed_precision and island.precision == "bf16" and parallelism == "fsdp" and processes > 1
    return tuple(name for name, on in (("fsdp_mixed_precision", mixed),
                                       ("activation_checkpointing", island.activation_checkpointing)) if on)


def rank_memory(spec: RunSpec, island: IslandSpec, sizes: ModelSizes, shape: ModelShape | None,
                parallelism: str | None = None, processes: int | None = None) -> RankMemory:
    """The device memory of one rank of `island`'s learners; `parallelism` and `processes` replace the
    island's own, to see what another layout would take. Without a `shape` (a registered model) the
    activations count 0."""
    parallelism = parallelism or island.parallelism
    processes = processes or island.processes_per_learner
    options = island_options(island, parallelism, processes)
    bf16_parameters = "fsdp_mixed_precision" in options
    shards = processes if parallelism == "fsdp" else 1
    weights = sharded(FP32 * sizes.parameters, shards)
    rows = island.batch_size // processes
    forward_backward = {"activations": activation_bytes(shape, rows, island.seq_len, island.precision, bf16_parameters,
                                                        "activation_checkpointing" in options) if shape else 0}
    if parallelism == "fsdp":
        forward_backward["gathered layers"] = gathered_layer_bytes(sizes, bf16_parameters)
    if island.precision == "bf16" and not bf16_parameters:
        forward_backward["bf16 weight copies"] = ACTIVATION_BYTES["bf16"] * sizes.matrix_parameters
    transient = {"forward and backward": forward_backward, "optimizer step": {"AdamW temporary": weights}}
    if parallelism == "data_parallel":
        transient["applying an exchange"] = {"fragment weights": FP32 * sizes.largest_fragment}
    return RankMemory(parallelism, processes, rows, options,
                      {"weights": weights, "gradients": weights, "inner optimizer": 2 * weights}, transient)


def fewest_fsdp_processes(spec: RunSpec, island: IslandSpec, sizes: ModelSizes, shape: ModelShape) -> RankMemory | None:
    """A rank under fsdp with the fewest processes per learner at which it fits the island's device
    memory, among those the spec allows (a divisor of batch_size, a multiple of nodes_per_learner); None
    if even one sequence per rank does not. A rank's memory only falls as processes are added."""
    for processes in range(island.nodes_per_learner, island.batch_size + 1, island.nodes_per_learner):
        if island.batch_size % processes == 0:
            rank = rank_memory(spec, island, sizes, shape, "fsdp", processes)
            if rank.fits(island.device_memory_gb):
                return rank
    return None


def gigabytes(nbytes: int) -> str:
    """Bytes in GB (1e9 bytes), with the digits a small model needs too."""
    return f"{nbytes / GB:.1f}" if nbytes >= GB / 10 else f"{nbytes / GB:.2g}"


def sequences(rows: int) -> str:
    return f"{rows} sequence" + ("s" if rows > 1 else "")


def unused_options(island: IslandSpec, parallelism: str, processes: int) -> dict[str, bool]:
    """The memory options the island leaves off that would take effect under `parallelism` over
    `processes`, each turned on."""
    return {name: True for name in island_options(island.model_copy(update={
        "fsdp_mixed_precision": True, "activation_checkpointing": True}), parallelism, processes)
        if not getattr(island, name)}


def settings(options: dict[str, bool]) -> str:
    return " and ".join(f"{name}: true" for name in options)


def what_would_fit(spec: RunSpec, island: IslandSpec, sizes: ModelSizes, shape: ModelShape) -> str:
    """What would make `island`'s ranks fit their device memory, as a sentence: the smallest change that
    does, in this order: fsdp over the same processes; the island's memory options at its layout, one
    at a time (mixed precision first: it costs no compute) and together; more fsdp processes; more fsdp
    processes with every option."""
    if island.parallelism == "data_parallel":
        fsdp = rank_memory(spec, island, sizes, shape, "fsdp")
        if fsdp.fits(island.device_memory_gb):
            return f"parallelism: fsdp over {fsdp.processes} processes needs {gigabytes(fsdp.peak)} GB per rank"
    here = unused_options(island, island.parallelism, island.processes_per_learner)
    for options in [{name: True} for name in here] + ([here] if len(here) > 1 else []):
        rank = rank_memory(spec, island.model_copy(update=options), sizes, shape)
        if rank.fits(island.device_memory_gb):
            return f"{settings(options)} needs {gigabytes(rank.peak)} GB per rank"
    every = unused_options(island, "fsdp", island.batch_size)
    for changes in ({}, every) if every else ({},):
        fewest = fewest_fsdp_processes(spec, island.model_copy(update=changes), sizes, shape)
        if fewest is not None:
            return (f"parallelism: fsdp with at least {fewest.processes} processes per learner "
                    f"({sequences(fewest.rows)} per rank)" + (f" and {settings(changes)}" if changes else "")
                    + f" needs {gigabytes(fewest.peak)} GB per rank")
    one_row = rank_memory(spec, island.model_copy(update=every), sizes, shape, "fsdp", island.batch_size).peak
    return (f"even fsdp over {island.batch_size} processes (one sequence per rank)"
            + (f" with {settings(every)}" if every else "") + f" needs {gigabytes(one_row)} "
            f"GB per rank: shorten seq_len or use accelerators with more memory")


def island_memory(spec: RunSpec, island: IslandSpec, sizes: ModelSizes, shape: ModelShape | None) -> dict:
    """One island's memory plan: its rank's parts, the peak, what the other parallelism would take,
    and against its device memory whether it fits, the fewest processes fsdp fits with, and if it
    does not fit, what would."""
    mine = rank_memory(spec, island, sizes, shape)
    other = rank_memory(spec, island, sizes, shape, "fsdp" if island.parallelism == "data_parallel" else "data_parallel")
    checked = island.device_memory_gb is not None and shape is not None
    fits = mine.fits(island.device_memory_gb) if checked else None
    fewest = fewest_fsdp_processes(spec, island, sizes, shape) if checked else None
    return {"rank": asdict(mine), "peak_bytes": mine.peak, "activations_estimated": shape is not None,
            "other_parallelism": {"parallelism": other.parallelism, "processes": other.processes,
                                  "peak_bytes": other.peak},
            "device_memory_gb": island.device_memory_gb, "fits": fits,
            "fewest_fsdp_processes": None if fewest is None else
            {"processes": fewest.processes, "rows": fewest.rows, "peak_bytes": fewest.peak},
            "to_fit": None if fits in (None, True) else what_would_fit(spec, island, sizes, shape)}
