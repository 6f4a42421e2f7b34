"""Quality at equal compute: standard training against the islands run, over seeds, with ablations.

Every arm is defined in `ARMS` below. An arm trains one model (the islands run: learners as real
OS processes exchanging through a local object store, then consolidation; or the standard
baseline) on the same data and token count as its counterpart, scores it in bits per byte on both
held-out evaluations and on the validation split, and writes `arms/<arm>.json` when it finishes.
A rerun skips finished arms, so the benchmark resumes arm by arm. Progress (with ETA) goes to
stdout and to `progress.log`; the table is rewritten after every arm, as `table.md` and
`table.json`, from whatever arms have finished.

    .venv/bin/python -m bench.quality                 # everything, main comparison first
    .venv/bin/python -m bench.quality --arms islands-s0 standard-s0
    .venv/bin/python -m bench.quality --table         # only rebuild the table
    .venv/bin/python -m bench.quality --tune outer    # outer-optimizer settings, scored on validation only
    .venv/bin/python -m bench.quality --tune moe --tune-seeds 0   # the MoE's round length, standard's lr

Tuning ranks candidates by the validation split's bpb; the held-out evaluations are never used to
choose settings. `--tune outer` runs shorter islands arms with candidate outer settings; `--tune moe`
runs the sparse MoE with all-reduce at other round lengths, and standard training at other learning
rates, at full length; the best of seed 0 then runs on seeds 1 and 2 (`--tune-seeds 1 2 --arms ...`).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.bpb import bits_per_byte
from eval.evaluate import load_model
from infra import layout
from infra.launch import LearnerFailed, LearnerProcess, run_learner
from infra.spec import RunSpec, parse_spec
from infra.store import run_store
from tasks.training import threads_per_process
from training.baseline import train_baseline
from training.consolidate import consolidate
from training.data import prepare_dataset, read_stream
from training.learner import build_model

RESULTS = Path("bench/results/quality")
SEEDS = (0, 1, 2)
ROUNDS = 60

# The outer optimizer of the main islands arm, chosen on the validation split (`--tune outer`, 8 rounds,
# seed 0; results in tuning.md): best of lr {1.0, 1.3} x momentum {0, 0.5, 0.8}.
SHAMPOO = {"name": "shampoo", "lr": 1.0, "momentum": 0.5, "shampoo": {"graft": "sgd"}}


def base_spec(seed: int, rounds: int = ROUNDS) -> dict:
    """Two heterogeneous islands (batch size, inner steps per round), four learners, 0.5 M parameters.

    Both islands push the same tokens per round (8 x 20 and 16 x 10 rows of 128 bytes), so neither
    waits for the other; the token-weighted mix would also cover unequal rounds.
    """
    return {
        "name": "quality",
        "seed": seed,
        "islands": [
            {"name": "east", "accelerator": "GB300 (simulated on CPU)", "learners": 2, "batch_size": 8,
             "seq_len": 128, "inner_steps": 20},
            {"name": "west", "accelerator": "B300 (simulated on CPU)", "learners": 2, "batch_size": 16,
             "seq_len": 128, "inner_steps": 10},
        ],
        "model": {"layers": 2, "width": 128, "heads": 4},
        "data": {"corpora": [
            {"name": "prose", "source": "shakespeare", "eval_fraction": 0.1, "max_eval_bytes": 150_000,
             "validation_fraction": 0.05, "max_validation_bytes": 100_000},
            {"name": "code", "source": "python_stdlib", "max_documents": 800, "eval_fraction": 0.1,
             "max_eval_bytes": 150_000, "validation_fraction": 0.05, "max_validation_bytes": 100_000},
        ]},
        "sync": {"mode": "butterfly", "rounds": rounds, "inner_lr": 3e-3, "warmup_steps": 20, "outer": SHAMPOO},
        "store": {"url": str(RESULTS / "store")},
    }


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "islands" or "standard"
    seed: int
    group: str  # "main", "ablation" or "tuning"
    changes: dict = field(default_factory=dict)  # deep-merged into base_spec(seed)
    compare_to: str | None = None  # the standard arm an ablation is measured against

    def spec(self) -> RunSpec:
        raw = base_spec(self.seed)
        merge(raw, self.changes)
        return parse_spec(raw)


def merge(into: dict, changes: dict) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "outer":
            merge(into[key], value)
        else:
            into[key] = value


def round_length(east_steps: int) -> dict:
    """Changes giving the base run rounds of `east_steps` inner steps (west: half as many on twice the
    batch), with the rounds derived so that every learner trains the base run's tokens."""
    islands = base_spec(0)["islands"]
    base_total = islands[0]["inner_steps"] * ROUNDS
    if east_steps % 2 or base_total % east_steps:
        raise ValueError(f"{east_steps} east inner steps: must be even and divide {base_total}")
    for island, steps in zip(islands, (east_steps, east_steps // 2)):
        island["inner_steps"] = steps
    return {"islands": islands, "sync": {"rounds": base_total // east_steps}}


MOE = {"model": {"moe": {"experts": 4, "top_k": 1, "balance_loss_weight": 0.01}}}
# Arms run for every seed, named `<prefix>-s<seed>`: prefix -> (changes, the prefix it is measured against).
MAIN_ARMS = {
    "standard": ({}, None),
    "islands": ({}, "standard"),
    "standard-moe": (MOE, "standard"),
    "islands-moe": (MOE, "standard-moe"),
    "islands-moe-allreduce": ({**MOE, "sync": {"mode": "allreduce"}}, "standard-moe"),
}
TUNED_FAMILY = ("sparse MoE, all-reduce, rounds of 6 / 3 inner steps; "
                "standard training at its best learning rate (5e-3)")
# The main comparison: family -> (standard arm prefix, islands arm prefix). The sparse MoE is the
# brief's model; its all-reduce arm was added after seed 0's validation bpb. The last family's arms
# are the MoE tuning study's (`--tune moe`): the candidates that were best on the validation split.
FAMILIES = {
    "dense model, butterfly": ("standard", "islands"),
    "sparse MoE, butterfly": ("standard-moe", "islands-moe"),
    "sparse MoE, all-reduce": ("standard-moe", "islands-moe-allreduce"),
    TUNED_FAMILY: ("tune-moe-standard-lr-5e-3", "tune-moe-allreduce-rounds-200"),
}
ARMS = [
    *(Arm(f"{prefix}-s{seed}", prefix.split("-")[0], seed, "main", changes,
          compare_to=against and f"{against}-s{seed}")
      for seed in SEEDS for prefix, (changes, against) in MAIN_ARMS.items()),
    # Ablations, seed 0, each changing one thing of islands-s0.
    Arm("islands-nesterov-s0", "islands", 0, "ablation",
        {"sync": {"outer": {**SHAMPOO, "name": "nesterov"}}}, compare_to="standard-s0"),
    Arm("islands-diloco-s0", "islands", 0, "ablation",
        {"sync": {"outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}}, compare_to="standard-s0"),
    Arm("islands-allreduce-s0", "islands", 0, "ablation", {"sync": {"mode": "allreduce"}}, compare_to="standard-s0"),
    # Whether shorter rounds (the MoE study's runner-up) also help butterfly pairs.
    Arm("islands-rounds-120-s0", "islands", 0, "ablation",
        round_length(10), compare_to="standard-s0"),
    Arm("islands-moe-rounds-120-s0", "islands", 0, "ablation",
        {**MOE, **round_length(10)}, compare_to="standard-moe-s0"),
]
ABLATION_NOTES = {
    "islands-s0": "main islands arm, seed 0",
    "islands-nesterov-s0": "Nesterov outer with the Shampoo arm's lr and momentum (no preconditioning)",
    "islands-diloco-s0": "DiLoCo's outer Nesterov, lr 0.7, momentum 0.9",
    "islands-allreduce-s0": "all-reduce of pseudo-gradients instead of butterfly pairs",
    "islands-rounds-120-s0": "rounds of 10 / 5 inner steps instead of 20 / 10 (120 rounds, equal tokens)",
    "islands-moe-rounds-120-s0": "sparse MoE, butterfly, rounds of 10 / 5 inner steps (120 rounds, equal tokens)",
    "islands-moe-allreduce-s0": "sparse MoE with all-reduce of pseudo-gradients instead of butterfly pairs",
    "standard-moe-s0": "standard training of the sparse MoE (4 experts, top-1) against the dense model: "
                       "equal active parameters",
    "islands-moe-s0": "sparse MoE feed-forward (4 experts, top-1), against standard training of the same MoE",
}


def tuning_arms(rounds: int) -> list[Arm]:
    """Candidate outer settings, seed 0, fewer rounds; ranked on the validation split only."""
    candidates = {
        "avg": {"name": "nesterov", "lr": 1.0, "momentum": 0.0},
        "nesterov-1.0-0.5": {"name": "nesterov", "lr": 1.0, "momentum": 0.5},
        "nesterov-0.7-0.9": {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
        "shampoo-sgd-1.0-0": {"name": "shampoo", "lr": 1.0, "momentum": 0.0, "shampoo": {"graft": "sgd"}},
        "shampoo-sgd-1.0-0.5": {"name": "shampoo", "lr": 1.0, "momentum": 0.5, "shampoo": {"graft": "sgd"}},
        "shampoo-sgd-1.3-0": {"name": "shampoo", "lr": 1.3, "momentum": 0.0, "shampoo": {"graft": "sgd"}},
        "shampoo-sgd-1.3-0.5": {"name": "shampoo", "lr": 1.3, "momentum": 0.5, "shampoo": {"graft": "sgd"}},
        "shampoo-sgd-1.0-0.8": {"name": "shampoo", "lr": 1.0, "momentum": 0.8, "shampoo": {"graft": "sgd"}},
    }
    arms = [Arm(f"tune-{rounds}r-standard", "standard", 0, "tuning", {"sync": {"rounds": rounds}})]
    arms += [Arm(f"tune-{rounds}r-{name}", "islands", 0, "tuning", {"sync": {"rounds": rounds, "outer": outer}},
                 compare_to=f"tune-{rounds}r-standard") for name, outer in candidates.items()]
    return arms


def moe_tuning_arms(seeds: list[int]) -> list[Arm]:
    """The sparse MoE with all-reduce at equal tokens, ranked on the validation split: the round
    length (H, with the rounds changed by the inverse factor), and, so that standard training is
    not held to a learning rate that suits only the islands, standard training's own learning rate."""
    candidates = {
        "rounds-30": round_length(40),
        "rounds-120": round_length(10),
        "rounds-200": round_length(6),
    }
    standard_learning_rates = {"lr-5e-3": 5e-3, "lr-8e-3": 8e-3}
    arms = []
    for seed in seeds:
        arms += [Arm(f"tune-moe-standard-{name}-s{seed}", "standard", seed, "tuning",
                     {**MOE, "sync": {"inner_lr": lr}}, compare_to=f"standard-moe-s{seed}")
                 for name, lr in standard_learning_rates.items()]
        for name, candidate in candidates.items():
            changes = copy.deepcopy(MAIN_ARMS["islands-moe-allreduce"][0])
            merge(changes, candidate)
            arms.append(Arm(f"tune-moe-allreduce-{name}-s{seed}", "islands", seed, "tuning", changes,
                            compare_to=f"standard-moe-s{seed}"))
    return arms


# The tuned family's two arms run with the main comparison, on every seed (into tuning/).
ARMS += [arm for arm in moe_tuning_arms(list(SEEDS)) if arm.name.rsplit("-s", 1)[0] in FAMILIES[TUNED_FAMILY]]


# -- running an arm --------------------------------------------------------------------------------

class Log:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def train_islands(spec: RunSpec, run_id: str, log: Log, restarts: int = 0) -> dict:
    """Every learner as its own OS process (as the lifecycle runs them), then consolidation. A
    learner that dies is started again up to `restarts` times, a second later, as the lifecycle's
    `train-learner` task retries it."""
    threads = threads_per_process(spec)

    def train(slot) -> None:
        for attempt in range(restarts + 1):
            try:
                return run_learner(LearnerProcess(slot.index, slot.island.processes_per_learner, threads),
                                   spec.store.url, None, run_id, relay)
            except LearnerFailed as err:
                if attempt == restarts:
                    raise
                log(f"  learner {slot.index} died ({str(err).splitlines()[0]}); restarting")
                time.sleep(1)

    def relay(line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if event.get("event") == "round" and event["learner"] == 0 and event["round"] % 5 == 4:
            log(f"  learner 0 round {event['round'] + 1}/{event['rounds']} loss {event['loss']:.3f} "
                f"{event['tokens_per_s']:,} tok/s ETA {event['eta_s']:.0f} s")
        elif event.get("event") in ("missed_exchange", "fault", "resumed", "skipping_rounds"):
            log(f"  {event}")

    with ThreadPoolExecutor(len(spec.learners)) as pool:
        running = [pool.submit(train, slot) for slot in spec.learners]
        for learner in running:
            learner.result()
    return consolidate(spec, run_store(spec.store, run_id))


def score(spec: RunSpec, store, key: str) -> dict:
    """bpb of a trained model on every held-out evaluation and on the validation split."""
    manifest = store.get_json(layout.DATA_MANIFEST)
    model, meta = load_model(spec, store, key)
    out = {"tokens": meta["tokens"]}
    for split in ("heldout", "validation"):
        out[split] = {name: bits_per_byte(model, read_stream(store, entry), spec.max_seq_len,
                                          spec.eval.batch_size)["bpb"] for name, entry in manifest[split].items()}
    return out


def run_arm(arm: Arm, log: Log) -> dict:
    spec = arm.spec()
    run_id = f"{arm.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    store = run_store(spec.store, run_id)
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    started = time.monotonic()
    extra = {}
    if arm.kind == "islands":
        extra["consensus"] = train_islands(spec, run_id, log)
        key = layout.CONSOLIDATED
    else:
        train_baseline(spec, store, lambda p: log(f"  step {p['step']}/{p['steps']} loss {p['loss']:.3f} "
                                                   f"{p['tokens_per_s']:,} tok/s ETA {p['eta_s']:.0f} s")
                       if p["step"] % 100 == 1 else None)
        key = layout.BASELINE
    train_seconds = time.monotonic() - started
    scores = score(spec, store, key)
    result = {"arm": arm.name, "kind": arm.kind, "seed": arm.seed, "group": arm.group, "compare_to": arm.compare_to,
              "bpb": scores["heldout"], "validation_bpb": scores["validation"], "tokens": scores["tokens"],
              "train_seconds": round(train_seconds, 1), "parameters": build_model(spec).parameter_counts(),
              "sync": spec.sync.model_dump(mode="json"), "model": spec.model.model_dump(mode="json"), **extra}
    # Checkpoints of every round are gigabytes; the arm's figures are what the benchmark keeps.
    shutil.rmtree(Path(spec.store.url) / "runs" / run_id, ignore_errors=True)
    return result


def arm_path(arm: Arm) -> Path:
    return RESULTS / ("tuning" if arm.group == "tuning" else "arms") / f"{arm.name}.json"


def run_arms(arms: list[Arm], log: Log) -> None:
    todo = [a for a in arms if not arm_path(a).exists()]
    log(f"{len(arms) - len(todo)} of {len(arms)} arms already finished; running {[a.name for a in todo]}")
    durations: list[float] = []
    for n, arm in enumerate(todo):
        started = time.monotonic()
        log(f"arm {n + 1}/{len(todo)} {arm.name} started")
        result = run_arm(arm, log)
        arm_path(arm).parent.mkdir(parents=True, exist_ok=True)
        arm_path(arm).write_text(json.dumps(result, indent=2))
        durations.append(time.monotonic() - started)
        eta = statistics.mean(durations) * (len(todo) - n - 1)
        log(f"arm {arm.name} done in {durations[-1]:.0f} s: bpb {fmt(result['bpb'])}, validation "
            f"{fmt(result['validation_bpb'])}; ETA for the rest {eta / 60:.0f} min")
        write_table(log)


def fmt(scores: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in scores.items())


# -- the table -------------------------------------------------------------------------------------

def load_results(folder: str = "arms") -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((RESULTS / folder).glob("*.json"))}


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def build_table(results: dict[str, dict]) -> dict:
    table = {"seeds": {}, "main": {}, "ablations": [], "parameters": {}}
    for family, (standard, islands) in FAMILIES.items():
        pairs = [(results[f"{standard}-s{s}"], results[f"{islands}-s{s}"]) for s in SEEDS
                 if f"{standard}-s{s}" in results and f"{islands}-s{s}" in results]
        if not pairs:
            continue
        table["seeds"][family] = [std["seed"] for std, _ in pairs]
        table["main"][family] = {}
        for name in pairs[0][0]["bpb"]:
            std = [p[0]["bpb"][name] for p in pairs]
            isl = [p[1]["bpb"][name] for p in pairs]
            rel = [i / s - 1 for s, i in zip(std, isl)]
            table["main"][family][name] = {"standard": spread(std), "islands": spread(isl), "relative": spread(rel),
                                           "relative_of_means": spread(isl)[0] / spread(std)[0] - 1}
    for name, result in results.items():
        base = results.get(result.get("compare_to") or "")
        if name in ABLATION_NOTES and base:
            table["ablations"].append({"arm": name, "note": ABLATION_NOTES[name], "bpb": result["bpb"],
                                       "baseline": base["arm"],
                                       "relative": {k: v / base["bpb"][k] - 1 for k, v in result["bpb"].items()},
                                       "max_weight_distance": result.get("consensus", {}).get("max_weight_distance")})
        table["parameters"][json.dumps(result["model"].get("moe"))] = result["parameters"]
    table["tokens"] = {name: r["tokens"] for name, r in results.items()}
    table["train_seconds"] = {name: r["train_seconds"] for name, r in results.items()}
    return table


def table_markdown(table: dict) -> str:
    evaluations = list(next(iter(table["main"].values()), {}))
    lines = ["# Quality at equal compute", "",
             "bits per byte on the held-out evaluations, mean ± standard deviation over seeds; relative = "
             "islands / standard − 1 per seed (negative: islands better)."]
    for family, rows in table["main"].items():
        lines += ["", f"## {family} ({len(table['seeds'][family])} seeds: {table['seeds'][family]})", "",
                  "| evaluation | standard | islands | relative (mean ± sd) | relative of means |",
                  "|---|---|---|---|---|"]
        for name, row in rows.items():
            lines.append(f"| {name} | {row['standard'][0]:.4f} ± {row['standard'][1]:.4f} | "
                         f"{row['islands'][0]:.4f} ± {row['islands'][1]:.4f} | "
                         f"{100 * row['relative'][0]:+.2f}% ± {100 * row['relative'][1]:.2f} | "
                         f"{100 * row['relative_of_means']:+.2f}% |")
    lines += ["", "## Ablations (seed 0; each changes one thing and is measured against the arm in 'vs')", "",
              "| arm | what changes | vs | " + " | ".join(f"{k} bpb (rel.)" for k in evaluations) +
              " | max weight distance |", "|---|---|---|" + "---|" * len(evaluations) + "---|"]
    for row in table["ablations"]:
        cells = " | ".join(f"{row['bpb'][k]:.4f} ({100 * row['relative'][k]:+.2f}%)" for k in evaluations)
        distance = "-" if row["max_weight_distance"] is None else f"{row['max_weight_distance']:.4f}"
        lines.append(f"| {row['arm']} | {row['note']} | {row['baseline']} | {cells} | {distance} |")
    lines += ["", "## Parameters (equal compute counts active parameters)", ""]
    for moe, counts in table["parameters"].items():
        lines.append(f"- moe {moe}: active {counts['active']:,}, total {counts['total']:,}")
    lines += ["", "Training tokens per arm: " + ", ".join(f"{k} {v:,}" for k, v in table["tokens"].items()),
              "", "Reproduce: `.venv/bin/python -m bench.quality` (resumes; `--table` rebuilds this file)."]
    return "\n".join(lines) + "\n"


def write_table(log: Log | None = None) -> None:
    results, tuning = load_results(), load_results("tuning")
    table = build_table({**tuning, **results})
    (RESULTS / "table.json").write_text(json.dumps(table, indent=2))
    (RESULTS / "table.md").write_text(table_markdown(table))
    if tuning:
        (RESULTS / "tuning.md").write_text(tuning_markdown(tuning, results))
    if log:
        log(f"table written: {RESULTS / 'table.md'}")


def tuning_markdown(results: dict[str, dict], main: dict[str, dict]) -> str:
    """The outer-optimizer tuning by length, best validation first (at full length the main seed-0
    arms, whose setting the shorter runs chose, stand beside them); then the sparse MoE's candidates,
    each against its standard arm on the validation split, per seed and on average."""
    by_rounds: dict[int, dict[str, dict]] = {}
    for name, r in results.items():
        if not name.startswith("tune-moe-"):
            by_rounds.setdefault(r["sync"]["rounds"], {})[name] = r
    if ROUNDS in by_rounds:
        by_rounds[ROUNDS].update({n: main[n] for n in ("standard-s0", "islands-s0") if n in main})
    evaluations = list(next(iter(results.values()))["validation_bpb"])
    lines = ["# Tuning on the validation split", "", "## Outer optimizer (dense model, butterfly, seed 0)"]
    for rounds, group in sorted(by_rounds.items()):
        lines += ["", f"### {rounds} rounds", "",
                  "| arm | outer | " + " | ".join(f"validation {k}" for k in evaluations) + " |",
                  "|---|---|" + "---|" * len(evaluations)]
        for name, r in sorted(group.items(), key=lambda item: sum(item[1]["validation_bpb"].values())):
            outer = "standard training" if r["kind"] == "standard" else json.dumps(r["sync"]["outer"])
            lines.append(f"| {name} | {outer} | " + " | ".join(f"{v:.4f}" for v in r["validation_bpb"].values()) + " |")
    return "\n".join(lines + moe_tuning_lines(results, main, evaluations)) + "\n"


def moe_tuning_lines(results: dict[str, dict], main: dict[str, dict], evaluations: list[str]) -> list[str]:
    everything = {**main, **results}
    candidates: dict[str, dict[int, dict]] = {}
    for seed in SEEDS:
        if f"islands-moe-allreduce-s{seed}" in main:
            candidates.setdefault("chosen before (outer lr 1.0, momentum 0.5, 60 rounds)", {})[seed] = \
                main[f"islands-moe-allreduce-s{seed}"]
    for name, r in results.items():
        if name.startswith("tune-moe-allreduce-"):
            candidates.setdefault(name.removeprefix("tune-moe-allreduce-").rsplit("-s", 1)[0], {})[r["seed"]] = r
        elif name.startswith("tune-moe-standard-"):
            candidates.setdefault(f"standard training, {name.removeprefix('tune-moe-standard-').rsplit('-s', 1)[0]}",
                                  {})[r["seed"]] = r
    if not candidates:
        return []
    lines = ["", "## Sparse MoE, all-reduce: candidates against their standard arm (equal tokens)", "",
             "validation bpb relative to the standard arm (negative: better); the standard-training rows are "
             "measured against standard training at the base inner learning rate.", "",
             "| candidate | seeds | " + " | ".join(f"validation {k} (mean rel.)" for k in evaluations) + " | per seed |",
             "|---|---|" + "---|" * len(evaluations) + "---|"]
    rows = []
    for candidate, by_seed in candidates.items():
        relative = {seed: {k: r["validation_bpb"][k] / everything[r["compare_to"]]["validation_bpb"][k] - 1
                           for k in evaluations}
                    for seed, r in sorted(by_seed.items()) if r["compare_to"] in everything}
        if not relative:
            continue
        means = {k: statistics.mean(rel[k] for rel in relative.values()) for k in evaluations}
        per_seed = "; ".join(f"s{seed}: " + ", ".join(f"{100 * rel[k]:+.2f}%" for k in evaluations)
                             for seed, rel in relative.items())
        rows.append((sum(means.values()), f"| {candidate} | {list(relative)} | "
                     + " | ".join(f"{100 * means[k]:+.2f}%" for k in evaluations) + f" | {per_seed} |"))
    return lines + [row for _, row in sorted(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="*", help="run only these arms (default: all, main comparison first)")
    parser.add_argument("--table", action="store_true", help="only rebuild the table from finished arms")
    parser.add_argument("--tune", choices=["outer", "moe"],
                        help="run tuning arms instead (ranked on the validation split only): the dense model's "
                             "outer optimizer, or the sparse MoE with all-reduce")
    parser.add_argument("--tune-rounds", type=int, default=8, help="rounds of the outer-optimizer tuning arms")
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[0], help="seeds of the MoE tuning arms")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    log = Log(RESULTS / "progress.log")
    if args.table:
        write_table(log)
        return 0
    arms = {"outer": lambda: tuning_arms(args.tune_rounds), "moe": lambda: moe_tuning_arms(args.tune_seeds),
            None: lambda: ARMS}[args.tune]()
    if args.arms:
        known = {a.name: a for a in arms}
        unknown = [a for a in args.arms if a not in known]
        if unknown:
            parser.error(f"unknown arms {unknown}; known: {sorted(known)}")
        arms = [known[a] for a in args.arms]
    run_arms(arms, log)
    write_table(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
