"""Quality at equal tokens: the islands against the strongest standard training, over 3 seeds.

The comparison, per family of islands runs (the brief's sparse MoE on two heterogeneous islands):

- (a) standard training at the islands' global batch, its learning rate swept until the best is
  interior;
- (b) standard training at its own best global batch (x1/4, x1/2, x1, x2 of the islands'), each
  batch with its best learning rate from its own sweep;
- (c) one learner (M=1) with the family's inner optimizer, outer optimizer, round length and
  schedule: what the outer optimizer gives without any distribution;
- the islands run itself.

Every arm trains on the same documents and the same number of tokens, and is scored in bits per
byte on the same held-out documents (`data.split_seed` fixes them, whatever the seed), with the
bits kept per document for a paired bootstrap. Sweeps run on seed 0 and rank by the validation
split only; the held-out sets never choose anything. Each arm writes `arms/<arm>.json` when it
finishes, so a rerun resumes arm by arm; progress with an ETA goes to `progress.log`, and
`table.json` and the pages docs/results/quality.md and quality-tuning.md are rebuilt after every arm
from whatever has finished.

    .venv/bin/python -m bench.quality            # everything, resuming
    .venv/bin/python -m bench.quality --table    # only rebuild the tables
    .venv/bin/python -m bench.quality --plan     # the arms still to run, without running them
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


from bench.harness import Log, load_arms, new_run, resumable_main, run_arms, train_islands
from bench.results_page import provenance, recorded, write_results_page
from eval.bootstrap import paired_bootstrap
from eval.curve import standard_heldout_curve
from eval.evaluate import score_model
from eval.report import communication
from infra import layout
from infra.spec import RunSpec, parse_spec
from training.baseline import BaselinePlan, train_baseline
from training.learner.ledger import read_summaries
from training.model.registry import build_model

RESULTS = Path("bench/results/quality")
SEEDS = (0, 1, 2)
SWEEP_SEED = 0
# Every learner of the east island trains this many inner steps over the run, whatever the round length.
EAST_STEPS = 600
ISLANDS_GLOBAL_BATCH = 48  # 2 x 8 (east) + 2 x 16 (west) rows
BATCH_FACTORS = (0.25, 0.5, 1, 2)
FIRST_LEARNING_RATES = (2.5e-3, 5e-3, 1e-2, 2e-2)  # (a)'s sweep; extended by factors of 2 past an edge
MAX_SWEEP_POINTS = 7

# The islands' outer optimizer, chosen earlier on the validation split among Nesterov and Shampoo
# settings (lr {0.7, 1.0, 1.3} x momentum {0, 0.5, 0.8, 0.9}).
SHAMPOO = {"name": "shampoo", "lr": 1.0, "momentum": 0.5, "shampoo": {"graft": "sgd"}}
MOE = {"experts": 4, "top_k": 1, "balance_loss_weight": 0.01}


@dataclass(frozen=True)
class Family:
    """A kind of islands run: how the learners mix, and the east island's inner steps per round (the
    west island runs half as many on twice the batch, so both push the same tokens per round)."""

    title: str
    mode: str
    east_steps: int

    @property
    def rounds(self) -> int:
        return EAST_STEPS // self.east_steps


FAMILIES = {
    "butterfly": Family("sparse MoE, butterfly pairs, rounds of 20 / 10 inner steps", "butterfly", 20),
    "allreduce-h6": Family("sparse MoE, all-reduce, rounds of 6 / 3 inner steps", "allreduce", 6),
}


def base_spec(seed: int, family: Family) -> dict:
    """Two heterogeneous islands, four learners, a 4-expert top-1 MoE of 0.5 M active parameters.

    The held-out sets are at least 500 KB each (the code set at least 50 files) and the validation
    sets at least 200 KB; `prepare` prints what a split holds.
    """
    return {
        "name": "quality",
        "seed": seed,
        "islands": [
            {"name": "east", "accelerator": "GB300 (simulated on CPU)", "learners": 2, "batch_size": 8,
             "seq_len": 128, "inner_steps": family.east_steps},
            {"name": "west", "accelerator": "B300 (simulated on CPU)", "learners": 2, "batch_size": 16,
             "seq_len": 128, "inner_steps": family.east_steps // 2},
        ],
        "model": {"layers": 2, "width": 128, "heads": 4, "moe": MOE},
        "data": {"corpora": [
            {"name": "prose", "source": "shakespeare", "eval_fraction": 0.2, "max_eval_bytes": 650_000,
             "validation_fraction": 0.1, "max_validation_bytes": 300_000},
            {"name": "code", "source": "python_stdlib", "max_documents": 1200, "eval_fraction": 0.1,
             "max_eval_bytes": 650_000, "validation_fraction": 0.05, "max_validation_bytes": 300_000},
        ]},
        "training": {"lr": 3e-3, "warmup_steps": 20},
        "sync": {"mode": family.mode, "rounds": family.rounds, "outer": SHAMPOO},
        "store": {"url": str(RESULTS / "store")},
    }


@dataclass(frozen=True)
class Arm:
    """One training run: `kind` is "standard", "single" (M=1) or "islands"."""

    kind: str
    seed: int
    family: str = "butterfly"  # standard training depends only on the data and tokens, which families share
    lr: float | None = None  # standard training's peak learning rate
    batch: int | None = None  # standard training's global batch

    @property
    def name(self) -> str:
        if self.kind == "standard":
            return f"standard-b{self.batch}-lr{self.lr:g}-s{self.seed}"
        return f"{self.kind}-{self.family}-s{self.seed}"

    def spec(self) -> RunSpec:
        family = FAMILIES[self.family]
        raw = base_spec(self.seed, family)
        if self.kind == "standard":
            raw["baseline"] = {"lr": self.lr, "global_batch": self.batch}
        elif self.kind == "single":
            # The islands' tokens per round on one learner, at the east island's round length.
            rows_per_round = sum(i["learners"] * i["batch_size"] * i["inner_steps"] for i in raw["islands"])
            raw["islands"] = [{"name": "solo", "accelerator": "one learner (simulated on CPU)", "learners": 1,
                               "batch_size": rows_per_round // family.east_steps, "seq_len": 128,
                               "inner_steps": family.east_steps}]
            raw["sync"]["mode"] = "allreduce"
        return parse_spec(raw)


# -- which arms to run, given what has finished ------------------------------------------------------

def validation_score(result: dict) -> float:
    """What the sweeps rank by: the mean of the validation bpb over the evaluations."""
    return statistics.mean(result["validation_bpb"].values())


def sweep(results: dict[str, dict], batch: int, start: tuple[float, ...]) -> tuple[list[Arm], float | None]:
    """The learning-rate sweep of standard training at `batch` on seed 0: the arms still to run, and the
    best learning rate once the best of the finished grid is interior (or the grid is at its limit)."""
    return interior_sweep(results, lambda lr: Arm("standard", SWEEP_SEED, lr=lr, batch=batch), start)


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


def batch_sweeps(results: dict[str, dict], lr_a: float) -> tuple[list[Arm], dict[int, float]]:
    """(b)'s sweeps: each batch other than the islands' starts from (a)'s best learning rate scaled by
    the square root of the batch ratio, one factor of 2 either side."""
    todo, best = [], {ISLANDS_GLOBAL_BATCH: lr_a}
    for factor in BATCH_FACTORS:
        batch = int(ISLANDS_GLOBAL_BATCH * factor)
        if batch == ISLANDS_GLOBAL_BATCH:
            continue
        centre = lr_a * math.sqrt(factor)
        arms, lr = sweep(results, batch, tuple(nice(centre * k) for k in (0.5, 1, 2)))
        todo += arms
        if lr is not None:
            best[batch] = lr
    return todo, best


@dataclass
class Plan:
    """The arms still to run in order, and the settings the finished sweeps chose."""

    todo: list[Arm] = field(default_factory=list)
    lr_a: float | None = None
    best_b: tuple[int, float] | None = None  # (global batch, learning rate)


def plan(results: dict[str, dict]) -> Plan:
    """The headline first: (a)'s sweep, then the islands and (a) on every seed, then (c), then (b)."""
    out = Plan()
    todo, out.lr_a = sweep(results, ISLANDS_GLOBAL_BATCH, FIRST_LEARNING_RATES)
    if out.lr_a is None:
        out.todo = todo
        return out
    out.todo += [Arm("islands", seed, family) for seed in SEEDS for family in FAMILIES]
    out.todo += [Arm("standard", seed, lr=out.lr_a, batch=ISLANDS_GLOBAL_BATCH) for seed in SEEDS]
    out.todo += [Arm("single", seed, family) for seed in SEEDS for family in FAMILIES]
    todo, best = batch_sweeps(results, out.lr_a)
    out.todo += todo
    if not todo:
        batch = min(best, key=lambda b: validation_score(results[Arm("standard", SWEEP_SEED, lr=best[b], batch=b).name]))
        out.best_b = batch, best[batch]
        out.todo += [Arm("standard", seed, lr=best[batch], batch=batch) for seed in SEEDS]
    out.todo = [arm for arm in dict.fromkeys(out.todo) if arm.name not in results]
    return out


# -- running an arm ----------------------------------------------------------------------------------

def run_arm(arm: Arm, log: Log, curve: bool = False) -> dict:
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
    # Checkpoints of every round are gigabytes; the arm's figures are what the benchmark keeps.
    shutil.rmtree(Path(spec.store.url) / "runs" / run_id, ignore_errors=True)
    return result


def load_results() -> dict[str, dict]:
    return load_arms(RESULTS)


def run_all(log: Log) -> None:
    run_arms(RESULTS, lambda finished: plan(finished).todo, lambda arm, finished: run_arm(arm, log),
             lambda: write_tables(log), log)


# -- the tables ----------------------------------------------------------------------------------------

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


def build_table(results: dict[str, dict]) -> dict:
    chosen = plan(results)
    table = {"seeds": list(SEEDS), "islands_global_batch": ISLANDS_GLOBAL_BATCH,
             "baseline_settings": {"a": {"global_batch": ISLANDS_GLOBAL_BATCH, "lr": chosen.lr_a},
                                   "b": chosen.best_b and {"global_batch": chosen.best_b[0], "lr": chosen.best_b[1]}},
             "families": {}, "still_to_run": [a.name for a in chosen.todo]}
    baselines = {}
    if chosen.lr_a is not None:
        baselines["a"] = per_seed(results, lambda s: Arm("standard", s, lr=chosen.lr_a, batch=ISLANDS_GLOBAL_BATCH))
    if chosen.best_b:
        baselines["b"] = per_seed(results, lambda s: Arm("standard", s, lr=chosen.best_b[1], batch=chosen.best_b[0]))
    for family_name, family in FAMILIES.items():
        islands = per_seed(results, lambda s: Arm("islands", s, family_name))
        single = per_seed(results, lambda s: Arm("single", s, family_name))
        arms = {"a": baselines.get("a"), "b": baselines.get("b"), "c": single}
        if islands is None:
            continue
        rows = {}
        for evaluation in islands[0]["bpb"]:
            row = {"baselines": {k: [r["bpb"][evaluation] for r in v] if v else None for k, v in arms.items()},
                   "islands": [r["bpb"][evaluation] for r in islands]}
            for k, runs in arms.items():
                if runs:
                    row[f"relative_to_{k}"] = [i / b - 1 for i, b in zip(row["islands"], row["baselines"][k])]
                    row[f"bootstrap_ci_to_{k}"] = seeds_bootstrap(islands, runs, evaluation)
            rows[evaluation] = row
        table["families"][family_name] = {"title": family.title, **rows}
    table["train_seconds"] = {name: r["train_seconds"] for name, r in results.items()}
    table["tokens"] = sorted({r["tokens"] for r in results.values()})
    return table


def relative_cell(row: dict, baseline: str) -> str:
    """Mean ± sd over seeds of the relative difference, then its 95% bootstrap interval over documents."""
    if f"relative_to_{baseline}" not in row:
        return "-"
    mean, sd = spread(row[f"relative_to_{baseline}"])
    low, high = row[f"bootstrap_ci_to_{baseline}"]
    return f"{100 * mean:+.2f}% ± {100 * sd:.2f} [{100 * low:+.2f}, {100 * high:+.2f}]"


def table_markdown(table: dict, results: dict[str, dict]) -> str:
    settings = table["baseline_settings"]
    b = settings["b"]
    lines = ["# Quality at equal tokens", "",
             "Bits per byte on the held-out documents, mean ± sd over seeds 0, 1, 2. Relative = islands / "
             "baseline − 1 per seed, mean ± sd (negative: islands better), then in brackets the 95% interval "
             "(in %) of a paired bootstrap over the held-out documents (10,000 resamples, bits summed over the "
             "seeds) of the mean's relative difference. Every arm trains " + " / ".join(f"{t:,}" for t in table["tokens"]) + " tokens.", "",
             f"- (a) standard training at the islands' global batch {ISLANDS_GLOBAL_BATCH}, learning rate "
             f"{settings['a']['lr']} (best of its sweep on the validation split)",
             "- (b) standard training at its best global batch: " +
             (f"{b['global_batch']}, learning rate {b['lr']}" if b else "sweep not finished"),
             "- (c) one learner (M=1) with the family's inner and outer optimizer, round length and schedule"]
    for family in table["families"].values():
        lines += ["", f"## {family['title']}", "",
                  "| evaluation | (a) | (b) | (c) | islands | islands vs (a) | vs (b) | vs (c) |",
                  "|---|---|---|---|---|---|---|---|"]
        for evaluation, row in family.items():
            if evaluation == "title":
                continue
            cells = [f"{m:.4f} ± {s:.4f}" if v else "-" for v in (*row["baselines"].values(), row["islands"])
                     for m, s in [spread(v) if v else (0, 0)]]
            lines.append(f"| {evaluation} | " + " | ".join(cells + [relative_cell(row, k) for k in "abc"]) + " |")
    documents = next(iter(results.values()), {}).get("heldout_documents", {})
    if documents:
        lines += ["", "Held-out sets: " + ", ".join(f"{name} {len(d['ids'])} documents, {sum(d['bytes']):,} bytes"
                                                     for name, d in documents.items()) + "."]
    if table["still_to_run"]:
        lines += ["", f"Not finished yet: {', '.join(table['still_to_run'])}."]
    lines += ["", "Tuning: [quality-tuning.md](quality-tuning.md). Reproduce: `.venv/bin/python -m bench.quality` (resumes arm by arm; "
                  "`--table` rebuilds this file)."]
    return "\n".join(lines) + "\n"


def tuning_markdown(results: dict[str, dict]) -> str:
    """Every sweep point of standard training (seed 0), by global batch, best validation first."""
    lines = ["# Standard training's sweeps (seed 0, ranked on the validation split only)", ""]
    sweeps: dict[int, list[dict]] = {}
    for r in results.values():
        if r["kind"] == "standard" and r["seed"] == SWEEP_SEED:
            sweeps.setdefault(r["global_batch"], []).append(r)
    evaluations = list(next(iter(results.values()))["validation_bpb"]) if results else []
    for batch, runs in sorted(sweeps.items()):
        lines += [f"## global batch {batch}", "", "| learning rate | " +
                  " | ".join(f"validation {k}" for k in evaluations) + " | mean |",
                  "|---|" + "---|" * (len(evaluations) + 1)]
        for r in sorted(runs, key=lambda r: r["lr"]):
            lines.append(f"| {r['lr']:g} | " + " | ".join(f"{r['validation_bpb'][k]:.4f}" for k in evaluations)
                         + f" | {validation_score(r):.4f} |")
        lines.append("")
    return "\n".join(lines)


def write_tables(log: Log | None = None) -> None:
    results = load_results()
    table = build_table(results)
    (RESULTS / "table.json").write_text(json.dumps(table, indent=1))
    markdown = table_markdown(table, results)
    measured = recorded(list(results.values()))
    write_results_page("quality", markdown, sources="bench/results/quality", command="python -m bench.quality --table",
                       **measured)
    write_results_page("quality-tuning", tuning_markdown(results), sources="bench/results/quality",
                       command="python -m bench.quality --table", **measured)
    if log:
        log("pages written: docs/results/quality.md, docs/results/quality-tuning.md")


def main(argv: list[str] | None = None) -> int:
    return resumable_main(argv, __doc__.split("\n")[0], RESULTS, lambda finished: plan(finished).todo, run_all,
                          write_tables)


if __name__ == "__main__":
    sys.exit(main())
