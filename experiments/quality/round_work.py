"""What cheaper round work costs in quality: configs/brief.yaml's recipe (8 learners, 2,457,600 tokens)
with its outer step's settings varied, scored on the validation split only.

A round's own work besides its inner steps is mostly the Shampoo outer step, and most of that is the
inverse roots (`training.exchange.outer`); `archipelago plan --profile-run` says how much. Each variant
here lays its overrides over configs/brief.yaml and trains through experiments/quality/campaign.py's `run_arm`, the
lifecycle's own stages. The recipe's own arm (`recipe`) is the reference: a variant is within the
issue's bound when its mean validation bpb over seeds 0, 1, 2 is within 0.5% of the recipe's.

Arms, in order: every variant on seed 0, then seeds 1 and 2 of the recipe and of each variant named
with `--seeds-of` (a variant worth them: within the bound on seed 0). Each arm holds the CPU lock
(`benchmarks.harness.CPU_LOCK`) while it trains and writes `arms/<arm>.json`, so a rerun resumes arm by
arm; progress with an ETA goes to `progress.log`; `summary.json` and
docs/results/round-work.md are rebuilt after every arm.

    .venv/bin/python -m experiments.quality.round_work                          # seed 0 of every variant
    .venv/bin/python -m experiments.quality.round_work --seeds-of roots-every-4  # and seeds 1, 2 of it and the recipe
    .venv/bin/python -m experiments.quality.round_work --table                  # only rebuild the page
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.arms import SEEDS, merged, run_arm
from benchmarks.harness import CPU_LOCK, Log, load_arms, run_arms
from benchmarks.results_page import recorded, write_results_page
from experiments.quality.brief import BriefArm
from infra.spec import RunSpec, parse_spec

RESULTS = Path("experiments/quality/results/round_work")
BOUND = 0.005  # the issue's: validation bpb within 0.5% of the recipe's, mean of 3 seeds

# name: (what it changes, overrides laid over configs/brief.yaml)
VARIANTS: dict[str, tuple[str, dict]] = {
    "recipe": ("configs/brief.yaml as it is", {}),
    "roots-every-4": ("Shampoo's inverse roots every 4th outer step",
                      {"sync": {"outer": {"shampoo": {"preconditioning_compute_steps": 4}}}}),
    "blocks-128": ("Shampoo blocks of 128 (its statistics split into 128 x 128 blocks)",
                   {"sync": {"outer": {"shampoo": {"block_size": 128}}}}),
    "nesterov": ("outer Nesterov SGD at the recipe's rate and momentum: Shampoo's direction dropped",
                 {"sync": {"outer": {"name": "nesterov"}}}),
}


@dataclass(frozen=True)
class VariantArm(BriefArm):
    """The brief's islands arm with a variant's overrides."""

    variant: str = "recipe"

    @property
    def name(self) -> str:
        return f"{self.variant}-s{self.seed}"

    def spec(self) -> RunSpec:
        return parse_spec(merged(self.raw(), VARIANTS[self.variant][1]))


def load_results() -> dict[str, dict]:
    return load_arms(RESULTS)


def planned(seeds_of: list[str]) -> list[VariantArm]:
    """Seed 0 of every variant; with `seeds_of`, seeds 1 and 2 of those variants and of the recipe."""
    arms = [VariantArm("islands", 0, variant=v) for v in VARIANTS]
    for variant in ["recipe", *seeds_of] if seeds_of else []:
        arms += [VariantArm("islands", seed, variant=variant) for seed in SEEDS[1:]]
    return list(dict.fromkeys(arms))


def run(seeds_of: list[str], log: Log) -> None:
    def train(arm: VariantArm, finished: dict[str, dict]) -> dict:
        log(f"{arm.name}: {VARIANTS[arm.variant][0]}")
        return {**run_arm(arm, log), "variant": arm.variant}

    run_arms(RESULTS, lambda finished: [arm for arm in planned(seeds_of) if arm.name not in finished], train,
             lambda: write_page(log), log, CPU_LOCK)


def summary(results: dict[str, dict]) -> dict:
    """Per variant: per-seed validation bpb, and where the recipe has the same seeds, the relative change of the means."""
    variants = {}
    for variant, (what, overrides) in VARIANTS.items():
        runs = sorted((r for r in results.values() if r.get("variant") == variant), key=lambda r: r["seed"])
        if not runs:
            continue
        seeds = [r["seed"] for r in runs]
        entry = {"what": what, "overrides": overrides, "seeds": seeds,
                 "validation_bpb": {e: [r["validation_bpb"][e] for r in runs] for e in runs[0]["validation_bpb"]},
                 "train_seconds": [r["train_seconds"] for r in runs]}
        reference = [results.get(f"recipe-s{seed}") for seed in seeds]
        if variant != "recipe" and all(reference):
            entry["relative_to_recipe"] = {
                e: statistics.fmean(values) / statistics.fmean(r["validation_bpb"][e] for r in reference) - 1
                for e, values in entry["validation_bpb"].items()}
            entry["within_bound"] = len(seeds) == len(SEEDS) and all(
                abs(v) <= BOUND for v in entry["relative_to_recipe"].values())
        variants[variant] = entry
    return {**recorded(list(results.values())), "bound": BOUND, "tokens": next(iter(results.values()))["tokens"],
            "variants": variants}


def page(table: dict) -> str:
    lines = ["# Cheaper round work: what it costs in quality",
             "",
             "configs/brief.yaml's recipe (8 learners, 2 islands) with its outer step's settings varied, "
             f"{table['tokens']:,} tokens, validation split only. A variant qualifies when the mean of seeds 0, 1, 2 "
             f"is within {BOUND:.1%} of the recipe's on both evaluations.",
             "",
             "| variant | what it changes | seeds | code | prose | code vs recipe | prose vs recipe | train s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, entry in table["variants"].items():
        bpb, rel = entry["validation_bpb"], entry.get("relative_to_recipe", {})
        lines.append(f"| {name} | {entry['what']} | {', '.join(map(str, entry['seeds']))} | "
                     f"{statistics.fmean(bpb['code']):.4f} | {statistics.fmean(bpb['prose']):.4f} | "
                     + " | ".join(f"{rel[e]:+.2%}" if e in rel else "-" for e in ("code", "prose"))
                     + f" | {statistics.fmean(entry['train_seconds']):.0f} |")
    return "\n".join(lines) + "\n"


def write_page(log: Log | None = None) -> None:
    results = load_results()
    if not results:
        return
    table = summary(results)
    (RESULTS / "summary.json").write_text(json.dumps(table, indent=1))
    write_results_page("round-work", page(table), sources=str(RESULTS), command="python -m experiments.quality.round_work --table",
                       commit=table["commit"], date=table["date"])
    if log:
        log(f"wrote {RESULTS / 'summary.json'} and docs/results/round-work.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds-of", nargs="*", default=[], choices=list(VARIANTS),
                        help="variants to run on seeds 1 and 2 as well (the recipe always is)")
    parser.add_argument("--table", action="store_true", help="only rebuild the summary and the page")
    args = parser.parse_args(argv)
    if args.table:
        write_page()
        return 0
    run(args.seeds_of, Log(RESULTS / "progress.log"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
