"""The size-scaling benchmark's plan (no training: finished arms are stood in for by their scores): equal
tokens within a size at about 20 per parameter, M learners sharing standard training's chosen batch,
sweeps that end interior, and the gap and its fit."""

import math

import pytest

from experiments.size_scaling.campaign import (BATCH_LIMITS, LEARNERS, SIZES, TOKENS_PER_PARAMETER, SizeArm, figure, gap_fit, parameters, plan,
                                summary)
from training.baseline import BaselinePlan


def rows(arm: SizeArm) -> int:
    spec = arm.spec()
    if arm.kind == "standard":
        return sum(BaselinePlan.of(spec).planned_rows)
    return sum(slot.rows_per_round * spec.sync.rounds for slot in spec.learners)


@pytest.mark.parametrize("size", list(SIZES))
def test_every_arm_of_a_size_trains_the_same_tokens_about_twenty_per_parameter(size):
    arms = [SizeArm("standard", size, 5e-3, batch) for batch in (8, 16, 128)]
    arms += [SizeArm("islands", size, 5e-3, batch, m, 0.7) for batch in (8, 32, 128) for m in LEARNERS]
    assert len({rows(arm) for arm in arms}) == 1
    tokens = rows(arms[0]) * arms[0].spec().islands[0].seq_len
    assert TOKENS_PER_PARAMETER <= tokens / parameters(size) < TOKENS_PER_PARAMETER * 1.1
    eight = SizeArm("islands", size, 5e-3, 32, 8, 0.7).spec()
    assert len(eight.islands) == 8 and {s.island.batch_size for s in eight.learners} == {4}
    assert eight.sync.mode == "allreduce" and eight.sync.outer.name == "nesterov"


def test_sizes_are_about_a_fifth_half_and_one_million_parameters():
    counts = [parameters(size) for size in SIZES]
    assert counts == sorted(counts) and 0.15e6 < counts[0] < 0.25e6 and 0.4e6 < counts[1] < 0.5e6 and 0.9e6 < counts[2] < 1.2e6


def scored(arm: SizeArm, best_batch: int) -> dict:
    """Standard training a parabola in log lr around 4e-3 x sqrt(batch / 16), worse away from `best_batch`;
    M learners worse by 1% per learner past the first, best at outer rate 0.7 and standard training's rate
    (1.0 and half of it for M = 8)."""
    if arm.kind == "standard":
        value = 2 + (math.log(arm.lr) - math.log(4e-3 * math.sqrt(arm.batch / 16))) ** 2 \
            + 0.1 * abs(math.log2(arm.batch / best_batch))
    else:
        best_lr = 4e-3 * math.sqrt(arm.batch / 16) * (0.5 if arm.learners == 8 else 1.0)
        value = 2 * (1 + 0.01 * (arm.learners - 1)) + (arm.outer_lr - (1.0 if arm.learners == 8 else 0.7)) ** 2 \
            + 0.1 * (math.log(arm.lr) - math.log(best_lr)) ** 2
    value -= 0.1 * list(SIZES).index(arm.size)
    return {"arm": arm.name, "kind": arm.kind, "size": arm.size, "learners": arm.learners, "seed": arm.seed,
            "lr": arm.lr, "global_batch": arm.batch, "outer_lr": arm.outer_lr, "tokens": rows(arm) * 128,
            "train_seconds": 1.0, "parameters": {"total": parameters(arm.size)},
            "bpb": {"code": value, "prose": value}, "validation_bpb": {"code": value, "prose": value}}


def test_sweeps_end_interior_and_every_size_runs_every_m_at_its_chosen_settings(tmp_path):
    results = {}
    for _ in range(400):
        todo = plan(results).todo
        if not todo:
            break
        results[todo[0].name] = scored(todo[0], best_batch=32)
    chosen = plan(results)
    assert not chosen.todo
    assert all(chosen.standard[size][0] == 32 for size in SIZES)
    assert chosen.outer == {1: 0.7, 2: 0.7, 4: 0.7, 8: 1.0}
    # The stand-in's best inner rate is the same multiple at every size; each size's sweep finds it again.
    assert chosen.inner_factor == {(size, m): 0.5 if m == 8 else 1.0 for size in SIZES for m in LEARNERS}
    islands = [r for r in results.values() if r["kind"] == "islands"]
    assert {(r["size"], r["learners"]) for r in islands} == {(s, m) for s in SIZES for m in LEARNERS}
    assert all(r["global_batch"] == 32 for r in islands)
    # Past the smallest size, each M's inner sweep starts at the smaller size's multiple and half of it;
    # M = 8's at M = 4's multiple at the same size and twice it.
    for smaller, larger in zip(SIZES, list(SIZES)[1:]):
        for m in LEARNERS:
            tried = [r["lr"] / chosen.standard[larger][1] for r in islands if r["size"] == larger and r["learners"] == m]
            start = (chosen.inner_factor[(larger, 4)], 2 * chosen.inner_factor[(larger, 4)]) if m == 8 else \
                (chosen.inner_factor[(smaller, m)] / 2, chosen.inner_factor[(smaller, m)])
            assert sorted(tried[:2]) == pytest.approx(start, rel=0.03)
            if m == 8:
                assert len(tried) == 4  # from 1x and 2x down to its best 0.5x, and 0.25x past it
    table = summary(results)
    assert all(table["sizes"][size]["learners"]["8"]["inner_lr_factor"] == 0.5 for size in SIZES)
    for size in SIZES:
        # The stand-in's learners lose 1% of bpb per learner past the first, at every size.
        gaps = [table["sizes"][size]["learners"][str(m)]["mean_gap"] for m in LEARNERS]
        assert [b - a for a, b in zip(gaps, gaps[1:])] == pytest.approx([0.01 * 2 / (2 - 0.1 * list(SIZES).index(size))
                                                                        * k for k in (1, 2, 4)], rel=0.05)
    assert table["fits"]["8"]["slope_per_decade"] > 0  # the stand-in's gap grows as its bpb falls
    figure(table, tmp_path / "gap.png")
    assert (tmp_path / "gap.png").stat().st_size > 10_000


def test_no_batch_outside_the_limits_runs_and_each_size_starts_from_the_smaller_ones_optimum():
    results, order = {}, []
    for _ in range(400):
        todo = plan(results).todo
        if not todo:
            break
        order.append(todo[0])
        results[todo[0].name] = scored(todo[0], best_batch=BATCH_LIMITS[0])
    chosen = plan(results)
    assert not chosen.todo and all(chosen.standard[size][0] == BATCH_LIMITS[0] for size in SIZES)
    assert all(BATCH_LIMITS[0] <= arm.batch <= BATCH_LIMITS[1] for arm in order)
    for smaller, larger in zip(SIZES, list(SIZES)[1:]):
        first = next(arm for arm in order if arm.size == larger)
        assert (first.batch, first.lr) == (BATCH_LIMITS[0], pytest.approx(chosen.standard[smaller][1] / 2, rel=0.03))
    # From the optimum, a larger size's standard sweep is the rate at that batch and at twice it.
    assert len([arm for arm in order if arm.size == list(SIZES)[1] and arm.kind == "standard"]) == 6


def test_the_gap_fit_is_a_line_in_log10_parameters():
    fit = gap_fit({1e6: 0.05, 1e7: 0.03, 1e8: 0.01})
    assert fit["slope_per_decade"] == pytest.approx(-0.02) and fit["intercept"] == pytest.approx(0.17)
    assert gap_fit({1e6: 0.05}) is None
