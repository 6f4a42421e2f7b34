"""What `archipelago run --dry-run` checks of a run's model without allocating it: the model as the
learners build it, on the meta device, against the spec and the memory plan."""

from __future__ import annotations

import torch

from infra.spec import RunSpec, SpecError


class ModelMismatch(SpecError):
    """The model the learners would build is not the one the spec and its memory plan describe."""


def check_model_on_meta(spec: RunSpec, planned_parameters: int) -> dict[str, int]:
    """Build the spec's model on the meta device, as every learner builds it (shapes, no memory), and
    check that its parameters are the spec's count and the memory plan's (`planned_parameters`), and
    that its transformer blocks, which FSDP2 shards and activation checkpointing recomputes one by
    one, are the spec's. Returns its parameters and blocks; raises ModelMismatch."""
    from training.model.parallel import transformer_blocks
    from training.model.registry import build_model

    with torch.device("meta"):
        model = build_model(spec)
    built = {"parameters": sum(p.numel() for p in model.parameters()), "blocks": len(transformer_blocks(model))}
    expected = {"parameters": spec.model.parameter_count(spec.max_seq_len, spec.vocab_size),
                "blocks": spec.model.blocks}
    problems = [f"{what}: the spec gives {expected[what]:,}, the model built has {built[what]:,}"
                for what in built if built[what] != expected[what]]
    if built["parameters"] != planned_parameters:
        problems.append(f"parameters: the memory plan counted {planned_parameters:,}, the model built has "
                        f"{built['parameters']:,}")
    if problems:
        raise ModelMismatch(f"model {spec.model.describe()}: " + "; ".join(problems))
    return built
