"""Fragment layouts and the staggered exchange schedule."""

import pytest
import torch

from infra.spec import SpecError, parse_spec
from training.exchange.fragments import FragmentLayout, exchange_count, fragment_of_round
from training.model.params import flat_parameters
from training.exchange.mixing import butterfly_partner, stage_count
from training.model.gpt import ByteGPT, GPTConfig


def model(layers=4):
    return ByteGPT(GPTConfig(width=16, heads=2, layers=layers, max_seq_len=32))


def block_of(name):
    return int(name.split(".")[1]) if name.startswith("blocks.") else None


@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_fragments_partition_the_parameter_vector(fragments, layout):
    m = model()
    frag = FragmentLayout.build(m, fragments, layout)
    covered = torch.cat(frag.indices).sort().values
    assert torch.equal(covered, torch.arange(flat_parameters(m).numel()))
    assert frag.count == fragments and all(size > 0 for size in frag.sizes)


def test_strided_deals_blocks_round_robin_and_contiguous_keeps_neighbours_together():
    strided = FragmentLayout.build(model(4), 2, "strided")
    contiguous = FragmentLayout.build(model(4), 2, "contiguous")
    assert [{block_of(n) for n in names} - {None} for names in strided.names] == [{0, 2}, {1, 3}]
    assert [{block_of(n) for n in names} - {None} for names in contiguous.names] == [{0, 1}, {2, 3}]


def test_tensors_outside_blocks_balance_fragment_sizes():
    m = model(2)
    frag = FragmentLayout.build(m, 2)
    largest_outside = max(p.numel() for n, p in m.named_parameters() if block_of(n) is None)
    # Greedy placement, largest first, leaves fragments at most one such tensor apart.
    assert max(frag.sizes) - min(frag.sizes) <= largest_outside
    assert "tok.weight" in frag.names[0] and "pos.weight" in frag.names[1]


def test_an_indexed_fragment_is_exactly_its_parameters():
    m = model(2)
    frag = FragmentLayout.build(m, 2)
    flat = flat_parameters(m)
    params = dict(m.named_parameters())
    expected = torch.cat([params[n].detach().reshape(-1) for n in frag.names[1]])
    assert torch.equal(flat[frag.indices[1]], expected)


def test_more_fragments_than_blocks_is_refused():
    with pytest.raises(ValueError, match="fragments: 3"):
        FragmentLayout.build(model(2), 3)


def test_each_round_exchanges_one_fragment_in_turn():
    assert [fragment_of_round(t, 3) for t in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [fragment_of_round(t, 1) for t in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("fragments,learners", [(2, 4), (4, 4), (2, 8), (3, 4)])
def test_every_fragment_meets_every_butterfly_stage(fragments, learners):
    """Stage t mod S with F = S would pin a fragment to one stage (never crossing islands)."""
    stages = stage_count(learners)
    for f in range(fragments):
        rounds = [t for t in range(fragments * stages) if fragment_of_round(t, fragments) == f]
        partners = {butterfly_partner(0, exchange_count(t, fragments), learners) for t in rounds}
        assert partners == {1 << s for s in range(stages)}


def test_one_fragment_keeps_the_plain_butterfly_schedule():
    assert [exchange_count(t, 1) for t in range(5)] == list(range(5))


BASE = {"islands": [{"name": "a", "learners": 2, "batch_size": 2, "seq_len": 16, "inner_steps": 4}],
        "model": {"layers": 2}, "data": {"corpora": [{"name": "t", "source": "shakespeare"}]}}


@pytest.mark.parametrize("transport,field", [({"fragments": 3}, "sync.transport.fragments"),
                                             ({"tau": 5}, "sync.transport.tau"),
                                             ({"compression": "int2"}, "sync.transport.compression"),
                                             ({"topk": 0}, "sync.transport.topk")])
def test_transport_settings_are_validated_naming_the_field(transport, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec({**BASE, "sync": {"rounds": 2, "transport": transport}})


def test_transport_defaults_keep_todays_behaviour():
    transport = parse_spec({**BASE, "sync": {"rounds": 2}}).sync.transport
    assert (transport.fragments, transport.tau, transport.compression, transport.topk) == (1, 0, "none", 1.0)
    assert transport.bandwidth.inter_island is None and transport.bandwidth.intra_island is None
