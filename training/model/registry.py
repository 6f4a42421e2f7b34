"""The model a run spec names: the built-in byte GPT, a transformers causal LM, or a model an installed
package registers (`infra.spec.model.registered_models`)."""

from __future__ import annotations

from pathlib import Path

import torch

from infra import layout
from infra.derived import commit_derived, read_derived
from infra.spec.model import BUILT_IN
from training.model.params import flat_parameters, load_flat_parameters


def build_model(spec) -> torch.nn.Module:
    """A run spec's initial model: every learner and the baseline start from these same weights."""
    torch.manual_seed(spec.seed)
    if spec.model.kind not in BUILT_IN:
        return spec.model.build_registered(spec.vocab_size, spec.max_seq_len)
    if spec.model.kind == "transformers":
        from training.model.transformers_lm import TransformersLM

        return TransformersLM.from_spec(spec)
    from training.model.gpt import build

    return build(spec)


def load_model(spec, store, key: str) -> tuple[torch.nn.Module, dict]:
    """The spec's model with the weights of a model the run committed (consolidated, baseline, a
    snapshot), and that commit's fields."""
    tensors, meta, _ = read_derived(store, key)
    model = build_model(spec)
    load_flat_parameters(model, tensors["weights"])
    return model, meta


def initial_model(spec, run_store) -> torch.nn.Module:
    """The model every learner and the baseline start training from: the seed's weights, or with
    `model.init_from` the weights the control plane committed from it (`commit_initial_weights`)."""
    if spec.model.init_from is None:
        return build_model(spec)
    return load_model(spec, run_store, layout.INITIAL)[0]


def commit_initial_weights(spec, run_store, root: Path) -> None:
    """With `model.init_from`: read the folder (which must lie in `root`, the control plane's data root)
    with transformers, check it fits the spec's model exactly, and commit its weights to the run's store."""
    if spec.model.init_from is None or run_store.is_committed(layout.INITIAL):
        return
    from transformers import AutoModelForCausalLM

    from training.data.corpora import DataError, init_from_folder

    folder = init_from_folder(spec, root)
    model = build_model(spec)
    try:
        model.lm.load_state_dict(AutoModelForCausalLM.from_pretrained(folder).state_dict(), strict=True)
    except RuntimeError as err:  # names the tensors missing, unexpected or of another shape
        raise DataError(f"model.init_from: {folder} does not fit the spec's model: {err}") from None
    commit_derived(run_store, layout.INITIAL, {"weights": flat_parameters(model)}, {"from": spec.model.init_from})
