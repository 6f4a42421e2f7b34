"""Who a learner exchanges with, and how two or more learners' states are mixed.

Butterfly schedule. With N learners and S = ceil(log2 N) stages, round t uses stage
s = t mod S and learner i's partner is i XOR 2^s. When N is a power of two every learner has a
partner at every stage, and S back-to-back stages of pairwise averaging give every learner the
exact mean. When N is not a power of two, the partner index can fall outside [0, N): that
learner sits the stage out (it keeps its own state for the round), as if its partner were a
missing learner. Information still reaches every learner: the lower half of the hypercube
relays it in the next cycle. Learners are numbered island by island, so the low stages pair
learners on the same island and only the high stages cross the wide-area link. With
`sync.inter_island_every` k > 1, a pair on different islands exchanges only in every k-th cycle of
stages and sits the stage out otherwise: the islands mix internally at the round rate and cross
the slow link k times less often.

Mixing rule (butterfly). Each learner sends its round's anchor θ_i (the weights it started the
round from) and its pseudo-gradient Δ_i = θ_i − x_i. Both partners then compute
    θ = (θ_i + θ_p) / 2,   Δ = (n_i Δ_i + n_p Δ_p) / (n_i + n_p)
where n are the tokens each processed this round, and take an outer optimizer step from θ along
Δ. Averaging anchors, not only pseudo-gradients, is what keeps learners together: with pseudo-gradients
alone, partners that step from their own anchors drift apart round after round. Anchors are averaged
with equal weights so both partners land on the same θ.

Hierarchical mixing. The learners of an island share one anchor θ_I and one outer optimizer state
per fragment. Each round, a learner's pseudo-gradient Δ_i = θ_I − x_i goes to the other learners of
its island; each takes the island's token-weighted mean Δ_I and one outer step from θ_I along it, so
the whole island lands on the same new θ_I: DiLoCo over the island's fast path. In every
`inter_island_every`-th exchange of a fragment the islands cross right after that step: the island's
j-th learner carries slice j of its new θ_I (`slice_bounds`) to the other islands' learners whose
slices overlap it, takes that slice's islands' mean (`mean_over_islands`, weighted by the islands'
tokens) and shares it with its own island; every learner ends with the islands' mean anchor, the
same on every island. The outer optimizers' states stay each island's own: a crossing moves only the
anchors.
"""

from __future__ import annotations

import math

import torch


def stage_count(learners: int) -> int:
    """Butterfly stages in one full exchange: ceil(log2 N), at least one."""
    return max(1, math.ceil(math.log2(learners)))


def butterfly_partner(index: int, round_index: int, learners: int) -> int | None:
    """Partner of `index` in round `round_index`, or None when it sits this stage out."""
    if learners == 1:
        return None
    partner = index ^ (1 << (round_index % stage_count(learners)))
    return partner if partner < learners else None


def crosses_islands_in(exchange: int, inter_island_every: int, cycle: int = 1) -> bool:
    """Whether learners on different islands exchange at this exchange count of a fragment: only in
    every `inter_island_every`-th cycle of `cycle` exchanges (the last of each group; a butterfly's
    cycle is its stages), so the slow link is crossed that many times less often while learners
    within an island exchange every time."""
    return (exchange // cycle) % inter_island_every == inter_island_every - 1


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Mean in the order given, so every learner that mixes the same inputs gets the same bits."""
    total = float(sum(weights))
    out = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights):
        out.add_(tensor, alpha=weight / total)
    return out


def slice_bounds(numel: int, parts: int, part: int) -> tuple[int, int]:
    """Where part `part` of `parts` lies in a vector of `numel` elements, as `torch.tensor_split` cuts
    it (the first numel mod parts parts one element longer), computed without the vector."""
    size, longer = divmod(numel, parts)
    start = part * size + min(part, longer)
    return start, start + size + (part < longer)


def mean_over_islands(numel: int, islands: list[tuple[float, list[torch.Tensor | None]]],
                      span: tuple[int, int] | None = None) -> torch.Tensor:
    """The hierarchical crossing's mean of a fragment's anchor of `numel` elements, or of its elements
    `span` (start, end) alone. `islands`, in island order: (the island's tokens, its slices in order as
    `slice_bounds` cuts the fragment into as many parts, each None when it did not arrive). Element by
    element, the token-weighted mean over the islands whose slice holding it arrived, summed in island
    order, so every learner that heard the same slices gets the same bits. Islands may cut the fragment
    into different numbers of slices."""
    low_end, high_end = span or (0, numel)
    cuts = sorted({low_end, high_end} | {bound for _, parts in islands for part in range(len(parts))
                                         for bound in slice_bounds(numel, len(parts), part)
                                         if low_end < bound < high_end})
    anchor = torch.empty(high_end - low_end)
    for low, high in zip(cuts, cuts[1:]):
        present = []
        for tokens, parts in islands:
            for part, values in enumerate(parts):
                start, end = slice_bounds(numel, len(parts), part)
                if values is not None and start <= low < end:
                    present.append((values[low - start:high - start], tokens))
        if not present:
            raise ValueError(f"elements {low} to {high} of the fragment: no island's slice holds them")
        anchor[low - low_end:high - low_end] = weighted_mean([p[0] for p in present], [p[1] for p in present])
    return anchor


def mix_pair(anchor: torch.Tensor, delta: torch.Tensor, tokens: float,
             partner_anchor: torch.Tensor, partner_delta: torch.Tensor,
             partner_tokens: float, own_index: int, partner_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The butterfly mixing rule. Inputs are combined in learner order so both partners agree bitwise."""
    pair = sorted([(own_index, anchor, delta, tokens), (partner_index, partner_anchor, partner_delta, partner_tokens)],
                  key=lambda item: item[0])
    mixed_anchor = weighted_mean([p[1] for p in pair], [1.0, 1.0])
    mixed_delta = weighted_mean([p[2] for p in pair], [p[3] for p in pair])
    return mixed_anchor, mixed_delta
