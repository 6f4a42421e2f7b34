"""sync.inter_island_every: butterfly pairs on different islands exchange only in every k-th cycle of
stages, pairs within an island every cycle, and partners always agree on whether they exchange."""

from pathlib import Path

import pytest
import yaml

from infra.spec import SpecError, load_spec, parse_spec
from training.exchange.fragments import exchange_count
from training.exchange.mixing import stage_count
from training.exchange.exchanger import Butterfly

BRIEF = Path(__file__).resolve().parents[1] / "configs" / "brief.yaml"


def links_of(islands: list[int]) -> list[list[str]]:
    """Each learner's view of every peer's link class, from learners' island sizes in order."""
    island = [n for n, size in enumerate(islands) for _ in range(size)]
    return [["intra" if island[p] == island[me] else "inter" for p in range(len(island))] for me in range(len(island))]


@pytest.mark.parametrize("islands,fragments,every", [([4, 4], 2, 3), ([4, 4], 1, 2), ([2, 2], 2, 4), ([3, 5], 1, 3)])
def test_crossing_pairs_exchange_only_in_every_kth_cycle_and_partners_agree(islands, fragments, every):
    links, mode = links_of(islands), Butterfly()
    learners = len(links)
    for t in range(4 * every * stage_count(learners) * fragments):
        crossing_cycle = (exchange_count(t, fragments) // stage_count(learners)) % every == every - 1
        for me in range(learners):
            peers = mode.peers(me, t, fragments, links[me], every)
            plain = mode.peers(me, t, fragments, links[me])
            assert all(me in mode.peers(p, t, fragments, links[p], every) for p in peers)
            if plain and links[me][plain[0]] == "inter":
                assert peers == (plain if crossing_cycle else [])
            else:
                assert peers == plain  # pairs within an island are untouched


def test_every_one_is_the_plain_butterfly():
    links, mode = links_of([4, 4]), Butterfly()
    assert all(mode.peers(me, t, 2, links[me], 1) == mode.peers(me, t, 2, links[me])
               for t in range(24) for me in range(8))


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
