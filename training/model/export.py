"""A run's consolidated model in the transformers format: `config.json` and `model.safetensors` that
`AutoModelForCausalLM.from_pretrained(folder)` loads, and `tokenizer.json` and `tokenizer_config.json`
that `AutoTokenizer.from_pretrained(folder)` loads.

A transformers model is saved as itself. The dense byte GPT is exactly a GPT-2 with zero biases
(learned positions, pre-norm blocks, exact GELU, tied head; GPT-2 keeps its projections transposed),
so it is saved as `GPT2LMHeadModel`. The byte GPT with experts has no transformers counterpart: its
export is refused, naming why. Token ids are the run's: the byte values (or the tokenizer's ids),
and after them the document separator, which is also the config's bos and eos token. The tokenizer
gives exactly those ids: a byte-level run's maps each UTF-8 byte to its value, a run with
`data.tokenizer` gets that vocabulary; both put the separator (`SEPARATOR`) before a text, as training
saw every document. Files and folders get the modes the umask allows (0644 and 0755 under 022).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class NotExportable(ValueError):
    """The model has no transformers counterpart."""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEPARATOR = "<|endoftext|>"  # the document separator's token, as GPT-2 names its own


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
    tokenizer = transformers_tokenizer(spec, getattr(hf.config, "n_positions", None)
                                       or getattr(hf.config, "max_position_embeddings", None))
    out.mkdir(parents=True, exist_ok=True)
    hf.to(DTYPES[dtype]).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Loadable by transformers 4 as well as 5 (whose own name for the class 4 does not have).
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"},
                                 indent=2) + "\n")
    with_umask_modes(out)
    return out


def transformers_tokenizer(spec, max_length: int | None):
    """The run's ids as a transformers tokenizer: the separator before each text, then its bytes' values
    or its ids in the run's `data.tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if spec.data.tokenizer is None:
        # Byte-level BPE without merges, each byte's character (GPT-2's byte alphabet) mapped to its value.
        tokenizer = Tokenizer(models.BPE(vocab={char: byte for byte, char in bytes_to_unicode().items()}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        from training.data.corpora import data_root
        from training.data.shards import load_tokenizer

        try:
            tokenizer = load_tokenizer(spec, data_root(spec))
        except (ValueError, PermissionError) as err:
            raise NotExportable(f"its tokenizer: {err}") from None
    tokenizer.add_special_tokens([AddedToken(SEPARATOR, special=True)])
    if tokenizer.token_to_id(SEPARATOR) != spec.separator:
        raise NotExportable(f"its tokenizer already has a token {SEPARATOR!r}, which would not be the separator's id")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SEPARATOR} $A", pair=f"{SEPARATOR} $A {SEPARATOR} $B", special_tokens=[(SEPARATOR, spec.separator)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SEPARATOR, eos_token=SEPARATOR,
                                   **({"model_max_length": max_length} if max_length else {}))


def with_umask_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes a new file and folder get under the umask: the
    writers transformers uses create some files 0600 (a temporary file renamed into place)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


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
