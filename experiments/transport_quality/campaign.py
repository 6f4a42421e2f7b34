"""What compression and fragments cost in quality, and save in bytes: finished runs side by side.

Takes islands runs that differ only in `sync.transport` (e.g. configs/demo-streaming*.yaml run
with `python -m flows.cli run CONFIG`), scores each run's consolidated model on every held-out
evaluation, and sets its bpb against the first run's (the uncompressed reference) with a paired
bootstrap interval over the held-out documents (same documents, both models). Communication
figures come from the learners' summaries, as in the run report. Runs with the same model, data
and tokens share one standard baseline, so its bpb is read from whichever run has one. Writes the
result file (`--out`) and its page in docs/results/, stamped with the commit that measured them
(the runs are trained at that commit first).

    python -m experiments.transport_quality RUN_ID [RUN_ID ...] [--store .archipelago/store]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from benchmarks.results_page import provenance, write_results_page
from eval.bootstrap import paired_bootstrap
from eval.evaluate import score_model
from eval.report import communication
from infra import layout
from infra.spec import RunSpec
from infra.store import ObjectStore
from training.baseline import BaselinePlan
from training.learner.ledger import read_summaries
from training.model.registry import build_model


def measure(store: ObjectStore, run_id: str) -> dict:
    run = store.child(f"runs/{run_id}")
    spec = RunSpec.model_validate(run.get_json(layout.SPEC))
    transport = spec.sync.transport
    summaries = read_summaries(spec, run)
    comm = communication(spec, summaries, build_model(spec).parameter_counts()["total"], BaselinePlan.of(spec).steps)
    computing = sum(s.seconds_computing for s in summaries)
    syncing = sum(s.seconds_syncing for s in summaries)
    return {"run_id": run_id, "compression": transport.compression, "fragments": transport.fragments,
            "tau": transport.tau, "error_feedback": transport.error_feedback, "topk": transport.topk,
            "heldout": score_model(spec, run, layout.CONSOLIDATED)["heldout"],
            "inter_island_bytes": comm["inter_island_bytes"], "intra_island_bytes": comm["intra_island_bytes"],
            "allreduce_equivalent_bytes": comm["allreduce_equivalent_bytes"],
            "inter_island_reduction": comm["inter_island_reduction"], "per_fragment": comm["per_fragment"],
            "link_classes": comm["link_classes"], "utilisation": computing / (computing + syncing),
            "seconds_blocked_on_link": sum(s.seconds_blocked for s in summaries),
            "baseline_heldout": (score_model(spec, run, layout.BASELINE)["heldout"]
                                 if run.is_committed(layout.BASELINE) else None)}


def relative(a: dict, b: dict) -> str:
    """A's bpb against B's on the same documents: the difference and its 95% paired-bootstrap interval."""
    d = paired_bootstrap(a["document_bits"], b["document_bits"], a["document_bytes"])
    return f"{d.relative:+.2%} [{d.low:+.2%}, {d.high:+.2%}]"


def table(results: list[dict]) -> pd.DataFrame:
    reference = results[0]["heldout"]
    baseline = next((r["baseline_heldout"] for r in results if r["baseline_heldout"]), None)
    rows = []
    for r in results:
        row = {"run": r["run_id"], "compression": r["compression"], "fragments": r["fragments"], "tau": r["tau"]}
        for name, scored in r["heldout"].items():
            row[f"{name}_bpb"] = round(scored["bpb"], 4)
            row[f"{name}_vs_first"] = relative(scored, reference[name])
            if baseline:
                row[f"{name}_vs_standard"] = relative(scored, baseline[name])
        row.update({"inter_island_MB": round(r["inter_island_bytes"] / 1e6, 2),
                    "vs_allreduce": f"{r['inter_island_reduction']:.0f}x",
                    "peak_fragment_MB_per_round": round(max(f["bytes_sent_per_round"] for f in r["per_fragment"]) / 1e6, 3),
                    "utilisation": round(r["utilisation"], 3)})
        rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_ids", nargs="+", help="finished runs; the first is the reference")
    parser.add_argument("--store", default=".archipelago/store")
    parser.add_argument("--out", default="experiments/transport_quality/results/transport_quality.json")
    args = parser.parse_args()
    store = ObjectStore(args.store)
    results = [measure(store, run_id) for run_id in args.run_ids]
    for r in results:
        print(f"measured {r['run_id']}", flush=True)
    measured = provenance()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**measured, "runs": results}, indent=2))
    title = f"# Transport settings against the uncompressed reference ({results[0]['run_id']})"
    page = write_results_page(out.stem.replace("_", "-"), f"{title}\n\n{table(results).to_markdown(index=False)}",
                              sources=str(out), command=f"python -m experiments.transport_quality {' '.join(args.run_ids)}",
                              **measured)
    print(page.read_text())

