"""Fragments: the model split into parameter groups that are exchanged one at a time.

Layout. Transformer blocks (which block a parameter belongs to, the model's `block_of` says) are dealt to fragments `strided` (block b goes to fragment b mod F,
as Streaming DiLoCo found better than contiguous groups) or `contiguous` (consecutive blocks
together). Tensors outside the blocks (embeddings, final norm, head) go, largest first, to the
fragment that is smallest so far, which keeps fragments near equal in size.

Schedule. Round t exchanges fragment t mod F, so each round moves about 1/F of the model and
every fragment is synchronised once every F rounds (after F rounds of local progress). The
butterfly stage of an exchange follows the fragment's own exchange count k = t div F (stage
k mod S): with stage t mod S instead, F = S = 2 would send fragment 0 only within an island
forever. With F = 1 this is today's schedule exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FragmentLayout:
    """Positions in the flat parameter vector (as `flat_parameters` orders it) of each fragment."""

    indices: tuple[torch.Tensor, ...]
    names: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> list[int]:
        return [int(i.numel()) for i in self.indices]

    @classmethod
    def build(cls, model: torch.nn.Module, fragments: int, layout: str = "strided") -> "FragmentLayout":
        tensors, offset = [], 0
        for name, p in model.named_parameters():
            tensors.append((name, offset, p.numel()))
            offset += p.numel()
        owner = assign_fragments([(name, numel) for name, _, numel in tensors], model.block_of, fragments, layout)
        indices, names = [], []
        for f in range(fragments):
            mine = [(name, start, numel) for name, start, numel in tensors if owner[name] == f]
            indices.append(torch.cat([torch.arange(start, start + numel) for _, start, numel in mine]))
            names.append(tuple(name for name, _, _ in mine))
        return cls(tuple(indices), tuple(names))


def assign_fragments(tensors: list[tuple[str, int]], block_of: Callable[[str], int | None], fragments: int,
                     layout: str = "strided") -> dict[str, int]:
    """Each parameter's fragment, from (name, elements) in flat-parameter order: transformer blocks
    (`block_of(name)`, None outside them) by `layout`, the rest (embeddings, final norm) each to the
    fragment with the fewest elements so far."""
    block = {name: block_of(name) for name, _ in tensors}
    blocks = sorted({b for b in block.values() if b is not None})
    if fragments > max(1, len(blocks)):
        raise ValueError(f"fragments: {fragments} but the model has {len(blocks)} blocks to split")
    owner: dict[str, int] = {}
    for name, _ in tensors:
        if block[name] is not None:
            b = blocks.index(block[name])
            owner[name] = b % fragments if layout == "strided" else b * fragments // len(blocks)
    load = [0] * fragments
    for name, numel in tensors:
        if name in owner:
            load[owner[name]] += numel
    for name, numel in sorted((t for t in tensors if t[0] not in owner), key=lambda t: -t[1]):
        owner[name] = min(range(fragments), key=lambda f: load[f])
        load[owner[name]] += numel
    return owner


def fragment_of_round(round_index: int, fragments: int) -> int:
    return round_index % fragments


def exchange_count(round_index: int, fragments: int) -> int:
    """How many times this round's fragment was exchanged before: it picks the butterfly stage."""
    return round_index // fragments


def whole_parameter_shards(parameter_sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """A fragment (its parameters' element counts, in order) cut into `parts` runs of whole parameters,
    each (start, end) in the fragment's elements: cut k falls on the parameter boundary nearest k/parts
    of the elements. An outer optimizer steps each parameter on its own (Shampoo's blocks and its
    grafting's norm lie within one), so a step over each run gives the step over the whole. With fewer
    parameters than parts, some runs are empty."""
    bounds = [0]
    for size in parameter_sizes:
        bounds.append(bounds[-1] + size)
    total, cuts = bounds[-1], [0]
    for k in range(1, parts):
        nearest = min(bounds, key=lambda b: (abs(b - k * total / parts), b))
        cuts.append(max(cuts[-1], nearest))
    cuts.append(total)
    return list(zip(cuts, cuts[1:]))
