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

    .venv/bin/python -m experiments.quality            # everything, resuming
    .venv/bin/python -m experiments.quality --table    # only rebuild the tables
    .venv/bin/python -m experiments.quality --plan     # the arms still to run, without running them
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.arms import (SEEDS, SWEEP_SEED, interior_sweep, nice, per_seed, run_arm, seeds_bootstrap, spread,
                             validation_score)
from benchmarks.harness import Log, load_arms, resumable_main, run_arms
from benchmarks.results_page import recorded, write_results_page
from infra.spec import RunSpec, parse_spec

RESULTS = Path("experiments/quality/results/quality")
# Every learner of the east island trains this many inner steps over the run, whatever the round length.
EAST_STEPS = 600
ISLANDS_GLOBAL_BATCH = 48  # 2 x 8 (east) + 2 x 16 (west) rows
BATCH_FACTORS = (0.25, 0.5, 1, 2)
FIRST_LEARNING_RATES = (2.5e-3, 5e-3, 1e-2, 2e-2)  # (a)'s sweep; extended by factors of 2 past an edge

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

def sweep(results: dict[str, dict], batch: int, start: tuple[float, ...]) -> tuple[list[Arm], float | None]:
    """The learning-rate sweep of standard training at `batch` on seed 0: the arms still to run, and the
    best learning rate once the best of the finished grid is interior (or the grid is at its limit)."""
    return interior_sweep(results, lambda lr: Arm("standard", SWEEP_SEED, lr=lr, batch=batch), start)


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

def load_results() -> dict[str, dict]:
    return load_arms(RESULTS)


def run_all(log: Log) -> None:
    run_arms(RESULTS, lambda finished: plan(finished).todo, lambda arm, finished: run_arm(arm, log),
             lambda: write_tables(log), log)


# -- the tables ----------------------------------------------------------------------------------------

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
    lines += ["", "Tuning: [quality-tuning.md](quality-tuning.md). Reproduce: `.venv/bin/python -m experiments.quality` (resumes arm by arm; "
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
    write_results_page("quality", markdown, sources="experiments/quality/results/quality", command="python -m experiments.quality --table",
                       **measured)
    write_results_page("quality-tuning", tuning_markdown(results), sources="experiments/quality/results/quality",
                       command="python -m experiments.quality --table", **measured)
    if log:
        log("pages written: docs/results/quality.md, docs/results/quality-tuning.md")


def main(argv: list[str] | None = None) -> int:
    return resumable_main(argv, __doc__.split("\n")[0], RESULTS, lambda finished: plan(finished).todo, run_all,
                          write_tables)

