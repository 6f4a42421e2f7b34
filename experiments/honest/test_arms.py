"""The honest-regime benchmark's plan (no training: finished arms are stood in for by their validation
scores): equal tokens at 20 per active parameter, sweeps that end only at interior optima, batches
included, and the tokens standard training needs to reach a bpb."""

import math
import statistics
from dataclasses import replace

import pytest

from experiments.honest.campaign import (BATCH_LIMITS, BYTES_GOAL, DIAGNOSTICS, LONGER_B, SEEDS, TOKENS_PER_ACTIVE_PARAMETER, HonestArm,
                          fewest_tokens, figure, inter_island_reduction, most_frequent_crossing, outer_momentum, page,
                          plan, summary, tokens_to_reach)
from training.baseline import BaselinePlan
from training.model.registry import build_model


def rows(arm) -> int:
    spec = arm.spec()
    if arm.kind == "standard":
        return sum(BaselinePlan.of(spec).planned_rows)
    return sum(slot.rows_per_round * spec.sync.rounds for slot in spec.learners)


def test_every_arm_trains_the_same_tokens_about_twenty_per_active_parameter():
    arms = [HonestArm("standard", 0, lr=5e-3, batch=b) for b in (6, 12, 24, 48, 96)]
    arms += [HonestArm("single", 0, lr=3e-3, outer_lr=1.0), HonestArm("islands", 1, lr=6e-3, outer_lr=0.7, stable=True),
             HonestArm("islands", 0, lr=3e-3, outer_lr=0.7, outer_optimizer="nesterov"), HonestArm("butterfly_today", 2)]
    arms += [HonestArm("islands", 0, batch=b) for b in (12, 24, 96)] + [HonestArm("single", 0, batch=24)]
    arms += [HonestArm("islands", 0, lr=6e-3, outer_lr=1.0, diagnostic=d) for d in DIAGNOSTICS]
    assert len({rows(arm) for arm in arms}) == 1
    # (b) on more tokens: its schedule stretched, its curve as dense.
    longer = replace(arms[0], tokens_factor=2)
    assert rows(longer) == 2 * rows(arms[0]) and longer.name == "b-b6-lr0.005-t2-s0"
    assert longer.spec().evaluation.curve_points == 2 * arms[0].spec().evaluation.curve_points
    spec = arms[8].spec()
    active = build_model(spec).parameter_counts()["active"]
    tokens = rows(arms[0]) * spec.islands[0].seq_len
    assert TOKENS_PER_ACTIVE_PARAMETER <= tokens / active < TOKENS_PER_ACTIVE_PARAMETER * 1.01
    spec = arms[8].spec()
    assert arms[6].spec().sync.mode == "hierarchical" and spec.sync.mode == "butterfly"
    assert arms[6].spec().model.qk_norm and not spec.model.qk_norm
    outer = arms[7].spec().sync.outer
    assert (outer.name, outer.lr, outer.momentum) == ("nesterov", 0.7, 0.9) and arms[6].spec().sync.outer.name == "shampoo"
    # Half the recipe's global batch: half the rows per inner step, twice the inner steps, the same rounds.
    half, recipe = arms[10].spec(), arms[6].spec()
    assert [(i.batch_size * 2, i.inner_steps) for i in half.islands] == [(i.batch_size, i.inner_steps * 2) for i in recipe.islands]
    assert half.sync.rounds == recipe.sync.rounds and arms[10].name == "islands-b24-s0"
    # Taking the fragments away keeps the crossings as many rounds apart, at any crossing interval.
    for every in (None, 2, 5):
        crossing = HonestArm("islands", 0, crossing_every=every)
        whole = replace(crossing, diagnostic="whole").spec()
        assert (whole.sync.transport.fragments, whole.sync.transport.tau) == (1, 0)
        assert whole.sync.inter_island_every == crossing.spec().sync.inter_island_every * recipe.sync.transport.fragments
    assert HonestArm("islands", 0, crossing_every=2).spec().sync.inter_island_every == 2
    single = arms[5].spec()
    assert len(single.learners) == 1 and single.sync.transport.compression == "none"


def scored(arm, best_batch: int) -> dict:
    """A parabola in log lr around each kind's best rate; batches further from `best_batch` worse."""
    if arm.kind == "standard":
        value = 2 + (math.log(arm.lr) - math.log(4e-3 * math.sqrt(arm.batch / 24))) ** 2 \
            + 0.1 * abs(math.log2(arm.batch / best_batch))
    elif arm.kind == "butterfly_today":
        value = 2.6
    else:
        # The islands do best with averaging at outer rate 1.4, momentum 0.5 (averaging's own is 0) and
        # global batch 24; one learner with the recipe's at 1.0, its momentum (0.5) and batch.
        best = ("averaging", 1.4, 24) if arm.kind == "islands" else (None, 1.0, None)
        momentum = arm.outer_momentum if arm.outer_momentum is not None else outer_momentum(arm.outer_optimizer)
        # The islands cross best every 5th exchange (the recipe: every 15th).
        value = 2.2 + (math.log(arm.lr) - math.log(3e-3)) ** 2 + (arm.outer_lr - best[1]) ** 2 \
            + 0.05 * (arm.outer_optimizer != best[0]) + 0.1 * abs(math.log2((arm.batch or 48) / (best[2] or 48))) \
            + 0.1 * (momentum - 0.5) ** 2 + 0.01 * abs(math.log((arm.crossing_every or 15) / 5)) \
            - {"int8": 0.02, "fp32": 0.005}.get(arm.compression, 0)  # int8 spends the bytes goal best
    if arm.stable:  # QK-LayerNorm and z-loss help the islands only
        value += -0.01 if arm.kind == "islands" else 0.01
    value -= 0.1 * math.log2(arm.tokens_factor)  # more tokens, lower bpb
    curve = [{"tokens": t * arm.tokens_factor, "bpb": {"code": value + 1 / t ** 0.5, "prose": value + 1 / t ** 0.5}}
             for t in (1e5, 1e6, 4e6, 8.9e6)]
    return {"arm": arm.name, "kind": arm.kind, "seed": arm.seed, "lr": arm.lr, "global_batch": arm.batch,
            "tokens_factor": arm.tokens_factor,
            "outer_lr": arm.outer_lr, "outer_optimizer": arm.outer_optimizer, "stable": arm.stable, "tokens": 8.9e6, "train_seconds": 1.0, "heldout_curve": curve,
            "bpb": {"code": value, "prose": value + 0.1}, "validation_bpb": {"code": value, "prose": value},
            "heldout_documents": {e: {"ids": [1, 2, 3], "bits": [value * 8, value * 9, value * 10], "bytes": [8, 9, 10]}
                                  for e in ("code", "prose")},
            "commit": "0123abc", "date": "2026-12-06",
            **({"communication": {"inter_island_bytes": 2.3e7, "allreduce_equivalent_bytes": 2.5e10,
                                  "inter_island_reduction": 2.5e10 / 2.3e7}} if arm.kind == "islands" else {})}


@pytest.mark.parametrize("best_batch", [24, 6, 3])
def test_sweeps_end_interior_and_the_chosen_settings_run_on_every_seed(best_batch, tmp_path):
    results = {}
    for _ in range(300):
        now = plan(results)
        if not now.todo:
            break
        swept = [r for r in results.values() if r["kind"] == "standard" and r["seed"] == 0 and not r["stable"]]
        if swept and not now.b_final:  # (b) so far: its best finished arm
            best = min(swept, key=lambda r: r["validation_bpb"]["code"])
            assert now.b == (best["global_batch"], best["lr"])
        if now.islands is not None and not now.islands_final:  # the islands so far: a finished crossing arm
            assert now.islands.name in results and now.todo[0].kind == "islands"
        results[now.todo[0].name] = scored(now.todo[0], best_batch)
    chosen = plan(results)
    assert not chosen.todo and chosen.b_final and chosen.islands_final
    batches = sorted({r["global_batch"] for r in results.values() if r["kind"] == "standard"})
    assert chosen.b[0] == best_batch  # the batch grew past the first grid's edge to reach 6
    assert batches[-1] > chosen.b[0] and (batches[0] < chosen.b[0] or chosen.b[0] == BATCH_LIMITS[0])
    islands, single = chosen.islands, chosen.c
    assert (islands.outer_lr, islands.outer_optimizer, islands.outer_momentum, islands.batch) == (1.4, "averaging", 0.5, 24)
    # Crossings swept from the recipe's every 15th down to the most frequent within the bytes goal; the
    # grid's middle, nearest 5, wins.
    fewest = most_frequent_crossing(islands)
    assert islands.crossing_every == round(math.sqrt(fewest * 15)) and fewest < islands.crossing_every < 15
    assert inter_island_reduction(replace(islands, crossing_every=fewest)) >= BYTES_GOAL
    assert fewest == 1 or inter_island_reduction(replace(islands, crossing_every=fewest - 1)) < BYTES_GOAL
    assert replace(islands, crossing_every=fewest).name in results
    assert (single.outer_lr, single.outer_optimizer, single.outer_momentum, single.batch) == (1.0, None, None, None)
    assert {r["arm"] for r in results.values()} >= {"islands-lr0.003-averaging-outer1.4-m0.75-s0",
                                                   "c-lr0.003-outer1-m0.75-s0", "c-lr0.003-outer1-m0-s0"}
    assert chosen.stable == {"standard": False, "single": False, "islands": True}
    assert all(r["stable"] == (r["kind"] == "islands") for r in results.values() if r["seed"] != 0)
    assert {r["seed"] for r in results.values() if r["kind"] == "islands"} == set(SEEDS)
    # The bytes goal spent as int8 at its most frequent crossing within the goal, no more often than the
    # swept interval; the headline's islands on every seed at that.
    int8 = replace(islands, compression="int8", stable=True)
    assert chosen.spending == ("int8", max(islands.crossing_every, most_frequent_crossing(int8)))
    assert all(chosen.chosen("islands", seed).name in results for seed in SEEDS)
    assert inter_island_reduction(chosen.chosen("islands", 0)) >= BYTES_GOAL
    fp32 = replace(islands, compression="fp32", stable=True)
    fp32 = replace(fp32, crossing_every=max(islands.crossing_every, most_frequent_crossing(fp32)))
    assert fp32.name in results and fp32.spec().sync.transport.compression == "none"
    assert fp32.crossing_every > chosen.spending[1] and inter_island_reduction(fp32) >= BYTES_GOAL
    # In the order they ran: the headline's seeds before (c), the diagnostics (of the swept arm) after it.
    kinds = [(r["kind"], any(r["arm"].endswith(f"-{d}-s0") for d in DIAGNOSTICS)) for r in results.values()]
    single = kinds.index(("single", False))
    assert all(i < single for i, (kind, diagnostic) in enumerate(kinds[:-len(SEEDS)]) if kind in ("standard", "islands") and not diagnostic)
    assert all(i > single for i, (_, diagnostic) in enumerate(kinds) if diagnostic)
    diagnosed = [name for name in results if any(name.endswith(f"-{d}-s0") for d in DIAGNOSTICS)]
    # Nesterov's control only where Shampoo was chosen (here plain averaging was).
    assert len(diagnosed) == len(DIAGNOSTICS) - 1 and all(name.startswith("islands-") for name in diagnosed)
    table = summary(results)
    entry = table["evaluations"]["code"]
    assert set(entry) >= {"b", "c", "islands", "butterfly_today", "relative_to_b", "bootstrap_ci_to_b", "token_ratio_to_c"}
    assert len(entry["islands"]) == len(SEEDS) and table["tokens_per_active_parameter"] == TOKENS_PER_ACTIVE_PARAMETER
    assert set(table["diagnostics"]) == set(DIAGNOSTICS) - {"nesterov"}
    assert [s["compression"] for s in table["spending"]] == ["int4", "int8", "fp32"]
    assert min(table["spending"], key=lambda s: s["validation"])["inter_island_every"] == chosen.spending[1]
    # The gap taken apart: (b)'s best to standard training at the islands' batch (24) to the islands, and
    # through (c) where standard training ran at (c)'s batch (the recipe's 48).
    steps = {(s["from_arm"], s["to_arm"]): s["change"] for s in table["gap_steps"]}
    best_b, islands_arm = f"b-b{best_batch}-lr{chosen.b[1]:g}-s0", chosen.islands.name
    b24 = min((r for r in results.values() if r["kind"] == "standard" and r["global_batch"] == 24 and r["seed"] == 0
               and not r["stable"] and r["tokens_factor"] == 1), key=lambda r: r["validation_bpb"]["code"])["arm"]
    assert ((best_b, b24) in steps) == (best_batch != 24)  # no step where (b) already trains at 24
    assert (b24, islands_arm) in steps and (chosen.c.name, islands_arm) in steps
    score = {r["arm"]: r["validation_bpb"]["code"] for r in results.values()}
    assert all(change == pytest.approx(score[to] / score[start] - 1) for (start, to), change in steps.items())
    assert [c["seed"] for c in table["communication"]["counted"]] == list(SEEDS)
    figure(results, chosen, tmp_path / "sweeps.png")
    assert (tmp_path / "sweeps.png").stat().st_size > 10_000
    worth = 1 / statistics.fmean(entry["token_ratio_to_c"])
    assert f"(c)'s bpb is worth {worth:.2f}x the islands' on code" in page(table, results)
    # (b) on LONGER_B times the tokens ran last, on every seed, outside the sweep; the token ratio reads it too.
    longer = [r["arm"] for r in list(results.values())[-len(SEEDS):]]
    assert longer == [replace(chosen.chosen("standard", seed), tokens_factor=LONGER_B).name for seed in SEEDS]
    assert entry["token_ratio_b_runs"] == [[1, LONGER_B]] * len(SEEDS)
    assert f"seeds {', '.join(map(str, SEEDS))}: (b) at 1x and {LONGER_B}x the tokens" in page(table, results)


def test_an_islands_batch_that_does_not_divide_into_whole_rows_and_steps_is_refused_by_name():
    with pytest.raises(ValueError, match="global batch 36: island east would take 3 rows and 5.33333 inner steps"):
        HonestArm("islands", 0, batch=36).spec()


def test_tokens_to_reach_interpolates_in_log_tokens_and_extrapolates_past_the_last_point():
    curve = [{"tokens": 100, "bpb": {"e": 4.0}}, {"tokens": 10_000, "bpb": {"e": 3.0}}, {"tokens": 1_000_000, "bpb": {"e": 2.0}}]
    assert tokens_to_reach(curve, "e", 3.5) == (pytest.approx(1_000), False)
    assert tokens_to_reach(curve, "e", 5.0) == (pytest.approx(100), False)
    assert tokens_to_reach(curve, "e", 1.5) == (pytest.approx(10_000_000), True)


def test_the_fewest_tokens_are_read_off_a_curve_that_reaches_the_bpb_before_any_line_past_one():
    short = [{"tokens": 100, "bpb": {"e": 4.0}}, {"tokens": 1_000, "bpb": {"e": 3.0}}, {"tokens": 10_000, "bpb": {"e": 2.5}}]
    longer = [{"tokens": 1_000, "bpb": {"e": 4.0}}, {"tokens": 100_000, "bpb": {"e": 2.0}}]
    assert fewest_tokens([short, longer], "e", 3.5) == (pytest.approx(math.sqrt(1e5)), False)
    # The short run's line would reach 2.2 sooner, but only the longer run reached it.
    assert fewest_tokens([short, longer], "e", 2.2) == (pytest.approx(10 ** 4.8), False)
    assert fewest_tokens([short], "e", 2.2)[1] is True


def test_the_most_frequent_crossing_is_the_last_interval_within_the_bytes_goal():
    recipe = HonestArm("islands", 0)
    fewest = most_frequent_crossing(recipe)
    assert 1 < fewest < recipe.spec().sync.inter_island_every
    assert inter_island_reduction(replace(recipe, crossing_every=fewest)) >= BYTES_GOAL
    assert inter_island_reduction(replace(recipe, crossing_every=fewest - 1)) < BYTES_GOAL
