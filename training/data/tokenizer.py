"""A `tokenizers` vocabulary for a run: byte-level BPE trained on the training side of the run's
corpora only (the same split as data preparation), so no held-out or validation text shapes it."""

from __future__ import annotations

from pathlib import Path

from training.data.shards import split_corpus


def train_tokenizer(spec, vocab_size: int, out: Path) -> int:
    """Train on the spec's training documents and write the tokenizer's JSON to `out`; returns the size
    of its vocabulary (at most `vocab_size`: a small corpus may hold fewer merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [doc.text for corpus in spec.data.corpora for doc in split_corpus(spec, corpus)[2]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return tokenizer.get_vocab_size()
