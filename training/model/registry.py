"""The model a run spec names: the built-in byte GPT, or a transformers causal LM."""

from __future__ import annotations

import torch


def build_model(spec) -> torch.nn.Module:
    """A run spec's initial model: every learner and the baseline start from these same weights."""
    torch.manual_seed(spec.seed)
    if spec.model.kind == "transformers":
        from training.model.transformers_lm import TransformersLM

        return TransformersLM.from_spec(spec)
    from training.model.gpt import build

    return build(spec)
