"""The run's learners as islands: who shares whose fast path, and what each trains in a round.

Learners are numbered island by island (`infra.spec`), so an island's learners are consecutive.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.spec import RunSpec


@dataclass(frozen=True)
class Topology:
    islands: tuple[tuple[int, ...], ...]  # each island's learners, islands and learners in order
    names: tuple[str, ...]  # each island's name
    tokens: tuple[int, ...]  # each learner's tokens per round: what a mix weighs it by, never a message's word

    @classmethod
    def of(cls, spec: RunSpec) -> "Topology":
        return cls(tuple(tuple(slot.index for slot in spec.learners if slot.island.name == island.name)
                         for island in spec.islands),
                   tuple(island.name for island in spec.islands),
                   tuple(slot.tokens_per_round() for slot in spec.learners))

    @property
    def learners(self) -> int:
        return len(self.tokens)

    def members(self, learner: int) -> tuple[int, ...]:
        """The learners of `learner`'s island, in order."""
        return next(members for members in self.islands if learner in members)

    def links(self, me: int) -> list[str]:
        """Per learner of the run: "intra" where it shares learner `me`'s island, else "inter"."""
        mine = self.members(me)
        return ["intra" if peer in mine else "inter" for peer in range(self.learners)]

    def island_tokens(self) -> list[int]:
        """Each island's tokens per round, in island order."""
        return [sum(self.tokens[m] for m in members) for members in self.islands]
