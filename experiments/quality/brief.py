"""The brief in one configuration (configs/brief.yaml) against standard training, over 3 seeds.

Butterfly pairs, fragments on a staggered schedule with overlap, 4-bit messages with error feedback,
the Shampoo-derived outer optimizer and the sparse MoE, on 8 learners across two islands that differ
in accelerator, batch, inner steps and processes per learner. The brief's runs keep experiments/quality/campaign.py's
model, data, sequence length, global batch (48 rows) and tokens, so that benchmark's baselines (a)
(standard training at global batch 48, its learning rate swept) and (b) (standard training at its
best batch) are read from experiments/quality/results/quality/arms as they are; (c) (one learner with the brief's
recipe) is trained here. Arms are run, scored and tabled by experiments/quality/campaign.py's functions.

Arms, in order:
- `candidate-<name>`: the recipe's tuning on seed 0, one per entry of configs/brief-candidates.yaml
  (its `start` settings, then the candidate's overrides, laid over configs/brief.yaml), ranked on
  the validation split only;
- `brief-s<seed>`: configs/brief.yaml on seeds 0, 1, 2;
- `single-brief-s<seed>`: (c), one learner with the brief's inner and outer optimizer, round length
  and fragment schedule (no message compression: with no peers it would only add noise).

An arm whose run spec equals a finished arm's is not trained again: that arm's result is copied (the
brief's seed 0 is the chosen candidate's run). Each arm trains holding the CPU lock (`benchmarks.harness.CPU_LOCK`)
(the host's cores are shared), writes `arms/<arm>.json` when it finishes, so a rerun resumes arm by
arm; progress with an ETA goes to `progress.log`; `summary.json` and the pages docs/results/brief.md
and brief-tuning.md are rebuilt after every arm from the finished arms.

    .venv/bin/python -m experiments.quality.brief                    # everything still to run
    .venv/bin/python -m experiments.quality.brief --candidates-only  # only the tuning candidates still to run
    .venv/bin/python -m experiments.quality.brief --table            # only rebuild the tables
    .venv/bin/python -m experiments.quality.brief --plan             # the arms still to run
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.arms import (SEEDS, SWEEP_SEED, merged, one_learner, per_seed, run_arm, seeds_bootstrap, spread,
                             validation_score)
from benchmarks.harness import CPU_LOCK, Log, cpu_lock, load_arms, resumable_main, run_arms
from benchmarks.results_page import recorded, write_results_page
from experiments.quality import campaign as quality
from infra.spec import RunSpec, parse_spec

RESULTS = Path("experiments/quality/results/brief")
CONFIG = Path("configs/brief.yaml")
CANDIDATES = Path("configs/brief-candidates.yaml")
# The issue's targets: at least 1% below (a) on every evaluation, at least 100x fewer inter-island bytes.
QUALITY_TARGET = -0.01
BYTES_TARGET = 100.0
SHAPED_LINK = RESULTS / "shaped_link.json"


def load_candidates() -> tuple[dict, list[dict]]:
    """The settings every candidate starts from, and the candidates in the order they are run (re-read
    before every arm, so ones added while the benchmark runs are picked up)."""
    document = yaml.safe_load(CANDIDATES.read_text())
    return document["start"], document["candidates"]


@dataclass(frozen=True)
class BriefArm:
    """One run of the brief's family; `kind` is "candidate", "islands" or "single". Has the attributes
    experiments/quality/campaign.py's `run_arm` reads from its own arms."""

    kind: str
    seed: int
    candidate: str | None = None
    family: str = "brief"
    lr: float | None = None
    batch: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "candidate":
            return f"candidate-{self.candidate}"
        return f"{'brief' if self.kind == 'islands' else 'single-brief'}-s{self.seed}"

    def raw(self) -> dict:
        raw = yaml.safe_load(CONFIG.read_text())
        raw["seed"] = self.seed
        if self.kind == "candidate":
            start, candidates = load_candidates()
            entry = next(c for c in candidates if c["name"] == self.candidate)
            raw = merged(merged(raw, start), entry.get("overrides", {}))
        elif self.kind == "single":
            raw = one_learner(raw)
        return raw

    def spec(self) -> RunSpec:
        return parse_spec(self.raw())


def fingerprint(spec: RunSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True)


def training_settings(spec: RunSpec) -> dict:
    """The spec less when state is saved (checkpoint schedule, retention, background writes), which changes
    nothing a run trains: the recipe is the candidate whose training settings the config still has."""
    settings = spec.model_dump(mode="json")
    for field in ("checkpoint_every", "keep_checkpoints"):
        settings["training"].pop(field)
    settings["sync"]["transport"].pop("checkpoint_in_background")
    return settings


def all_arms() -> list[BriefArm]:
    candidates = [BriefArm("candidate", SWEEP_SEED, c["name"]) for c in load_candidates()[1]]
    return candidates + [BriefArm(kind, seed) for kind in ("islands", "single") for seed in SEEDS]


def load_results() -> dict[str, dict]:
    return load_arms(RESULTS)


def todo(results: dict[str, dict], candidates_only: bool = False) -> list[BriefArm]:
    return [a for a in all_arms() if a.name not in results and (a.kind == "candidate" or not candidates_only)]


# -- running -----------------------------------------------------------------------------------------

def run_one(arm: BriefArm, results: dict[str, dict], log: Log) -> dict:
    """The arm's result: copied from a finished arm with the same run spec, else trained and scored
    holding the shared CPU lock."""
    spec = arm.spec()
    same = next((r for r in results.values() if r.get("spec_fingerprint") == fingerprint(spec)), None)
    if same:
        log(f"arm {arm.name}: the same run spec as {same['arm']}, its result reused")
        return {**same, "arm": arm.name, "kind": arm.kind, "same_run_as": same["arm"]}
    with cpu_lock(CPU_LOCK) as waited:
        log(f"arm {arm.name}: CPU lock taken after {waited:.0f} s")
        result = run_arm(arm, log)
    result.update(spec_fingerprint=fingerprint(spec), islands=[i.model_dump(mode="json") for i in spec.islands],
                  candidate=arm.candidate)
    return result


def run_all(log: Log, candidates_only: bool) -> None:
    run_arms(RESULTS, lambda finished: todo(finished, candidates_only), lambda arm, finished: run_one(arm, finished, log),
             lambda: write_tables(log), log)


def bytes_ratio(result: dict) -> float | None:
    """Per-step fp32 all-reduce bytes between islands over the run's counted inter-island bytes."""
    return (result.get("communication") or {}).get("inter_island_reduction")


# -- tables ------------------------------------------------------------------------------------------

def baselines(quality_results: dict[str, dict]) -> dict[str, list[dict] | None]:
    """(a) and (b) per seed, as experiments/quality/campaign.py chose them on the validation split."""
    chosen = quality.plan(quality_results)
    out = {"a": None, "b": None}
    if chosen.lr_a is not None:
        out["a"] = per_seed(quality_results, lambda s: quality.Arm(
            "standard", s, lr=chosen.lr_a, batch=quality.ISLANDS_GLOBAL_BATCH))
    if chosen.best_b:
        out["b"] = per_seed(quality_results, lambda s: quality.Arm(
            "standard", s, lr=chosen.best_b[1], batch=chosen.best_b[0]))
    return out


def settings_of(result: dict) -> str:
    """The levers of a run, from its stored settings."""
    sync, training, islands = result["sync"], result["training"], result["islands"]
    transport, outer = sync["transport"], sync["outer"]
    steps = " / ".join(str(i["inner_steps"]) for i in islands)
    return (f"H {steps}, F {transport['fragments']}, tau {transport['tau']}, {transport['compression']}"
            f"{'' if transport['error_feedback'] else ' no EF'}{' exact own' if transport['mix_own_exact'] else ''}, "
            f"{outer['name']} lr {outer['lr']:g} m {outer['momentum']:g}, inner lr {training['lr']:g} "
            f"warm-up {training['warmup_steps']}")


def front(results: dict[str, dict], base: dict[str, list[dict] | None]) -> list[dict]:
    """Every candidate: its bytes ratio and validation bpb against (a) and (b) on the same seed."""
    rows = []
    reference = {k: v[SEEDS.index(SWEEP_SEED)] for k, v in base.items() if v}
    for r in results.values():
        if r["kind"] != "candidate":
            continue
        row = {"candidate": r["candidate"], "settings": settings_of(r), "bytes_ratio": bytes_ratio(r),
               "validation_bpb": r["validation_bpb"], "validation_score": validation_score(r)}
        for k, ref in reference.items():
            row[f"validation_relative_to_{k}"] = {e: r["validation_bpb"][e] / ref["validation_bpb"][e] - 1
                                                  for e in r["validation_bpb"]}
        rows.append(row)
    return rows


def shaped_link_figures() -> dict:
    """Wire bytes, utilisation and time to quality of the brief's butterfly arm on the shaped link, from its
    result file (`benchmarks.shaped_link ... --out experiments/quality/results/brief/shaped_link.json`)."""
    figures = {"bytes_ratio_wire": None, "utilisation_runs": None, "time_to_quality_ratio": None, "pending": {}}
    if not SHAPED_LINK.exists():
        figures["pending"].update({k: f"run the shaped-link benchmark into {SHAPED_LINK}"
                                   for k in ("bytes_ratio_wire", "utilisation_runs", "time_to_quality_ratio")})
        return figures
    shaped = json.loads(SHAPED_LINK.read_text())
    butterfly = shaped["arms"]["butterfly"]
    figures.update({"bytes_ratio_wire": shaped["targets"].get("butterfly_bytes_reduction_measured"),
                    "utilisation_runs": butterfly["utilisation"],
                    "time_to_quality_ratio": shaped.get("time_to_quality_ratio"),
                    "time_to_quality": shaped["targets"].get("time_to_quality"),
                    "shaped_link": {"rate_bps": shaped["link"]["rate_bps"], "rounds": butterfly["runs"][0]["rounds"],
                                    "wall_s": butterfly["wall_s"],
                                    "standard_wall_s": shaped["arms"].get("standard", {}).get("wall_s"),
                                    "standard_utilisation": shaped["arms"].get("standard", {}).get("utilisation")}})
    return figures


def time_to_quality_sentence(reach: dict | None) -> str:
    if not reach or not reach.get("target_bpb"):
        return "Time to quality: not measured" + (f" ({reach['why']})." if reach else ".")
    if reach["ratio"] is None:
        return (f"The islands do not reach per-step all-reduce's final held-out bpb: their last point is "
                f"{reach['final_gap']:+.1%} from it on the worst evaluation.")
    return (f"Time to quality: the islands reach per-step all-reduce's final held-out bpb in {reach['ratio']:.2f}x "
            "its wall time (goal at most 0.5x).")


def build_summary(results: dict[str, dict]) -> dict:
    quality_results = quality.load_results()
    base = baselines(quality_results)
    islands = [results.get(BriefArm("islands", s).name) for s in SEEDS]
    single = [results.get(BriefArm("single", s).name) for s in SEEDS]
    arms = {"a": base["a"], "b": base["b"], "c": single if all(single) else None}
    chosen = quality.plan(quality_results)
    summary = {"config": str(CONFIG), "tokens": sorted({r["tokens"] for r in results.values()}),
               "baseline_settings": {"a": {"global_batch": quality.ISLANDS_GLOBAL_BATCH, "lr": chosen.lr_a},
                                     "b": chosen.best_b and {"global_batch": chosen.best_b[0], "lr": chosen.best_b[1]},
                                     "c": "one learner, the brief's recipe (trained here)"},
               "seeds": [], "relative": {}, "bytes_ratio_counted": None, "bytes_ratio_counted_per_seed": None,
               **shaped_link_figures(),
               "front": front(results, base),
               "still_to_run": [a.name for a in todo(results)]}
    for n, seed in enumerate(SEEDS):
        entry = {"seed": seed, "islands_bpb": islands[n] and islands[n]["bpb"]}
        for k, runs in arms.items():
            entry[f"baseline_{k}_bpb"] = runs[n]["bpb"] if runs else None
        summary["seeds"].append(entry)
    if all(islands):
        ratios = [bytes_ratio(r) for r in islands]
        summary["bytes_ratio_counted_per_seed"] = ratios
        summary["bytes_ratio_counted"] = min(ratios)  # the least favourable seed (they differ only by missed exchanges)
        for evaluation in islands[0]["bpb"]:
            row = {}
            for k, runs in arms.items():
                if runs:
                    per_seed = [i["bpb"][evaluation] / b["bpb"][evaluation] - 1 for i, b in zip(islands, runs)]
                    row[k] = {"per_seed": per_seed, "mean": statistics.mean(per_seed),
                              "sd": statistics.stdev(per_seed),
                              "bootstrap_ci": seeds_bootstrap(islands, runs, evaluation)}
            summary["relative"][evaluation] = row
        quality_met = all(row["a"]["mean"] <= QUALITY_TARGET and row["a"]["bootstrap_ci"][1] < 0
                          for row in summary["relative"].values() if "a" in row)
        summary["targets"] = {"quality_vs_a": quality_met, "bytes": summary["bytes_ratio_counted"] >= BYTES_TARGET}
    return summary


def table_markdown(summary: dict) -> str:
    settings = summary["baseline_settings"]
    lines = ["# The brief in one configuration against standard training", "",
             f"`{summary['config']}` (8 learners, 2 islands, butterfly pairs, 2 fragments with overlap, int4 "
             "messages with error feedback, Shampoo outer, sparse MoE). Bits per byte on the held-out documents, "
             "mean ± sd over seeds 0, 1, 2; relative = brief / baseline − 1 per seed, mean ± sd, then the 95% "
             "paired-bootstrap interval over documents (bits summed over seeds). Every arm trains "
             + " / ".join(f"{t:,}" for t in summary["tokens"]) + " tokens.", "",
             f"- (a) standard training at global batch {settings['a']['global_batch']}, lr {settings['a']['lr']} "
             "(experiments/quality/results/quality, tuned on the validation split)",
             "- (b) standard training at its best global batch: " +
             (f"{settings['b']['global_batch']}, lr {settings['b']['lr']}" if settings["b"] else "not chosen yet"),
             f"- (c) {settings['c']}"]
    if summary["relative"]:
        lines += ["", "| evaluation | (a) | (b) | (c) | brief | vs (a) | vs (b) | vs (c) |", "|---|---|---|---|---|---|---|---|"]
    for evaluation, row in summary["relative"].items():
        cells = []
        for key in ("baseline_a_bpb", "baseline_b_bpb", "baseline_c_bpb", "islands_bpb"):
            values = [s[key][evaluation] for s in summary["seeds"] if s[key]]
            cells.append("{:.4f} ± {:.4f}".format(*spread(values)) if len(values) == len(SEEDS) else "-")
        for k in "abc":
            if k in row:
                low, high = row[k]["bootstrap_ci"]
                cells.append(f"{100 * row[k]['mean']:+.2f}% ± {100 * row[k]['sd']:.2f} [{100 * low:+.2f}, {100 * high:+.2f}]")
            else:
                cells.append("-")
        lines.append(f"| {evaluation} | " + " | ".join(cells) + " |")
    if summary["bytes_ratio_counted"] is not None:
        lines += ["", f"Inter-island bytes (the learners' counters): {summary['bytes_ratio_counted']:.0f}x below a "
                      "per-step fp32 all-reduce over the same learners (least favourable seed)."]
    if summary["utilisation_runs"] is not None:
        link = summary["shaped_link"]
        lines += [f"On the shaped link ({link['rate_bps'] / 1e6:.1f} Mbit/s, where per-step all-reduce computes "
                  f"{statistics.median(link['standard_utilisation']):.0%} of the time; first {link['rounds']} rounds, "
                  f"`experiments/quality/results/brief/shaped_link.md`): {summary['bytes_ratio_wire']:.1f}x fewer inter-island "
                  f"bytes on the wire, utilisation {statistics.median(summary['utilisation_runs']):.1%} (runs "
                  + ", ".join(f"{u:.1%}" for u in summary["utilisation_runs"])
                  + f"), wall {statistics.median(link['wall_s']):.0f} s against "
                  f"{statistics.median(link['standard_wall_s']):.0f} s for per-step all-reduce. "
                  + time_to_quality_sentence(summary.get("time_to_quality"))]
    if "targets" in summary:
        met = summary["targets"]
        lines += ["", f"Targets: at least 1% below (a) on every evaluation with the interval below zero: "
                      f"{'met' if met['quality_vs_a'] else 'not met'}; at least {BYTES_TARGET:.0f}x fewer "
                      f"inter-island bytes by the learners' counters: {'met' if met['bytes'] else 'not met'}"
                      + (f"; on the wire: {'met' if summary['bytes_ratio_wire'] >= BYTES_TARGET else 'not met'}"
                         if summary["bytes_ratio_wire"] is not None else "")
                      + (f"; utilisation of at least 95%: "
                         f"{'met' if statistics.median(summary['utilisation_runs']) >= 0.95 else 'not met'}"
                         if summary["utilisation_runs"] is not None else "") + "."]
    if summary["still_to_run"]:
        lines += ["", f"Not finished yet: {', '.join(summary['still_to_run'])}."]
    lines += ["", "Tuning: [brief-tuning.md](brief-tuning.md). Reproduce: `.venv/bin/python -m experiments.quality.brief`."]
    return "\n".join(lines) + "\n"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def tuning_markdown(summary: dict, results: dict[str, dict]) -> str:
    """Every candidate with its validation figures, best first among those meeting the bytes target."""
    described = {c["name"]: c.get("why", "") for c in load_candidates()[1]}
    config = training_settings(BriefArm("islands", SWEEP_SEED).spec())
    recipe = next((r["candidate"] for r in results.values() if r["kind"] == "candidate"
                   and training_settings(parse_spec(json.loads(r["spec_fingerprint"]))) == config), None)
    lines = ["# Tuning the brief's recipe (seed 0, validation split only)", "",
             "Each candidate is configs/brief.yaml with configs/brief-candidates.yaml's start settings and the "
             "candidate's overrides, trained in "
             "full (2,457,600 tokens, no shortened screening runs) on seed 0 and scored on the validation split; "
             "the held-out sets chose nothing. vs (a) / vs (b): validation bpb against standard training's "
             "seed-0 runs of experiments/quality/campaign.py at the same tokens. Bytes ratio: per-step fp32 all-reduce between "
             f"islands over the learners' counted inter-island bytes (target at least {BYTES_TARGET:.0f}x). "
             "Ranked by the mean validation bpb; candidates under the bytes target are ranked below the rest.",
             "", f"The recipe in configs/brief.yaml: {'`' + recipe + '`' if recipe else 'not among the candidates yet'}.",
             "", "| candidate | settings | bytes ratio | validation code | validation prose | mean | code vs (a) | "
                 "prose vs (a) | code vs (b) | prose vs (b) | why tried |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ranked = sorted(summary["front"], key=lambda r: ((r["bytes_ratio"] or 0) < BYTES_TARGET, r["validation_score"]))
    for r in ranked:
        rel_a, rel_b = r.get("validation_relative_to_a", {}), r.get("validation_relative_to_b", {})
        lines.append(f"| {r['candidate']} | {r['settings']} | {r['bytes_ratio']:.0f}x | {r['validation_bpb']['code']:.4f} "
                     f"| {r['validation_bpb']['prose']:.4f} | {r['validation_score']:.4f} | {percent(rel_a.get('code'))} "
                     f"| {percent(rel_a.get('prose'))} | {percent(rel_b.get('code'))} | {percent(rel_b.get('prose'))} "
                     f"| {described.get(r['candidate'], '')} |")
    return "\n".join(lines) + "\n"


def write_tables(log: Log | None = None) -> None:
    results = load_results()
    summary = build_summary(results)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1))
    markdown = table_markdown(summary)
    measured = recorded(list(results.values()))
    write_results_page("brief", markdown, sources="experiments/quality/results/brief", command="python -m experiments.quality.brief --table",
                       **measured)
    write_results_page("brief-tuning", tuning_markdown(summary, results), sources="experiments/quality/results/brief",
                       command="python -m experiments.quality.brief --table", **measured)
    if log:
        log("pages written: docs/results/brief.md, docs/results/brief-tuning.md")


def main(argv: list[str] | None = None) -> int:
    return resumable_main(argv, __doc__.split("\n")[0], RESULTS, todo, run_all, write_tables,
                          flags={"candidates_only": "run only the tuning candidates still to run"})


if __name__ == "__main__":
    sys.exit(main())
