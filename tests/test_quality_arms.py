"""The quality benchmark's arm definitions: equal compute between every pair it compares (no training)."""

from bench.quality import ARMS, FAMILIES, SEEDS, moe_tuning_arms
from training.learner import build_model


def planned_tokens(arm) -> list[int]:
    spec = arm.spec()
    return [slot.tokens_per_round() * spec.sync.rounds for slot in spec.learners]


def active_parameters(arm) -> int:
    return build_model(arm.spec()).parameter_counts()["active"]


def test_every_arm_trains_each_shard_for_the_tokens_of_the_arm_it_is_measured_against():
    arms = {arm.name: arm for arm in [*ARMS, *moe_tuning_arms(list(SEEDS))]}
    compared = [arm for arm in arms.values() if arm.compare_to]
    assert len(compared) > 20
    for arm in compared:
        against = arms[arm.compare_to]
        assert planned_tokens(arm) == planned_tokens(against), (arm.name, against.name)
        assert arm.seed == against.seed, arm.name


def test_the_round_length_candidates_change_rounds_and_inner_steps_inversely():
    specs = {arm.name: arm.spec() for arm in moe_tuning_arms([0]) if arm.kind == "islands"}
    shapes = {name: (spec.sync.rounds, [i.inner_steps for i in spec.islands]) for name, spec in specs.items()}
    assert shapes["tune-moe-allreduce-rounds-30-s0"] == (30, [40, 20])
    assert shapes["tune-moe-allreduce-rounds-120-s0"] == (120, [10, 5])
    assert shapes["tune-moe-allreduce-rounds-200-s0"] == (200, [6, 3])


def test_every_family_pairs_arms_the_benchmark_runs_on_every_seed_with_the_same_active_model():
    names = {arm.name: arm for arm in ARMS}
    for standard, islands in FAMILIES.values():
        for seed in SEEDS:
            pair = names[f"{standard}-s{seed}"], names[f"{islands}-s{seed}"]
            assert pair[0].kind == "standard" and pair[1].kind == "islands"
            assert active_parameters(pair[0]) == active_parameters(pair[1])
