"""The model section of a run spec: the built-in byte GPT, a transformers causal LM built from its
config (no weights downloaded, no code from the hub: `trust_remote_code` is never set), or a model an
installed package registers under the entry-point group `archipelago.models` (a spec names the entry
point, never an import path).

A transformers architecture is one of a fixed list, named in the spec and mapped here to the
library's class; its config is the library's own config class, so a field the library refuses is
named when the spec is loaded, before any work.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.spec.base import MAX_WIDTH, SpecModel

# Byte vocabulary: the 256 byte values and one document separator, so bits per byte count exactly the
# bytes of the text.
BOS = 256
BYTE_VOCAB = 257

# Architecture -> the transformers model type of its config class.
TRANSFORMERS_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
                              "Qwen2MoeForCausalLM": "qwen2_moe"}
ConfigValue = int | float | bool | str | None | list[int] | list[str]
BUILT_IN = ("byte_gpt", "transformers")
ENTRY_POINTS = "archipelago.models"
# What every model answers (training/model/registry.py); a registered model is checked for it when built.
INTERFACE = ("forward", "loss", "block_of", "parameter_counts")


def registered_models() -> dict[str, EntryPoint]:
    """Models installed packages register: entry point name -> `factory(options, vocab_size, max_seq_len)`."""
    return {point.name: point for point in entry_points(group=ENTRY_POINTS)}


class MoESpec(SpecModel):
    """The byte GPT's sparse mixture-of-experts feed-forward layers."""

    experts: int = Field(ge=2, le=64, description="Experts in each sparse feed-forward layer.")
    top_k: int = Field(1, ge=1, description="Experts each token is routed to.")
    balance_loss_weight: float = Field(0.01, ge=0, description="Weight of the load-balancing loss.")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")
        return self


class TransformersModelSpec(SpecModel):
    """A transformers causal LM built from its config: no weights are downloaded, no hub code runs."""

    architecture: Literal["LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"] = Field(
        description="The transformers causal LM class. Sparse MoE architectures train with their router's "
                    "auxiliary loss (the config's router_aux_loss_coef).")
    config: dict[str, ConfigValue] = Field(
        default_factory=dict, max_length=64,
        description="Fields of the architecture's transformers config (hidden_size, num_hidden_layers, "
                    "num_attention_heads, intermediate_size, num_local_experts, ...). vocab_size and "
                    "max_position_embeddings are set by the run: the vocabulary and the longest seq_len.")

    @field_validator("config")
    @classmethod
    def _run_sets_these(cls, config: dict) -> dict:
        taken = sorted({"vocab_size", "max_position_embeddings", "trust_remote_code", "auto_map"} & set(config))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the run, not by the spec")
        return config

    @model_validator(mode="after")
    def _trainable(self) -> "TransformersModelSpec":
        self.shape_config()
        return self

    def shape_config(self):
        """The config for what depends on neither the vocabulary nor the lengths (layers, widths)."""
        return self.library_config(BYTE_VOCAB, 2048)

    def library_config(self, vocab_size: int, max_positions: int):
        """The transformers config object; raises ValueError naming a field the library does not know or
        a value it refuses."""
        from transformers import AutoConfig

        model_type = TRANSFORMERS_ARCHITECTURES[self.architecture]
        unknown = sorted(set(self.config) - set(AutoConfig.for_model(model_type).to_dict()))
        if unknown:
            raise ValueError(f"{self.architecture}'s config has no field {', '.join(unknown)}")
        try:
            config = AutoConfig.for_model(model_type, **{"tie_word_embeddings": False, **self.config},
                                          vocab_size=vocab_size, max_position_embeddings=max_positions)
        except Exception as err:  # noqa: BLE001 - the library raises its own validation errors
            reason = str(err).strip().splitlines()[-1].strip()
            raise ValueError(f"transformers refuses {self.architecture}'s config: {reason}") from None
        self._check_shapes(config)
        return config

    def _check_shapes(self, config) -> None:
        """Refuse shapes the library's config accepts but its model cannot train with: Qwen2-MoE and
        Mixtral take any head count, then fail in attention (an odd or fractional head width under
        rotary embeddings, key-value heads that do not divide the heads) on every learner's first step."""
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "moe_intermediate_size", "head_dim"):
            value = getattr(config, name, None)
            if value is not None and value < 1:
                raise ValueError(f"config.{name}: {value}, must be at least 1")
        heads, width = config.num_attention_heads, config.hidden_size
        key_value_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % key_value_heads:
            raise ValueError(f"config.num_key_value_heads: {key_value_heads} does not divide num_attention_heads "
                             f"{heads}")
        head_width = self.config.get("head_dim")
        if head_width is None:
            if width % heads:
                raise ValueError(f"config.num_attention_heads: {heads} does not divide hidden_size {width} "
                                 f"(a head's width would be {width / heads:.4g})")
            head_width = width // heads
        if head_width % 2:
            raise ValueError(f"config.num_attention_heads: {heads} heads of hidden_size {width} are {head_width} "
                             "wide, and rotary position embeddings need an even head width")
        experts_field = next((name for name in ("num_local_experts", "num_experts") if hasattr(config, name)), None)
        if experts_field is not None:
            experts, top_k = getattr(config, experts_field), config.num_experts_per_tok
            if experts < 1 or not 1 <= top_k <= experts:
                raise ValueError(f"config.num_experts_per_tok: {top_k} with {experts_field} {experts}; each token "
                                 "goes to at least one and at most every expert")
        sparse_step = getattr(config, "decoder_sparse_step", 1)
        if sparse_step < 1:
            raise ValueError(f"config.decoder_sparse_step: {sparse_step}, must be at least 1")
        outside = [layer for layer in getattr(config, "mlp_only_layers", None) or []
                   if not 0 <= layer < config.num_hidden_layers]
        if outside:
            raise ValueError(f"config.mlp_only_layers: {outside} are not layers of the model's "
                             f"{config.num_hidden_layers} (0 to {config.num_hidden_layers - 1})")


class ModelSpec(SpecModel):
    """The model every learner and the baseline train. The defaults are a small byte GPT that trains on a
    CPU in minutes, the demo's scale."""

    kind: str = Field(
        "byte_gpt", pattern=r"^[a-z][a-z0-9_]{0,47}$",
        description="byte_gpt: the built-in byte-level GPT (layers, width, heads, moe); transformers: a "
                    "transformers causal LM (the transformers section); or the name of a model an installed "
                    f"package registers under the entry-point group `{ENTRY_POINTS}` (options).")
    layers: int = Field(2, ge=1, le=64, description="byte_gpt: transformer blocks.")
    width: int = Field(128, ge=8, le=MAX_WIDTH, description="byte_gpt: residual stream width (d_model).")
    heads: int = Field(4, ge=1, le=256, description="byte_gpt: attention heads; must divide width.")
    moe: MoESpec | None = Field(None, description="byte_gpt: sparse mixture-of-experts feed-forward; dense when absent.")
    qk_norm: bool = Field(
        False, description="byte_gpt: layer-normalise each head's queries and keys before attention (QK-LayerNorm), "
                           "which keeps attention logits bounded and training less sensitive to the learning rate.")
    z_loss_weight: float = Field(
        0.0, ge=0, le=1, description="byte_gpt: weight of the z-loss, the mean squared log-partition of the output "
                                     "logits (PaLM uses 1e-4): it keeps the softmax normaliser near 1.")
    transformers: TransformersModelSpec | None = Field(None, description="kind transformers: the architecture and config.")
    options: dict[str, ConfigValue] = Field(
        default_factory=dict, max_length=64,
        description="A registered model's options, handed to its factory with the vocabulary's size and the "
                    "longest seq_len.")
    init_from: str | None = Field(
        None, max_length=1024,
        description="kind transformers: a folder in the transformers format (config.json and safetensors "
                    "weights, as `archipelago export` writes it), under the control plane's data root "
                    "($ARCHIPELAGO_DATA_ROOT); every learner and the baseline start from its weights, which "
                    "must fit the spec's architecture and config. Empty: the seed's initial weights.")

    @model_validator(mode="after")
    def _shape(self) -> "ModelSpec":
        if self.kind not in BUILT_IN:
            installed = registered_models()
            if self.kind not in installed:
                raise ValueError(f"kind {self.kind!r} is neither built in {list(BUILT_IN)} nor registered by an "
                                 f"installed package under {ENTRY_POINTS} (registered: {sorted(installed)})")
            self.build_registered(BYTE_VOCAB, 16, meta=True)
        elif self.options:
            raise ValueError(f"options are for a registered model, not kind {self.kind}")
        if self.kind == "transformers":
            if self.transformers is None:
                raise ValueError("kind transformers needs the transformers section (architecture, config)")
        elif self.transformers is not None or self.init_from is not None:
            raise ValueError(f"the transformers section and init_from are for kind transformers, not {self.kind}")
        if self.kind != "byte_gpt" and (self.qk_norm or self.z_loss_weight):
            raise ValueError(f"qk_norm and z_loss_weight are settings of byte_gpt, not of kind {self.kind}")
        if self.kind == "byte_gpt" and self.width % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide width {self.width} (a head's width would be "
                             f"{self.width / self.heads:.4g})")
        return self

    def build_registered(self, vocab_size: int, max_seq_len: int, meta: bool = False):
        """A registered model, built by its package's factory (on the meta device: nothing allocated)."""
        import torch

        point = registered_models()[self.kind]
        with torch.device("meta") if meta else torch.device("cpu"):
            model = point.load()(dict(self.options), vocab_size, max_seq_len)
        missing = [name for name in INTERFACE if not callable(getattr(model, name, None))]
        if missing:
            raise ValueError(f"kind {self.kind!r} ({point.value}): its model has no {', '.join(missing)}")
        return model

    def describe(self) -> str:
        if self.kind not in BUILT_IN:
            return f"{self.kind} (registered by {registered_models()[self.kind].value})"
        if self.kind == "transformers":
            config = self.transformers.shape_config()
            return (f"{self.transformers.architecture}, {config.num_hidden_layers} layers x "
                    f"{config.hidden_size} wide")
        return f"byte GPT, {self.layers} layers x {self.width} wide" + (
            f", {self.moe.experts} experts (top {self.moe.top_k})" if self.moe else "")

    @property
    def blocks(self) -> int:
        """Transformer blocks: what fragments are dealt from."""
        if self.kind == "transformers":
            return int(self.transformers.shape_config().num_hidden_layers)
        if self.kind not in BUILT_IN:
            model = self.build_registered(BYTE_VOCAB, 16, meta=True)
            return len({model.block_of(name) for name, _ in model.named_parameters()} - {None})
        return self.layers

    def parameter_count(self, max_seq_len: int, vocab_size: int = BYTE_VOCAB) -> int:
        """The model's parameters, counted without allocating them."""
        if self.kind not in BUILT_IN:
            return sum(p.numel() for p in self.build_registered(vocab_size, max_seq_len, meta=True).parameters())
        if self.kind == "transformers":
            import torch
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.transformers.library_config(vocab_size, max_seq_len))
            return sum(p.numel() for p in model.parameters())
        width = self.width
        ffn = 8 * width * width if self.moe is None else self.moe.experts * (8 * width * width + width)
        block = 4 * width * width + 4 * width + ffn  # attention, two layer norms, feed-forward
        if self.qk_norm:
            block += 4 * (width // self.heads)  # a layer norm (weight and bias) over a head's queries, one over its keys
        return vocab_size * width + max_seq_len * width + self.layers * block + 2 * width
