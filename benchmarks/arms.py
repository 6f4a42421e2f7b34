"""What the quality experiments share: an arm trained through the product's own stages and scored in bits
per byte on the held-out and validation documents, the sweeps that choose settings on the validation split
only, the tables' statistics over seeds, and the spec edits that make an arm (overrides laid over a spec,
one learner in place of the islands).

An arm is any object with `name`, `kind` ("standard", "single", "islands" or another islands kind), `seed`,
`family`, `lr`, `batch` and `spec()`; each experiment defines its own."""

from __future__ import annotations

import copy
import math
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.harness import Log, new_run, train_islands
from benchmarks.results_page import provenance
from eval.bootstrap import paired_bootstrap
from eval.curve import standard_heldout_curve
from eval.evaluate import score_model
from eval.report import communication
from infra import layout
from training.baseline import BaselinePlan, train_baseline
from training.learner.ledger import read_summaries
from training.model.registry import build_model

SEEDS = (0, 1, 2)  # the seeds a chosen setting runs on
SWEEP_SEED = 0  # the one seed every sweep runs on
MAX_SWEEP_POINTS = 7  # a sweep's grid grows past a winning edge up to this many points


def validation_score(result: dict) -> float:
    """What the sweeps rank by: the mean of the validation bpb over the evaluations."""
    return statistics.mean(result["validation_bpb"].values())


def interior_sweep(results: dict[str, dict], arm_at, start: tuple[float, ...], step: float = 2.0,
                   limit: int = MAX_SWEEP_POINTS, bounds: tuple[float, float] = (0.0, math.inf)
                   ) -> tuple[list, float | None]:
    """A one-setting sweep ranked on the validation split: `arm_at(value)` is the arm at a value of the
    setting. Returns the arms still to run, and the best value once the best finished one is interior
    (the grid grows by a factor `step` past whichever edge wins, up to `limit` points, never past
    `bounds`: a winning edge there is the answer)."""
    grid = sorted(start)
    while True:
        arms = {value: arm_at(value) for value in grid}
        todo = [a for a in arms.values() if a.name not in results]
        if todo:
            return todo, None
        best = min(grid, key=lambda value: validation_score(results[arms[value].name]))
        if len(grid) >= limit or grid[0] < best < grid[-1] or \
                not bounds[0] <= (best / step if best == grid[0] else best * step) <= bounds[1]:
            return [], best
        grid = [grid[0] / step, *grid] if best == grid[0] else [*grid, grid[-1] * step]


def nice(lr: float) -> float:
    """Two significant figures, so arm names stay short and a rerun finds the same arms."""
    return float(f"{lr:.2g}")


def batch_and_rate_sweep(results: dict[str, dict], arm_at, first_batch: int, first_rates: tuple[float, ...],
                         limits: tuple[int, int]) -> tuple[list, tuple[int, float] | None]:
    """Standard training's batch and learning rate, swept until both optima are interior: the rate at
    `first_batch` from `first_rates`, then at each neighbouring batch from that rate scaled by the square
    root of the batch ratio (one factor of 2 either side), batches within `limits`, halved or doubled
    past a winning edge. `arm_at(batch, lr)` is the arm at a setting. Returns the arms still to run,
    and (batch, learning rate) once chosen."""
    def lr_sweep(batch: int, start: tuple[float, ...]):
        return interior_sweep(results, lambda lr: arm_at(batch, lr), start)

    todo, first = lr_sweep(first_batch, first_rates)
    if first is None:
        return todo, None
    batches = [b for b in (first_batch // 2, first_batch, first_batch * 2) if limits[0] <= b <= limits[1]]
    best = {first_batch: first}
    while True:
        todo = []
        for batch in batches:
            if batch not in best:
                centre = first * math.sqrt(batch / first_batch)
                arms, lr = lr_sweep(batch, tuple(nice(centre * k) for k in (0.5, 1, 2)))
                todo += arms
                if lr is not None:
                    best[batch] = lr
        if todo:
            return todo, None
        scores = {batch: validation_score(results[arm_at(batch, best[batch]).name]) for batch in batches}
        winner = min(scores, key=scores.get)
        if winner == batches[0] and batches[0] // 2 >= limits[0]:
            batches.insert(0, batches[0] // 2)
        elif winner == batches[-1] and batches[-1] * 2 <= limits[1]:
            batches.append(batches[-1] * 2)
        else:
            return [], (winner, best[winner])


def run_arm(arm, log: Log, curve: bool = False) -> dict:
    """Train and score one arm. `curve`: standard training's snapshots are scored on the held-out sets
    too (`heldout_curve`), for how many tokens it needs to reach a bpb."""
    spec = arm.spec()
    run_id, store, manifest = new_run(spec, arm.name.replace(".", "p"))
    started = time.monotonic()
    extra = {}
    if arm.kind == "standard":
        extra["baseline"] = train_baseline(spec, store, lambda p: log(
            f"  step {p['step']}/{p['steps']} loss {p['loss']:.3f} {p['tokens_per_s']:,} tok/s ETA {p['eta_s']:.0f} s")
            if p["step"] % 200 == 1 else None)
        key = layout.BASELINE
        if curve:
            extra["heldout_curve"] = standard_heldout_curve(spec, store)
    else:
        extra["consensus"] = train_islands(spec, run_id, log)
        # The learners' own byte counters, against a per-step fp32 all-reduce over the same learners.
        counted = communication(spec, read_summaries(spec, store), build_model(spec).parameter_counts()["total"],
                                BaselinePlan.of(spec).steps)
        extra["communication"] = {k: counted[k] for k in ("inter_island_bytes", "intra_island_bytes",
                                                          "allreduce_equivalent_bytes", "inter_island_reduction")}
        key = layout.CONSOLIDATED
    train_seconds = time.monotonic() - started
    scores = score_model(spec, store, key, ("heldout", "validation"))
    result = {**provenance(), "arm": arm.name, "kind": arm.kind, "seed": arm.seed, "family": arm.family if arm.kind != "standard" else None,
              "lr": arm.lr, "global_batch": arm.batch, "tokens": scores["tokens"],
              "bpb": {name: r["bpb"] for name, r in scores["heldout"].items()},
              "validation_bpb": {name: r["bpb"] for name, r in scores["validation"].items()},
              "heldout_documents": {name: {"ids": manifest["heldout"][name]["document_ids"],
                                           "bits": r["document_bits"], "bytes": r["document_bytes"]}
                                    for name, r in scores["heldout"].items()},
              "train_seconds": round(train_seconds, 1), "parameters": build_model(spec).parameter_counts(),
              "training": spec.training.model_dump(mode="json"), "sync": spec.sync.model_dump(mode="json"), **extra}
    # Checkpoints of every round are gigabytes; the arm's figures are what the experiment keeps.
    shutil.rmtree(Path(spec.store.url) / "runs" / run_id, ignore_errors=True)
    return result


def spread(values: list[float]) -> list[float]:
    """[mean, sd] (sd 0 for a single value)."""
    return [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def per_seed(results: dict[str, dict], arm_of) -> list[dict] | None:
    """The arm's result for each seed, or None while any seed is missing."""
    found = [results.get(arm_of(seed).name) for seed in SEEDS]
    return found if all(found) else None


def seeds_bootstrap(islands: list[dict], baseline: list[dict], evaluation: str) -> list[float]:
    """95% interval of the mean-over-seeds relative difference: the documents (the same for every seed
    and arm) are resampled, each document's bits summed over the seeds."""
    def summed(runs: list[dict]) -> list[float]:
        return [sum(bits) for bits in zip(*(r["heldout_documents"][evaluation]["bits"] for r in runs))]
    for run in islands + baseline:
        if run["heldout_documents"][evaluation]["ids"] != islands[0]["heldout_documents"][evaluation]["ids"]:
            raise ValueError(f"{run['arm']} was scored on other {evaluation} documents than {islands[0]['arm']}")
    difference = paired_bootstrap(summed(islands), summed(baseline), islands[0]["heldout_documents"][evaluation]["bytes"])
    return [difference.low, difference.high]


def merged(base, overrides):
    """`base` with `overrides` laid over it: mappings merged key by key, lists of named mappings (the
    islands) entry by entry by name; anything else replaced."""
    if isinstance(base, dict) and isinstance(overrides, dict):
        out = copy.deepcopy(base)
        for key, value in overrides.items():
            out[key] = merged(out[key], value) if key in out else value
        return out
    if isinstance(base, list) and isinstance(overrides, list) and all(isinstance(o, dict) and "name" in o for o in overrides):
        changes = {o["name"]: o for o in overrides}
        return [merged(entry, changes.get(entry.get("name"), {})) for entry in base]
    return copy.deepcopy(overrides)


def one_learner(raw: dict) -> dict:
    """(c) of a raw spec: the islands' rows per round on one learner at the east island's round length (as
    the quality experiment's single arms), the same tokens, schedule and optimizers, no peers (and no message
    compression: with no peers it would only add noise)."""
    raw = copy.deepcopy(raw)
    east = raw["islands"][0]
    rows_per_round = sum(i["learners"] * i["batch_size"] * i["inner_steps"] for i in raw["islands"])
    raw["islands"] = [{"name": "solo", "accelerator": "one learner (simulated on CPU)", "learners": 1,
                       "batch_size": rows_per_round // east["inner_steps"], "seq_len": east["seq_len"],
                       "inner_steps": east["inner_steps"]}]
    raw["sync"]["mode"] = "allreduce"
    raw["sync"].pop("inter_island_every", None)  # one learner: no islands to cross
    raw["sync"].setdefault("transport", {})["compression"] = "none"
    raw["sync"]["transport"]["tau"] = min(raw["sync"]["transport"].get("tau", 0), east["inner_steps"])
    return raw
