"""The shaped-link benchmark's results: a headline per arm and the results page of a result file.

    .venv/bin/python -m benchmarks.shaped_link_report [RESULT_JSON]   # rewrite its page in docs/results/
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.harness import relative_change
from benchmarks.results_page import write_results_page

RESULTS = Path("benchmarks/results/shaped_link.json")


def headline(result: dict) -> dict:
    return {"wall_s": round(result["wall_seconds"], 1), "link_bytes": round(result["inter_island_bytes_measured"]["total"]),
            "utilisation": round(result["utilisation"], 3), "bpb": result["bpb"]}


def markdown(document: dict) -> str:
    link = document["link"]
    arms = document["arms"]
    evals = sorted({name for arm in arms.values() for name in (arm["runs"][0]["bpb"] or {})})
    header = ["arm", "config", "runs", "wall s", "link bytes (veth, both ways)", "of which Prefect",
              "of which exchanges", "counted bytes",
              "link / counted", "utilisation (per run)", "compute/(compute+sync)"] + [f"bpb {e}" for e in evals]
    rows = []
    for name, arm in arms.items():
        runs = arm["runs"]

        def median(figure) -> float:
            return statistics.median(figure(r) for r in runs)

        bpb = runs[0]["bpb"] or {}
        counted = median(lambda r: r["inter_island_bytes_counted"])
        rows.append([name + (" (extrapolated)" if runs[0].get("extrapolated") else ""), f"`{arm['config']}`",
                     str(len(runs)), f"{statistics.median(arm['wall_s']):.0f}",
                     f"{statistics.median(arm['link_bytes']):,.0f}",
                     f"{median(lambda r: r['control_plane_bytes']):,.0f}" if "control_plane_bytes" in runs[0] else "-",
                     f"{median(lambda r: r['inter_island_bytes_exchanges']):,.0f}", f"{counted:,.0f}",
                     f"{statistics.median(arm['link_bytes']) / counted:.2f}" if counted else "-",
                     f"{statistics.median(arm['utilisation']):.1%} ("
                     + ", ".join(f"{u:.1%}" for u in arm["utilisation"]) + ")",
                     f"{median(lambda r: r['utilisation_round_loop']):.1%}" if "utilisation_round_loop" in runs[0]
                     else "-"]
                    + [f"{bpb[e]:.4f}" if e in bpb else "-" for e in evals])
    placement = (f"islands {', '.join(link['island_stores'])} on stores of their own in their namespaces, the run's "
                 f"store in `{link['store_island']}`" if link.get("island_stores")
                 else f"one store for every island, in `{link['store_island']}`")
    lines = [f"# Shaped link: {len(arms)} arms over one {link['rate_bps'] / 1e6:.2f} Mbit/s link",
             "", f"Rate: {link['chosen']} (per-step DP needs {link['dp_need_at_95pct_bps'] / 1e6:.1f} Mbit/s for "
             f"95% here at {link['calibrated_step_seconds']:.3f} s/step; literal brief scaling "
             f"{link['brief_literal_rate_bps'] / 1e6:.3f} Mbit/s). Stores: {placement}. Medians over each arm's "
             "runs, which alternate arm by arm.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if any("predicted" in arm for arm in arms.values()):
        lines += ["", *planned_markdown(document)]
    for name, arm in arms.items():
        payload = arm["runs"][0].get("remote_island_store_payload")
        if payload:
            lines += ["", f"`{name}` (first run): the remote island's store traffic over the link was "
                          f"{payload['checkpoints_written']:,} checkpoint bytes written, "
                          f"{payload['messages_written']:,} message bytes written, {payload['messages_read']:,} message "
                          f"bytes read (same-island partners included) and {payload['shards_read']:,} shard bytes read."]
    butterfly_runs = arms.get("butterfly", {}).get("runs", [])
    plain = butterfly_runs[0] if butterfly_runs else None
    for name, arm in arms.items():
        run = arm["runs"][0]
        if "outage" in run:
            out = run["outage"]
            lines += ["", f"`{name}`: island {out['island']}'s store unreachable for {out['seconds']:.1f} s, from "
                          f"{out['from_s']:.1f} to {out['to_s']:.1f} s on the driver's clock, started when it scheduled the "
                          f"segments; missed exchanges {run['missed_exchanges']}, store "
                          f"retries {run['store_retries']}, rounds finished per learner "
                          f"{', '.join(str(len(r['rounds'])) for r in run['round_ends_s'].values())}"
                          + ("; held-out bpb against the run without the outage: " + ", ".join(
                              f"{e} {v:.4f} / {plain['bpb'][e]:.4f} ({relative_change(v, plain['bpb'][e])})"
                              for e, v in run["bpb"].items()) if plain else "") + "."]
    t = document["targets"]
    if "butterfly_bytes_reduction_measured" in t:
        lines += ["", f"Butterfly vs per-step all-reduce, inter-island bytes: {t['butterfly_bytes_reduction_measured']:.1f}x "
                      f"less on the wire, {t['butterfly_bytes_reduction_exchanges']:.1f}x less in exchanges on the wire, "
                      f"{t['butterfly_bytes_reduction_counted'] or 0:.1f}x by the learners' counters "
                      f"(target {t['reduction_target']}x)."]
    if "butterfly_utilisation" in t:
        lines += [f"Butterfly utilisation {t['butterfly_utilisation']:.1%} (target {t['utilisation_target']:.0%}); "
                  f"its link bytes are {t['butterfly_link_over_exchanges']:.2f}x the exchange bytes its learners "
                  "counted (target: within 1.10x)"
                  + (f"; less Prefect's own traffic, {t['butterfly_link_less_prefect_over_exchanges']:.2f}x."
                     if "butterfly_link_less_prefect_over_exchanges" in t else ".")]
    reach = t.get("time_to_quality")
    if reach and reach.get("target_bpb"):
        target = ", ".join(f"{e} {b:.4f}" for e, b in reach["target_bpb"].items())
        lines += [f"Time to quality: per-step all-reduce ends at held-out bpb {target} in {reach['standard_wall_s']:.0f} s; "
                  + (f"the butterfly arm reaches it in {statistics.median(reach['islands_seconds']):.0f} s, "
                     f"{reach['ratio']:.2f}x that wall time (goal at most 0.5x)." if reach["ratio"] is not None else
                     f"the butterfly arm does not reach it in every run (seconds per run: {reach['islands_seconds']}); "
                     f"its last point is {reach['final_gap']:+.1%} from it on its worst evaluation.")]
    elif reach:
        lines += [f"Time to quality: not measured ({reach['why']})."]
    if plain and "inter_island_polls" in plain:
        lines += [f"Store requests across the link per butterfly run: {plain['inter_island_messages_read']} message "
                  "reads, each its commit and one part, the commit brought by the last of its polls (polls per run: "
                  f"{', '.join(str(r['inter_island_polls']) for r in butterfly_runs)})."]
    lines += ["", "Columns. *link bytes*: both directions of the veth pair, headers included. *of which Prefect*: "
              "the second island's worker and flow runs talking to the Prefect server in the first island's namespace "
              "(polls, task states, logs, progress), from the kernel's per-connection counters sampled every second "
              "(a floor). *of which exchanges*: the link less Prefect's traffic and, with one store, less the remote "
              "island's checkpoint writes and start-up shard reads; standard, its step loop only. *counted*: islands arms, the "
              "learners' own inter-island message reads; standard, 2 x gradient bytes per step. *utilisation*: "
              "learner compute seconds over wall seconds once every learner has finished its first round, to the end "
              "of each learner's last (standard: compute over each rank's step-loop wall); *compute/(compute+sync)*: the "
              "learners' own split, which leaves out checkpoint writes. Each island's learners, worker and segments "
              "run on one of the machine's 2 cores; Prefect's server and the SeaweedFS servers on either."]
    return "\n".join(lines) + "\n"


def planned_markdown(document: dict) -> list[str]:
    """The planner against each arm's runs: utilisation and wall time (target: within 10% of the
    measured median) and inter-island exchange bytes (within 2% of the learners' counts)."""
    arms = {name: arm for name, arm in document["arms"].items() if "predicted" in arm}
    lines = ["Planned (`training/planning/planner.py`: the islands' arms from a profiling run of their own learners before "
             "the runs, `plan_run`; standard from the step calibrated before the link went up, `plan_data_parallel`) "
             "against measured (median of the runs; per run in brackets):", "",
             "| arm | utilisation planned / measured | wall s planned / measured | inter-island exchange bytes "
             "planned / counted |", "|---|---|---|---|"]
    for name, arm in arms.items():
        p = arm["predicted"]
        utilisation, wall = statistics.median(arm["utilisation"]), statistics.median(arm["wall_s"])
        counted = statistics.median(arm["exchange_bytes_counted"])
        lines.append(
            f"| {name} | {p['utilisation']:.1%} / {utilisation:.1%} ({relative_change(p['utilisation'], utilisation)}) "
            f"[{', '.join(f'{u:.1%}' for u in arm['utilisation'])}] | {p['wall_s']:.1f} / {wall:.1f} "
            f"({relative_change(p['wall_s'], wall)}) [{', '.join(f'{w:.1f}' for w in arm['wall_s'])}] | "
            f"{p['exchange_bytes']:,} / {counted:,.0f} ({relative_change(p['exchange_bytes'], counted)}) |")
    return lines


def write_reports(document: dict, out: Path = RESULTS) -> str:
    """The results page of a result file: benchmarks/results/shaped_link.json is docs/results/shaped-link.md,
    experiments/quality/results/brief/shaped_link.json docs/results/brief-shaped-link.md, and so on."""
    results = RESULTS.resolve().parent
    name = out.resolve().relative_to(results).with_suffix("").as_posix()
    source = out.resolve().relative_to(results.parents[1]).as_posix()  # from the repository root
    page = write_results_page(name.replace("/", "-").replace("_", "-"), markdown(document), sources=source,
                              command=f"python -m benchmarks.shaped_link_report {source}",
                              commit=document.get("commit"), date=document.get("date"))
    return page.read_text()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", nargs="?", type=Path, default=RESULTS, help="the shaped-link result file")
    result = parser.parse_args().result
    print(write_reports(json.loads(result.read_text()), result))
