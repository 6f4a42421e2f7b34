"""The brief benchmark's arms: the same tokens, active model, data and global batch as experiments/quality/campaign.py's
arms (so its baselines (a) and (b) apply), and candidates that are configs/brief.yaml with overrides."""

from benchmarks.arms import merged
from experiments.quality import brief, campaign as quality
from training.baseline import BaselinePlan
from training.model.registry import build_model


def rows(spec) -> int:
    return sum(slot.rows_per_round * spec.sync.rounds for slot in spec.learners)


def test_every_brief_arm_matches_the_quality_baselines():
    standard = quality.Arm("standard", 0, lr=0.01, batch=quality.ISLANDS_GLOBAL_BATCH).spec()
    for arm in brief.all_arms():
        spec = arm.spec()
        assert rows(spec) == sum(BaselinePlan.of(standard).planned_rows)
        assert build_model(spec).parameter_counts() == build_model(standard).parameter_counts()
        assert spec.data == standard.data and spec.max_seq_len == standard.max_seq_len
        if arm.kind != "single":
            assert sum(s.island.batch_size for s in spec.learners) == quality.ISLANDS_GLOBAL_BATCH


def test_the_brief_config_has_the_brief_shape():
    spec = brief.BriefArm("islands", 0).spec()
    east, west = spec.islands
    assert len(spec.learners) == 8 and spec.sync.mode == "butterfly" and spec.model.moe
    assert east.accelerator != west.accelerator and east.batch_size != west.batch_size
    assert east.inner_steps != west.inner_steps and {east.processes_per_learner, west.processes_per_learner} == {1, 2}
    transport = spec.sync.transport
    assert transport.fragments > 1 and transport.tau > 0 and transport.compression in ("int8", "int4")
    assert transport.error_feedback and spec.sync.outer.name == "shampoo"


def test_the_single_learner_keeps_the_recipe_without_peers():
    islands, single = brief.BriefArm("islands", 1).spec(), brief.BriefArm("single", 1).spec()
    assert len(single.learners) == 1 and single.islands[0].inner_steps == islands.islands[0].inner_steps
    assert single.sync.outer == islands.sync.outer and single.training == islands.training
    assert single.sync.transport.fragments == islands.sync.transport.fragments


def test_candidates_override_only_what_they_name():
    base = {"islands": [{"name": "east", "learners": 4, "inner_steps": 20}, {"name": "west", "learners": 4}],
            "sync": {"rounds": 30, "outer": {"lr": 1.0, "momentum": 0.5}}}
    out = merged(base, {"islands": [{"name": "east", "inner_steps": 10}], "sync": {"outer": {"lr": 1.3}}})
    assert out["islands"] == [{"name": "east", "learners": 4, "inner_steps": 10}, {"name": "west", "learners": 4}]
    assert out["sync"] == {"rounds": 30, "outer": {"lr": 1.3, "momentum": 0.5}}
    assert base["islands"][0]["inner_steps"] == 20
