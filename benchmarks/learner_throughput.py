"""The learner path's tokens per second against standard training's: same cores, model, data and tokens.

For each config, its learners train as `archipelago plan --profile-run` runs them, for at least
`--rounds` rounds and whole periods of the mode's island crossings (`profile_rounds`)
(`training.planning.profile`: every learner its own OS process, all started together on this machine's
cores, against a store in a local folder, everything of the round included: inner steps, exchange,
outer step, checkpoints); their tokens per second are the tokens of the rounds the profile times,
over the span of those rounds (`RunProfile.tokens_per_s`). Standard training
(`training.baseline.train_baseline`) then trains the same model on the same shards for the same
tokens, in one process with a thread per core, and reports its own tokens per second. Both hold the
benchmarks' CPU lock, one after the other. The profile also gives the plan's utilisation with no link
limit (`training.planning.planner.plan_run` on an unlimited link): how much of a learner's time its
inner steps take once the round's own work is counted.

The brief's configurations also run with one learner per island (`PER_CORE`), each island on a core of
its own: a learner with its own core, so its round's own work competes only with its inner steps.

    .venv/bin/python -m benchmarks.learner_throughput [--rounds 20] [CONFIG ...]

Writes benchmarks/results/learner_throughput.json and .md, stamped with the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import CPU_LOCK, cpu_lock
from benchmarks.results_page import provenance, write_results_page
from infra.spec import RunSpec, load_spec, parse_spec
from training.baseline import train_baseline
from training.data.shards import prepare_dataset
from training.stages import start_run
from training.planning.planner import plan_run
from training.planning.profile import profile_rounds, profile_run

CONFIGS = ("configs/demo.yaml", "configs/brief.yaml", "configs/brief-hierarchical.yaml")
PER_CORE = ("configs/brief.yaml", "configs/brief-hierarchical.yaml")  # also run with one learner per island
UNLIMITED_LINK_BPS = 1e18
RESULTS = Path("benchmarks/results/learner_throughput")
GOAL = 0.8  # the learner path at least 0.8x standard training's tokens per second


def with_rounds(spec: RunSpec, rounds: int) -> RunSpec:
    return spec.model_copy(update={"sync": spec.sync.model_copy(update={"rounds": rounds})})


def one_learner_per_island(spec: RunSpec) -> RunSpec:
    raw = spec.model_dump(mode="json")
    for island in raw["islands"]:
        island["learners"] = 1
    return parse_spec(raw)


def standard_tokens_per_s(spec: RunSpec) -> float:
    """Standard training of the spec's model on its shards and tokens, in this process, every core busy."""
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="archipelago-throughput-") as folder:
        spec = spec.model_copy(update={"store": spec.store.model_copy(update={"url": folder})})
        store = start_run(spec, "standard")
        prepare_dataset(spec, store)
        last: dict = {}
        train_baseline(spec, store, last.update)
    return last["tokens_per_s"]


def measure(config: str, at_least: int, per_core: bool = False) -> dict:
    spec = load_spec(config)
    if per_core:
        spec = one_learner_per_island(spec)
    rounds = profile_rounds(spec, at_least)
    spec = with_rounds(spec, rounds)
    with cpu_lock(CPU_LOCK):
        profile = profile_run(spec, at_least=at_least)
        standard = standard_tokens_per_s(spec)
    learners = sum(island.learners for island in spec.islands)
    unlimited = plan_run(spec, profile.step_seconds, UNLIMITED_LINK_BPS, profile.startup_s, profile.round_overhead_s,
                         profile.teardown_s)
    return {"config": config, "one_learner_per_island": per_core, "rounds": rounds, "learners": learners,
            "processes": sum(i.learners * i.processes_per_learner for i in spec.islands),
            "tokens": sum(slot.tokens_per_round() for slot in spec.learners) * rounds,
            "learner_path_tokens_per_s": profile.tokens_per_s, "standard_tokens_per_s": standard,
            "ratio": profile.tokens_per_s / standard, "round_parts_s": profile.round_parts_s,
            "round_overhead_s": profile.round_overhead_s, "step_seconds": profile.step_seconds,
            "utilisation_no_link_limit": unlimited["utilisation"]}


def name(run: dict) -> str:
    return run["config"] + (", one learner per island" if run["one_learner_per_island"] else "")


def markdown(results: dict) -> str:
    lines = [f"# Learner path against standard training, tokens per second ({results['cores']} cores)", "",
             "Same model, shards and tokens; the learners as `archipelago plan --profile-run` runs them "
             "(every round's own work included), standard training in one process on every core. "
             f"Goal: at least {GOAL}x.", "",
             "| config | rounds | learners (processes) | learner path tok/s | standard tok/s | ratio | "
             "utilisation, no link limit |", "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        lines.append(f"| {name(r)} | {r['rounds']} | {r['learners']} ({r['processes']}) | "
                     f"{r['learner_path_tokens_per_s']:,.0f} | {r['standard_tokens_per_s']:,.0f} | {r['ratio']:.2f}x | "
                     f"{r['utilisation_no_link_limit']:.1%} |")
    lines += ["", "A round's mean seconds per island (`training.planning.profile.ROUND_PARTS`):", ""]
    for r in results["runs"]:
        for island, parts in r["round_parts_s"].items():
            lines.append(f"- {name(r)}, {island}: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=20, help="at least this many rounds of each config")
    args = parser.parse_args(argv)
    measured = provenance()
    runs = []
    for config, per_core in [(c, False) for c in args.configs] + [(c, True) for c in args.configs if c in PER_CORE]:
        runs.append(measure(config, args.rounds, per_core))
        print(f"{name(runs[-1])}: learner path {runs[-1]['learner_path_tokens_per_s']:,.0f} tok/s, standard "
              f"{runs[-1]['standard_tokens_per_s']:,.0f} tok/s, ratio {runs[-1]['ratio']:.2f}x, utilisation with no "
              f"link limit {runs[-1]['utilisation_no_link_limit']:.1%}", flush=True)
    results = {**measured, "cores": os.cpu_count(), "goal": GOAL, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    write_results_page("learner-throughput", markdown(results), sources=str(RESULTS.with_suffix(".json")),
                       command="python -m benchmarks.learner_throughput", **measured)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
