"""The quality benchmark's plan: equal tokens between every arm, and sweeps that stop only at an interior
best (no training: finished arms are stood in for by their validation scores)."""

import pytest

from benchmarks.arms import SEEDS, interior_sweep
from benchmarks.results_page import write_results_page
from experiments.quality.campaign import FAMILIES, FIRST_LEARNING_RATES, ISLANDS_GLOBAL_BATCH, Arm, plan
from infra.spec import load_spec
from training.model.registry import build_model


def total_rows(arm) -> int:
    spec = arm.spec()
    if arm.kind == "standard":
        from training.baseline import BaselinePlan
        baseline = BaselinePlan.of(spec)
        return sum(baseline.planned_rows)
    return sum(slot.rows_per_round * spec.sync.rounds for slot in spec.learners)


def test_every_kind_of_arm_trains_the_same_tokens_with_the_same_active_model():
    arms = [Arm("standard", 0, lr=5e-3, batch=b) for b in (12, 24, 48, 96)]
    arms += [Arm(kind, seed, family) for kind in ("islands", "single") for family in FAMILIES for seed in SEEDS]
    assert len({total_rows(arm) for arm in arms}) == 1
    assert len({build_model(arm.spec()).parameter_counts()["active"] for arm in arms}) == 1
    single = Arm("single", 0, "allreduce-h6").spec()
    assert len(single.learners) == 1 and single.islands[0].inner_steps == FAMILIES["allreduce-h6"].east_steps
    assert single.sync.rounds == Arm("islands", 0, "allreduce-h6").spec().sync.rounds


def finished(arms, score) -> dict:
    return {a.name: {"kind": a.kind, "seed": a.seed, "lr": a.lr, "global_batch": a.batch,
                     "validation_bpb": {"code": score(a), "prose": score(a)}} for a in arms}


def run_plan_to_the_end(score) -> tuple[dict, object]:
    results = {}
    for _ in range(200):
        chosen = plan(results)
        if not chosen.todo:
            return results, chosen
        results.update(finished(chosen.todo[:1], score))
    raise AssertionError("the plan never ends")


def test_the_sweep_extends_past_an_edge_until_the_best_learning_rate_is_interior():
    best_lr = {12: 1e-3, 24: 5e-3, 48: 6e-2, 96: 1e-2}  # 48's optimum lies beyond the first grid

    def score(arm):  # validation bpb: a parabola in log lr, lowest at the batch's best lr; batch 24 best
        from math import log
        return 2 + (log(arm.lr) - log(best_lr[arm.batch])) ** 2 + (0 if arm.batch == 24 else 0.5) \
            if arm.kind == "standard" else 2.5

    results, chosen = run_plan_to_the_end(score)
    swept = sorted(r["lr"] for r in results.values() if r["global_batch"] == ISLANDS_GLOBAL_BATCH and r["seed"] == 0)
    assert swept[:len(FIRST_LEARNING_RATES)] == sorted(FIRST_LEARNING_RATES)
    assert swept[0] < chosen.lr_a < swept[-1] and chosen.lr_a == 8e-2
    assert chosen.best_b[0] == 24
    for seed in SEEDS:
        for kind in ("islands", "single"):
            for family in FAMILIES:
                assert Arm(kind, seed, family).name in results
        assert Arm("standard", seed, lr=chosen.lr_a, batch=ISLANDS_GLOBAL_BATCH).name in results
        assert Arm("standard", seed, lr=chosen.best_b[1], batch=24).name in results


def test_the_headline_arms_come_before_the_batch_sweeps():
    order = []
    results = {}
    for _ in range(200):
        todo = plan(results).todo
        if not todo:
            break
        order.append(todo[0])
        results.update(finished(todo[:1], lambda a: 2 + abs(a.lr - 5e-3) if a.kind == "standard" else 2.0))
    kinds = [(a.kind, a.batch) for a in order]
    first_other_batch = next(i for i, (kind, batch) in enumerate(kinds) if kind == "standard" and batch != 48)
    assert {k for k, _ in kinds[:first_other_batch]} == {"standard", "islands", "single"}


@pytest.mark.parametrize("field", ["lr", "global_batch"])
def test_a_standard_arm_sets_the_baseline_it_is_named_for(field):
    spec = Arm("standard", 1, lr=7e-3, batch=24).spec()
    assert spec.baseline.lr == 7e-3 and spec.baseline.global_batch == 24
    assert spec.seed == 1


def test_the_results_page_is_written_whole_with_what_its_result_files_record(tmp_path):
    (tmp_path / "quality.md").write_text("an older page\n")
    page = write_results_page("quality", "# Quality\n\nintro\n\n## a family\n\n| x |\n", pages=tmp_path,
                              sources="experiments/quality/results/quality", command="python -m experiments.quality --table")
    assert page.read_text() == (
        "# Quality\n\nMeasured at a commit not recorded, on a date not recorded. Result files: "
        "[`experiments/quality/results/quality`](../../experiments/quality/results/quality). Written by `python -m experiments.quality --table` from "
        "them; rerun it rather than editing this page.\n\nintro\n\n## a family\n\n| x |\n")
    page = write_results_page("quality", "# Quality\n", pages=tmp_path, sources="experiments/quality/results/quality",
                              command="python -m experiments.quality --table", commit="0123abc", date="2026-12-05")
    assert "Measured at commit 0123abc on 2026-12-05." in page.read_text()


def test_the_quality_config_is_the_benchmark_s_butterfly_arm():
    """`archipelago prepare configs/quality.yaml` must show the split the benchmark's arms use."""
    config = load_spec("configs/quality.yaml")
    arm = Arm("islands", 0).spec()
    assert config.data == arm.data and config.islands == arm.islands and config.model == arm.model
    assert config.sync == arm.sync


@pytest.mark.parametrize("bounds, ends", [((12, 96), 12), ((0, float("inf")), 6)])
def test_a_sweep_grows_past_a_winning_edge_only_within_its_bounds(bounds, ends):
    """Smaller is always better here: the sweep halves until its bound, where the edge is the answer."""
    results, arm_at = {}, lambda value: type("Arm", (), {"name": f"at-{value:g}"})
    while True:
        todo, best = interior_sweep(results, arm_at, (24, 48, 96), bounds=bounds, limit=5)
        if not todo:
            break
        for arm in todo:
            value = float(arm.name[3:])
            results[arm.name] = {"validation_bpb": {"e": value}}
    assert best == ends and min(float(name[3:]) for name in results) == ends
