"""sync.inter_island_every: butterfly pairs on different islands exchange only in every k-th cycle of
stages, pairs within an island every cycle, and partners always agree on whether they exchange."""

from pathlib import Path

import pytest
import yaml

from infra.spec import SpecError, load_spec, parse_spec
from training.exchange.fragments import exchange_count
from training.exchange.mixing import stage_count
from training.exchange.compression import Codec
from training.exchange.modes import Butterfly
from training.exchange.topology import Topology

BRIEF = Path(__file__).resolve().parents[1] / "configs" / "brief.yaml"


def butterfly(islands: list[int], fragments: int, every: int = 1) -> Butterfly:
    """A butterfly over islands of these sizes, learners numbered island by island."""
    members, first = [], 0
    for size in islands:
        members.append(tuple(range(first, first + size)))
        first += size
    topology = Topology(tuple(members), tuple(f"island-{n}" for n in range(len(islands))), (1,) * first)
    return Butterfly(topology, Codec(), fragments, every)


@pytest.mark.parametrize("islands,fragments,every", [([4, 4], 2, 3), ([4, 4], 1, 2), ([2, 2], 2, 4), ([3, 5], 1, 3)])
def test_crossing_pairs_exchange_only_in_every_kth_cycle_and_partners_agree(islands, fragments, every):
    mode, plain_mode = butterfly(islands, fragments, every), butterfly(islands, fragments)
    learners = sum(islands)
    for t in range(4 * every * stage_count(learners) * fragments):
        crossing_cycle = (exchange_count(t, fragments) // stage_count(learners)) % every == every - 1
        for me in range(learners):
            peers, plain = mode.peers(me, t), plain_mode.peers(me, t)
            assert all(me in mode.peers(p, t) for p in peers)
            if plain and mode.topology.links(me)[plain[0]] == "inter":
                assert peers == (plain if crossing_cycle else [])
            else:
                assert peers == plain  # pairs within an island are untouched


def test_inter_island_every_needs_butterfly_and_names_the_field():
    raw = yaml.safe_load(BRIEF.read_text())
    raw["sync"].update(mode="allreduce", inter_island_every=3)
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert "inter_island_every" in str(err.value) and "butterfly" in str(err.value)
    raw["sync"].update(inter_island_every=0, mode="butterfly")
    with pytest.raises(SpecError, match="sync.inter_island_every"):
        parse_spec(raw)
    assert load_spec(BRIEF).sync.inter_island_every >= 1
