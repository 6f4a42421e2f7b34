"""A run's consolidated model in the transformers format: `config.json` and `model.safetensors` that
`AutoModelForCausalLM.from_pretrained(folder)` loads.

A transformers model is saved as itself. The dense byte GPT is exactly a GPT-2 with zero biases
(learned positions, pre-norm blocks, exact GELU, tied head; GPT-2 keeps its projections transposed),
so it is saved as `GPT2LMHeadModel`. The byte GPT with experts has no transformers counterpart: its
export is refused, naming why. Token ids are the run's: the byte values (or the tokenizer's ids),
and after them the document separator, which is also the config's bos and eos token.
"""

from __future__ import annotations

from pathlib import Path

import torch


class NotExportable(ValueError):
    """The model has no transformers counterpart."""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_model(spec, model: torch.nn.Module, out: Path, dtype: str = "fp32") -> Path:
    """Write `model` (the spec's, with its trained weights) to the folder `out`; returns it."""
    if spec.model.kind == "transformers":
        hf = model.lm
    elif spec.model.kind == "byte_gpt" and spec.model.moe is None:
        hf = gpt2_of(model)
    else:
        raise NotExportable(f"{spec.model.describe()} has no transformers counterpart: its weights stay "
                            "Archipelago's (models/consolidated.safetensors in the run's store)")
    hf.config.bos_token_id = hf.config.eos_token_id = spec.separator
    out.mkdir(parents=True, exist_ok=True)
    hf.to(DTYPES[dtype]).save_pretrained(out)
    return out


def gpt2_of(model) -> torch.nn.Module:
    """The dense byte GPT as a transformers GPT2LMHeadModel computing the same logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.cfg
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.max_seq_len, n_embd=cfg.width,
                                      n_layer=cfg.layers, n_head=cfg.heads, activation_function="gelu",
                                      bos_token_id=cfg.vocab - 1, eos_token_id=cfg.vocab - 1,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                                      tie_word_embeddings=True))
    ours = dict(model.named_parameters())
    theirs = {"transformer.wte.weight": ours["tok.weight"], "transformer.wpe.weight": ours["pos.weight"],
              "transformer.ln_f.weight": ours["ln_f.weight"], "transformer.ln_f.bias": ours["ln_f.bias"]}
    for i in range(cfg.layers):
        block, h = f"blocks.{i}", f"transformer.h.{i}"
        theirs.update({
            f"{h}.ln_1.weight": ours[f"{block}.ln1.weight"], f"{h}.ln_1.bias": ours[f"{block}.ln1.bias"],
            f"{h}.ln_2.weight": ours[f"{block}.ln2.weight"], f"{h}.ln_2.bias": ours[f"{block}.ln2.bias"],
            # GPT-2's Conv1D holds a projection as (in, out), nn.Linear as (out, in).
            f"{h}.attn.c_attn.weight": ours[f"{block}.attn.qkv.weight"].T,
            f"{h}.attn.c_proj.weight": ours[f"{block}.attn.proj.weight"].T,
            f"{h}.mlp.c_fc.weight": ours[f"{block}.ffn.up.weight"].T,
            f"{h}.mlp.c_proj.weight": ours[f"{block}.ffn.down.weight"].T,
        })
    with torch.no_grad():
        for name, p in gpt2.named_parameters():
            p.copy_(theirs[name] if name in theirs else torch.zeros_like(p))  # the rest are biases, zero here
    return gpt2
