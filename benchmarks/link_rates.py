"""The shaped link's rate arithmetic: the link rate that keeps the brief's ratios, the rate per-step
all-reduce needs, the step it is calibrated from, and the planner's prediction for each arm."""

from __future__ import annotations

import json
import math
import statistics
import time

from benchmarks.link_sites import dp_threads
from benchmarks.netns import log

BRIEF_PARAMETERS = 32e9
BRIEF_LINK_BPS = 25e9
# Streaming DiLoCo: per-step data parallelism needs 100-300 Gbit/s for 95% compute utilisation.
BRIEF_DP_NEED_BPS = math.sqrt(100e9 * 300e9)
TARGET_UTILISATION = 0.95


def brief_scaled_rate_bps(parameters: int) -> float:
    """The link rate that keeps the brief's ratio of model size to bandwidth (32 B params : 25 Gbit/s)."""
    return parameters * BRIEF_LINK_BPS / BRIEF_PARAMETERS


def dp_need_bps(bytes_each_way_per_step: float, step_seconds: float,
                utilisation: float = TARGET_UTILISATION) -> float:
    """The rate at which a per-step all-reduce's transfer takes (1 - u) / u of a step's compute time,
    i.e. the slowest link on which data parallelism still reaches compute utilisation u."""
    if not 0 < utilisation < 1:
        raise ValueError(f"utilisation must be in (0, 1), got {utilisation}")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    return bytes_each_way_per_step * 8 / (step_seconds * (1 - utilisation) / utilisation)


def dp_matched_rate_bps(bytes_each_way_per_step: float, step_seconds: float) -> float:
    """The link rate that stands to our per-step all-reduce's need as 25 Gbit/s stands to the brief's."""
    return dp_need_bps(bytes_each_way_per_step, step_seconds) * BRIEF_LINK_BPS / BRIEF_DP_NEED_BPS


def calibrate_step_seconds(spec, repeats: int = 5) -> float:
    """Median seconds of one per-step all-reduce step's compute here, through standard training's own
    step (`training.baseline`: each shard's rows of the step backward, then the clipped optimizer step)
    on the island whose shards put the most rows in a step, with the threads each of its ranks gets.
    Its windows come from random bytes: a step's compute does not depend on its text, and the link's
    rate is set before any data is prepared."""
    import torch
    from training.baseline import BaselinePlan, accumulate_gradients, baseline_lr, baseline_optimizer
    from training.data.streams import WindowSampler
    from training.model.inner import optimizer_step
    from training.model.registry import build_model

    torch.set_num_threads(dp_threads(len(spec.islands)))
    model = build_model(spec)
    optimizer = baseline_optimizer(spec, model)
    plan = BaselinePlan.of(spec)
    rows = plan.step_rows(0)
    busiest = max(spec.islands, key=lambda island: sum(r for r, slot in zip(rows, plan.slots)
                                                       if slot.island.name == island.name))
    samplers = {slot.index: WindowSampler(torch.randint(0, 256, (64 * (slot.island.seq_len + 1),)), slot.island.seq_len,
                                          seed=slot.index)
                for slot in plan.slots if slot.island.name == busiest.name}
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        accumulate_gradients(model, plan, samplers, 0)
        optimizer_step(model, optimizer, baseline_lr(spec))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first step pays for allocation


def predict(spec, rate_bps: float, store: dict) -> dict:
    """The planner's figures for an islands arm, from a profiling run of its learners here, against
    `store` at local speed, before any run on the link (`training.planning.profile`)."""
    from training.planning.planner import plan_run
    from training.planning.profile import profile_run

    profile = profile_run(spec, store)
    planned = plan_run(spec, profile.step_seconds, rate_bps, profile.startup_s, profile.round_overhead_s,
                       profile.teardown_s)
    log(f"plan for {spec.name}: {json.dumps({k: planned[k] for k in ('utilisation', 'wall_s')})}, "
        f"profile {json.dumps(profile.to_json())}")
    return {"utilisation": planned["utilisation"], "wall_s": planned["wall_s"],
            "exchange_bytes": planned["exchange_bytes"]["inter"], "profile": profile.to_json(), "plan": planned}


def predict_standard(spec, rate_bps: float, step_seconds: float, islands_prediction: dict) -> dict:
    """The planner's figures for the per-step all-reduce arm: the step calibrated before the link went
    up, and the islands' profiled start-up and teardown (the same imports, spec and shards)."""
    from training.planning.planner import plan_data_parallel

    profile = islands_prediction["profile"]
    planned = plan_data_parallel(spec, step_seconds, rate_bps, profile["startup_s"], profile["teardown_s"])
    return {"utilisation": planned["utilisation"], "wall_s": planned["wall_s"],
            "exchange_bytes": planned["exchange_bytes"]["inter"], "plan": planned}
