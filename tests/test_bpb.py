import math

import torch

from eval.bpb import bits_per_byte
from infra.spec.model import BOS, BYTE_VOCAB as VOCAB


class FixedModel(torch.nn.Module):
    """Puts probability p on the true next byte's value 'a' and spreads the rest uniformly."""

    def __init__(self, favourite: int, p: float):
        super().__init__()
        rest = (1 - p) / (VOCAB - 1)
        logits = torch.full((VOCAB,), math.log(rest))
        logits[favourite] = math.log(p)
        self.logits = logits

    def forward(self, idx):
        return self.logits.expand(*idx.shape, VOCAB)


def test_bits_per_byte_matches_hand_computation():
    # "aab" then a second document "ba": 5 text bytes, 2 separators that are never scored.
    stream = torch.tensor([BOS, 97, 97, 98, BOS, 98, 97])
    p = 0.5
    rest = (1 - p) / (VOCAB - 1)
    # targets scored: a a b | b a  -> three hits on 'a' (p) and two misses (rest)
    expected = -(3 * math.log(p) + 2 * math.log(rest)) / (math.log(2) * 5)
    for seq_len in (2, 3, 4, 16):
        result = bits_per_byte(FixedModel(97, p), stream, seq_len=seq_len, batch_size=2)
        assert result["bytes"] == 5
        assert math.isclose(result["bpb"], expected, rel_tol=1e-6)  # float32 logits


def test_uniform_model_scores_log2_of_vocab():
    stream = torch.cat([torch.tensor([BOS]), torch.randint(0, 256, (999,))])
    result = bits_per_byte(FixedModel(0, 1 / VOCAB), stream, seq_len=64)
    assert result["bytes"] == 999
    assert math.isclose(result["bpb"], math.log2(VOCAB), rel_tol=1e-6)


def test_bits_are_summed_per_document_whatever_the_windows():
    # Documents "aab" (two hits, one miss) and "ba" (one miss, one hit); windows cut across them.
    stream = torch.tensor([BOS, 97, 97, 98, BOS, 98, 97])
    p = 0.5
    hit, miss = -math.log2(p), -math.log2((1 - p) / (VOCAB - 1))
    for seq_len in (2, 3, 16):
        result = bits_per_byte(FixedModel(97, p), stream, seq_len=seq_len, batch_size=2)
        assert result["document_bytes"] == [3, 2]
        assert all(math.isclose(got, want, rel_tol=1e-6)
                   for got, want in zip(result["document_bits"], [2 * hit + miss, miss + hit]))
        assert math.isclose(sum(result["document_bits"]), result["bpb"] * 5, rel_tol=1e-9)
