"""The gap to tuned standard training against model size, for M = 1, 2, 4, 8 learners.

Dense byte GPTs at three sizes (about 0.2 M, 0.44 M and 1 M parameters) train on configs/brief.yaml's
data for 20 tokens per parameter. At each size:

- standard training's global batch and learning rate are swept on the validation split until both
  optima are interior (`batch_and_rate_sweep`), from the next smaller size's optimum;
- DiLoCo runs with M learners on M one-learner islands, through the real learner path (learner
  processes exchanging through the store, exact means every round: `allreduce` mode), H = 30 inner
  steps, an outer Nesterov step (momentum 0.9), at standard training's chosen global batch (B / M rows
  per learner). Per M at the smallest size, the outer learning rate is swept at standard training's
  chosen rate, then the inner rate as a multiple of that. The larger sizes keep the outer rate
  (Charles et al. find the best outer rate does not move with size) and sweep the inner rate's
  multiple again, from the next smaller size's (M = 8 from M = 4's at the same size, which it matched
  at both smaller sizes): a multiple kept from 0.2 M put 1 M's M=2 at 7e-3, a rate at which standard
  training itself is 9.6% worse than at its chosen 3.5e-3.

The gap is an arm's held-out bpb over standard training's at its chosen settings, minus one; fitted per
M as a line in log10(parameters), beside the same fit of Charles et al.'s figures (35 M to 2.4 B,
C4, H = 30; `PUBLISHED`). One seed: the study is about the trend, the honest-regime benchmark
(experiments/honest/campaign.py) carries the 3-seed headline.

Each arm holds the CPU lock (`benchmarks.harness.CPU_LOCK`) while it trains and writes
`arms/<arm>.json`, so a rerun resumes arm by arm; progress with an ETA goes to `progress.log`; `summary.json`, `gap.png` and
docs/results/size-scaling.md are rebuilt after every arm.

    .venv/bin/python -m experiments.size_scaling            # everything still to run, resuming
    .venv/bin/python -m experiments.size_scaling --plan     # the arms known still to run
    .venv/bin/python -m experiments.size_scaling --table    # only rebuild the summary, figure and page
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from benchmarks.arms import SWEEP_SEED, batch_and_rate_sweep, interior_sweep, nice, run_arm, validation_score
from benchmarks.harness import CPU_LOCK, Log, load_arms, resumable_main, run_arms
from benchmarks.results_page import recorded, write_results_page
from infra.spec import RunSpec, parse_spec
from training.model.registry import build_model

RESULTS = Path("experiments/size_scaling/results")
DATA_CONFIG = Path("configs/brief.yaml")
SIZES = {"0.2M": {"layers": 2, "width": 80, "heads": 4},
         "0.44M": {"layers": 2, "width": 128, "heads": 4},
         "1M": {"layers": 5, "width": 128, "heads": 4}}
LEARNERS = (1, 2, 4, 8)
TOKENS_PER_PARAMETER = 20
SEQ_LEN = 128
INNER_STEPS = 30  # H, as Charles et al.'s table
# The rows every arm of a size trains: a whole number of rounds of REFERENCE_BATCH rows, in multiples
# of ROUND_MULTIPLE rounds, so that every global batch the sweep can choose divides it into whole rounds.
REFERENCE_BATCH = 16
ROUND_MULTIPLE = 8
FIRST_BATCH = 16
FIRST_LEARNING_RATES = (2.5e-3, 5e-3, 1e-2)
BATCH_LIMITS = (8, 128)  # at least one row per learner at M = 8
OUTER_MOMENTUM = 0.9
OUTER_LEARNING_RATES = (0.5, 0.7, 1.0)
INNER_FACTORS = (0.5, 1.0, 2.0)  # the learners' inner rate over standard training's chosen one
SEED = SWEEP_SEED
# Charles et al. ("Scaling Laws for DiLoCo", arXiv 2503.09799; C4, equal tokens, both sides tuned, H = 30):
# DiLoCo's evaluation loss relative to tuned data parallelism, by parameters and M.
PUBLISHED = {35e6: {1: -0.001, 2: 0.007, 4: 0.020, 8: 0.039},
             335e6: {1: -0.003, 2: 0.001, 4: 0.009, 8: 0.020},
             2.4e9: {1: -0.004, 2: -0.001, 4: 0.003, 8: 0.011}}


def data_spec() -> dict:
    raw = yaml.safe_load(DATA_CONFIG.read_text())
    # A checkpoint after the last round only: no learner is restarted here, and a round is short.
    return {"data": raw["data"], "training": {"warmup_steps": raw["training"]["warmup_steps"], "checkpoint_every": 100_000}}


@functools.cache
def parameters(size: str) -> int:
    return build_model(parse_spec(layout(size, 1, REFERENCE_BATCH, 1))).parameter_counts()["total"]


def reference_rounds(size: str) -> int:
    """Rounds of REFERENCE_BATCH rows x H steps that hold 20 tokens per parameter (rounded up to ROUND_MULTIPLE)."""
    rows = TOKENS_PER_PARAMETER * parameters(size) / SEQ_LEN
    return math.ceil(rows / (REFERENCE_BATCH * INNER_STEPS * ROUND_MULTIPLE)) * ROUND_MULTIPLE


def layout(size: str, learners: int, global_batch: int, rounds: int, seed: int = SEED) -> dict:
    """A raw spec: `learners` one-learner islands sharing `global_batch` rows per step, the size's model."""
    return {
        "name": f"size-{size.lower().replace('.', 'p')}",
        "seed": seed,
        "islands": [{"name": f"island-{i}", "accelerator": "CPU", "learners": 1, "batch_size": global_batch // learners,
                     "seq_len": SEQ_LEN, "inner_steps": INNER_STEPS} for i in range(learners)],
        "model": SIZES[size],
        **data_spec(),
        "sync": {"mode": "allreduce", "rounds": rounds, "partner_timeout_s": 600},
        "store": {"url": str(RESULTS / "store")},
    }


@dataclass(frozen=True)
class SizeArm:
    """One run. `kind`: "standard" (at `batch`, `lr`) or "islands" (M = `learners` at standard training's
    chosen `batch` and `lr`, outer learning rate `outer_lr`). Has the attributes run_arm reads."""

    kind: str
    size: str
    lr: float
    batch: int
    learners: int = 1
    outer_lr: float | None = None
    seed: int = SEED

    @property
    def family(self) -> str:
        return f"{self.size}-m{self.learners}"

    @property
    def name(self) -> str:
        if self.kind == "standard":
            return f"{self.size}-standard-b{self.batch}-lr{self.lr:g}"
        return f"{self.size}-m{self.learners}-b{self.batch}-lr{self.lr:g}-outer{self.outer_lr:g}"

    def raw(self) -> dict:
        rounds = reference_rounds(self.size)
        if self.kind == "standard":
            raw = layout(self.size, 1, REFERENCE_BATCH, rounds, self.seed)
            raw["baseline"] = {"lr": self.lr, "global_batch": self.batch}
            return raw
        raw = layout(self.size, self.learners, self.batch, rounds * REFERENCE_BATCH // self.batch, self.seed)
        raw["training"]["lr"] = self.lr
        raw["sync"]["outer"] = {"name": "nesterov", "lr": self.outer_lr, "momentum": OUTER_MOMENTUM}
        return raw

    def spec(self) -> RunSpec:
        return parse_spec(self.raw())


# -- which arms to run, given what has finished ------------------------------------------------------

@dataclass
class Plan:
    todo: list[SizeArm]
    standard: dict[str, tuple[int, float]]  # size: (global batch, learning rate), once chosen
    outer: dict[int, float]  # M: outer learning rate, once chosen at the smallest size
    # (size, M): the learners' inner rate over standard training's chosen one, once chosen at that size
    inner_factor: dict[tuple[str, int], float]

    def islands(self, size: str, learners: int, factor: float) -> SizeArm:
        """M learners at a size's standard batch and rate times `factor`, at M's outer rate."""
        batch, lr = self.standard[size]
        return SizeArm("islands", size, nice(lr * factor), batch, learners, self.outer[learners])

    def chosen(self, size: str, learners: int | None) -> SizeArm | None:
        """Standard training (learners None) or M learners at a size's chosen settings, once chosen."""
        if size not in self.standard:
            return None
        if learners is None:
            batch, lr = self.standard[size]
            return SizeArm("standard", size, lr, batch)
        factor = self.inner_factor.get((size, learners))
        return None if factor is None else self.islands(size, learners, factor)


def plan(results: dict[str, dict]) -> Plan:
    """Size by size from the smallest: standard training's sweeps, then each M (its outer rate, swept at
    the smallest size and kept at the larger ones, then its inner rate's factor, swept at every size)."""
    out = Plan([], {}, {}, {})
    smallest = next(iter(SIZES))
    first_batch, first_rates = FIRST_BATCH, FIRST_LEARNING_RATES
    previous = smallest
    for size in SIZES:
        todo, chosen = batch_and_rate_sweep(
            results, lambda batch, lr, size=size: SizeArm("standard", size, lr, batch),
            first_batch, first_rates, BATCH_LIMITS)
        out.todo += todo
        if chosen is None:
            break
        out.standard[size] = chosen
        batch, lr = chosen
        # The next size's sweep starts where this one ended: the sweep still runs until both optima are
        # interior, in fewer arms where the optimum moves little with size.
        first_batch, first_rates = batch, tuple(nice(lr * k) for k in (0.5, 1, 2))
        for m in LEARNERS:
            if size == smallest:
                todo, outer = interior_sweep(
                    results, lambda o, m=m: SizeArm("islands", size, lr, batch, m, o), OUTER_LEARNING_RATES, step=1.4)
                out.todo += todo
                if outer is None:
                    continue
                out.outer[m], factors = outer, INNER_FACTORS
            elif m == LEARNERS[-1]:
                # At both smaller sizes M = 8 chose M = 4's multiple; starting there at the larger sizes
                # spares the arms a start from the smaller size's multiple spends on the way down (at
                # 1 M, those at 1x and 0.5x, about 50 minutes each on 2 cores).
                if (fewer_learners := out.inner_factor.get((size, LEARNERS[-2]))) is None:
                    continue
                factors = (fewer_learners, fewer_learners * 2)
            elif (smaller_factor := out.inner_factor.get((previous, m))) is not None:
                # From the smaller size's multiple and half of it: rates that suit a model tend to fall with size.
                factors = (smaller_factor / 2, smaller_factor)
            else:
                continue
            todo, factor = interior_sweep(
                results, lambda k, m=m, size=size: out.islands(size, m, k), factors)
            out.todo += todo
            if factor is not None:
                out.inner_factor[(size, m)] = factor
        previous = size
    out.todo = [arm for arm in dict.fromkeys(out.todo) if arm.name not in results]
    return out


def run(log: Log) -> None:
    def train(arm: SizeArm, finished: dict[str, dict]) -> dict:
        return {**run_arm(arm, log), "kind": arm.kind, "size": arm.size, "learners": arm.learners,
                "outer_lr": arm.outer_lr}

    run_arms(RESULTS, lambda finished: plan(finished).todo, train, lambda: write_page(log), log, CPU_LOCK)


# -- the summary ---------------------------------------------------------------------------------------

def gap_fit(points: dict[float, float]) -> dict | None:
    """A line through (log10 parameters, gap); None with fewer than two sizes."""
    if len(points) < 2:
        return None
    slope, intercept = np.polyfit(np.log10(list(points)), list(points.values()), 1)
    return {"intercept": float(intercept), "slope_per_decade": float(slope)}


def summary(results: dict[str, dict]) -> dict:
    chosen = plan(results)
    out = {**recorded(list(results.values())), "tokens_per_parameter": TOKENS_PER_PARAMETER,
           "inner_steps": INNER_STEPS, "outer_momentum": OUTER_MOMENTUM,
           "outer_lr": {str(m): lr for m, lr in chosen.outer.items()}, "sizes": {}, "fits": {},
           "published": {"points": {f"{n:g}": {str(m): g for m, g in row.items()} for n, row in PUBLISHED.items()},
                         "fits": {str(m): gap_fit({n: row[m] for n, row in PUBLISHED.items()}) for m in LEARNERS}},
           "still_to_run": [a.name for a in chosen.todo]}
    for size in SIZES:
        standard = (arm := chosen.chosen(size, None)) and results.get(arm.name)
        if not standard:
            continue
        entry = {"parameters": standard["parameters"]["total"], "tokens": standard["tokens"],
                 "standard": {"global_batch": chosen.standard[size][0], "lr": chosen.standard[size][1],
                              "bpb": standard["bpb"]}, "learners": {}}
        for m in LEARNERS:
            islands = (arm := chosen.chosen(size, m)) and results.get(arm.name)
            if islands:
                gaps = {e: islands["bpb"][e] / standard["bpb"][e] - 1 for e in standard["bpb"]}
                entry["learners"][str(m)] = {"bpb": islands["bpb"], "gap": gaps, "mean_gap": statistics.fmean(gaps.values()),
                                             "lr": arm.lr, "inner_lr_factor": chosen.inner_factor[(size, m)]}
        out["sizes"][size] = entry
    for m in LEARNERS:
        out["fits"][str(m)] = gap_fit({s["parameters"]: s["learners"][str(m)]["mean_gap"]
                                       for s in out["sizes"].values() if str(m) in s["learners"]})
    return out


def figure(table: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, m in enumerate(LEARNERS):
        colour = f"C{i}"
        ours = {s["parameters"]: s["learners"][str(m)]["mean_gap"] for s in table["sizes"].values() if str(m) in s["learners"]}
        if ours:
            ax.plot(list(ours), [100 * g for g in ours.values()], "o-", color=colour, label=f"M={m}, here")
        theirs = {n: row[m] for n, row in PUBLISHED.items()}
        ax.plot(list(theirs), [100 * g for g in theirs.values()], "s--", color=colour, alpha=0.5,
                label=f"M={m}, Charles et al.")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("bpb (loss) over tuned standard training, %")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def page(table: dict, results: dict[str, dict]) -> str:
    lines = ["# The gap to tuned standard training against model size",
             "",
             f"Dense byte GPTs, {TOKENS_PER_PARAMETER} tokens per parameter, configs/brief.yaml's data; DiLoCo with "
             f"M one-learner islands (exact means every round, H = {INNER_STEPS}, outer Nesterov, momentum "
             f"{OUTER_MOMENTUM}) at standard training's chosen batch, their inner rate tuned per size and M, their "
             "outer rate per M, against "
             "standard training tuned on the validation split. Held-out bpb, mean over the evaluations, seed 0.",
             "",
             "![gap against size](../../experiments/size_scaling/results/gap.png)", "",
             "| size | parameters | tokens | standard (batch, lr) | " + " | ".join(f"M={m}" for m in LEARNERS) + " |",
             "|---|---|---|---|" + "---|" * len(LEARNERS)]
    for size, entry in table["sizes"].items():
        cells = [f"{entry['learners'][str(m)]['mean_gap']:+.2%} ({entry['learners'][str(m)]['inner_lr_factor']:g}x)"
                 if str(m) in entry["learners"] else "-" for m in LEARNERS]
        lines.append(f"| {size} | {entry['parameters']:,} | {entry['tokens']:,} | {entry['standard']['global_batch']}, "
                     f"{entry['standard']['lr']:g} | " + " | ".join(cells) + " |")
    for n, row in PUBLISHED.items():
        lines.append(f"| Charles et al. | {n:,.0f} | | | " + " | ".join(f"{row[m]:+.1%}" for m in LEARNERS) + " |")
    lines += ["", "Fits, gap = a + b log10(parameters):", "",
              "| M | here: a, b per decade | Charles et al.: a, b per decade |", "|---|---|---|"]
    for m in LEARNERS:
        ours, theirs = table["fits"][str(m)], table["published"]["fits"][str(m)]
        fmt = (lambda f: f"{f['intercept']:+.3f}, {f['slope_per_decade']:+.3f}" if f else "-")
        lines.append(f"| {m} | {fmt(ours)} | {fmt(theirs)} |")
    if table["outer_lr"]:
        lines += ["", "In brackets: the learners' inner rate over standard training's, swept per size. Outer learning "
                  "rate per M, chosen at the smallest size: " +
                  ", ".join(f"M={m}: {lr:g}" for m, lr in table["outer_lr"].items()) + "."]
    lines += ["", "## Arms (validation bpb, mean over evaluations)", "", "| arm | validation | held-out | train s |",
              "|---|---|---|---|"]
    for name, result in sorted(results.items()):
        lines.append(f"| {name} | {validation_score(result):.4f} | "
                     f"{statistics.fmean(result['bpb'].values()):.4f} | {result['train_seconds']:.0f} |")
    if table["still_to_run"]:
        lines += ["", f"Not run yet: {', '.join(table['still_to_run'])} (sweeps may add more)."]
    return "\n".join(lines) + "\n"


def write_page(log: Log | None = None) -> None:
    results = load_arms(RESULTS)
    table = summary(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(table, indent=1))
    figure(table, RESULTS / "gap.png")
    write_results_page("size-scaling", page(table, results), sources=str(RESULTS),
                       command="python -m experiments.size_scaling --table", commit=table["commit"], date=table["date"])
    if log:
        log(f"wrote {RESULTS / 'summary.json'}, gap.png and docs/results/size-scaling.md")


def main(argv: list[str] | None = None) -> int:
    return resumable_main(argv, __doc__.split("\n")[0], RESULTS, lambda finished: plan(finished).todo, run, write_page)

