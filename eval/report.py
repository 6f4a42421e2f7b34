"""The run's report: evaluation table, compute, communication and consensus, as JSON and tables."""

from __future__ import annotations

import pandas as pd

from eval.bootstrap import paired_bootstrap
from infra import layout
from infra.spec import RunSpec
from infra.spec.faults import CorruptObject
from training.baseline import BaselinePlan
from training.learner.ledger import LearnerSummary

FP32 = 4


def allreduce_equivalent(spec: RunSpec, parameters: int, steps: int) -> dict:
    """Bytes a per-step fp32 gradient ring all-reduce over the same learners would move.

    The ring visits learners island by island, so with I > 1 islands exactly I of its N links
    cross between islands; each link carries 2 (N - 1) / N of the gradient per step.
    """
    n = len(spec.learners)
    islands = len([i for i in spec.islands if i.learners])
    per_link = 2 * (n - 1) / n * parameters * FP32 if n > 1 else 0
    crossing = islands if islands > 1 else 0
    return {"inter_island_bytes": round(steps * crossing * per_link),
            "intra_island_bytes": round(steps * (n - crossing) * per_link)}


def communication(spec: RunSpec, summaries: list[LearnerSummary], parameters: int, baseline_steps: int) -> dict:
    equivalent = allreduce_equivalent(spec, parameters, baseline_steps)
    inter = sum(s.bytes_read_inter for s in summaries)
    return {
        "inter_island_bytes": inter,
        "intra_island_bytes": sum(s.bytes_read_intra for s in summaries),
        "bytes_written": sum(s.bytes_written for s in summaries),
        "checkpoint_bytes": sum(s.checkpoint_bytes for s in summaries),
        "allreduce_equivalent_bytes": equivalent["inter_island_bytes"],
        "allreduce_equivalent_intra_bytes": equivalent["intra_island_bytes"],
        "inter_island_reduction": (equivalent["inter_island_bytes"] / inter) if inter else None,
        "per_learner": [{"learner": s.learner, "island": s.island, "bytes_written": s.bytes_written,
                         "bytes_read_intra": s.bytes_read_intra, "bytes_read_inter": s.bytes_read_inter,
                         "checkpoint_bytes": s.checkpoint_bytes} for s in summaries],
        "link_classes": link_classes(summaries),
        "per_fragment": fragment_bytes(summaries),
        "per_store": store_bytes(summaries),
    }


def store_bytes(summaries: list[LearnerSummary]) -> dict:
    """Per store (its URL): message bytes written to it and read from it, and checkpoint bytes written
    to it (the bpb curve's weights-only objects included), summed over learners. With islands on
    stores of their own, what crosses between sites is what one island reads from another's store."""
    totals: dict[str, dict] = {}

    def row(url: str) -> dict:
        return totals.setdefault(url, {"messages_written": 0, "messages_read": 0, "checkpoints_written": 0})

    for s in summaries:
        for url, moved in s.stores.items():
            row(url)["messages_written"] += moved["written"]
            row(url)["messages_read"] += moved["read"]
        if s.store_url:
            row(s.store_url)["checkpoints_written"] += s.checkpoint_bytes
    return totals


def link_classes(summaries: list[LearnerSummary]) -> dict:
    """Each link class's transport counters, summed over learners (messages only, not checkpoints)."""
    totals: dict[str, dict] = {}
    for s in summaries:
        for link, counters in s.links.items():
            for name, value in counters.items():
                totals.setdefault(link, {}).setdefault(name, 0)
                totals[link][name] += value
    return totals


def fragment_bytes(summaries: list[LearnerSummary]) -> list[dict]:
    """Per fragment: its size, how many rounds exchanged it, and the bytes all learners sent and
    received in such a round (the peak traffic of a round is the largest fragment's)."""
    sizes = next((s.fragment_sizes for s in summaries if s.fragment_sizes), [])
    rows = []
    for fragment, parameters in enumerate(sizes):
        exchanges = [e for s in summaries for e in s.exchanges if e["fragment"] == fragment]
        rounds = len({e["round"] for e in exchanges})
        rows.append({"fragment": fragment, "parameters": parameters, "rounds": rounds,
                     "bytes_sent_per_round": sum(e["bytes_sent"] for e in exchanges) / rounds if rounds else 0,
                     "bytes_received_per_round": sum(e["bytes_received"] for e in exchanges) / rounds if rounds else 0})
    return rows


def build_report(spec: RunSpec, run_id: str, evals: dict, consensus: dict, summaries: list[LearnerSummary],
                 baseline: dict | None, parameters: dict, wall_seconds: float,
                 control_refused: dict | None = None) -> dict:
    """`baseline`: standard training's result, None when the spec trains none (`evaluation.baseline`)."""
    islands_tokens = sum(s.tokens for s in summaries)
    plan = BaselinePlan.of(spec)  # the all-reduce comparison is per step of standard training, trained or not
    computing = sum(s.seconds_computing for s in summaries)
    syncing = sum(s.seconds_syncing for s in summaries)
    return {
        "run_id": run_id,
        "sync_mode": spec.sync.mode,
        "evals": {name: evaluation_entry(arms["islands"], arms["baseline"]) for name, arms in evals.items()},
        "baseline": spec.evaluation.baseline,
        "compute": {"islands_tokens": islands_tokens, "baseline_tokens": baseline["tokens"] if baseline else None,
                    "baseline_steps": plan.steps, "baseline_global_batch": plan.global_batch,
                    "parameters_total": parameters["total"], "parameters_active": parameters["active"]},
        "communication": communication(spec, summaries, parameters["total"], plan.steps),
        "consensus": consensus,
        "utilisation": computing / (computing + syncing) if computing + syncing else None,
        "seconds_blocked_on_link": sum(s.seconds_blocked for s in summaries),
        "wall_seconds": wall_seconds,
        "trust": trust_report(spec, summaries, control_refused or {}),
    }


def trust_report(spec: RunSpec, summaries: list[LearnerSummary], control_refused: dict) -> dict:
    """Whether the run's records were signed and checked (infra/authority.py), and what its learners and
    its control plane refused, by kind of object: what a store writer tried, or what a store damaged."""
    refused: dict[str, int] = dict(control_refused)
    for summary in summaries:
        for kind, count in summary.store.get("refused", {}).items():
            refused[kind] = refused.get(kind, 0) + count
    return {"authenticated": spec.signing is not None, "refused": dict(sorted(refused.items()))}


def evaluation_entry(islands: dict, baseline: dict | None) -> dict:
    """Both arms' bpb on one held-out set, and the islands' relative difference with its 95% interval
    from a paired bootstrap over the set's documents (the islands' alone without a baseline)."""
    if baseline is None:
        return {"islands_bpb": islands["bpb"], "baseline_bpb": None, "relative_difference": None,
                "bootstrap_95": None, "documents": len(islands["document_bytes"]), "bytes_scored": islands["bytes"]}
    difference = paired_bootstrap(islands["document_bits"], baseline["document_bits"], islands["document_bytes"])
    return {"islands_bpb": islands["bpb"], "baseline_bpb": baseline["bpb"],
            "relative_difference": difference.relative, "bootstrap_95": [difference.low, difference.high],
            "documents": len(islands["document_bytes"]), "bytes_scored": islands["bytes"]}


def settings_markdown(spec: RunSpec, report: dict) -> str:
    islands = pd.DataFrame([{"island": i.name, "accelerator": i.accelerator, "device": i.device,
                             "learners": i.learners, "batch": i.batch_size, "seq_len": i.seq_len,
                             "inner_steps": i.inner_steps, "processes/learner": i.processes_per_learner}
                            for i in spec.islands])
    comm = report["communication"]
    per_learner = pd.DataFrame(comm["per_learner"])
    reduction = comm["inter_island_reduction"]
    return "\n\n".join([
        f"# Archipelago run `{report['run_id']}`",
        f"Sync `{spec.sync.mode}`, {spec.sync.rounds} rounds, outer `{spec.sync.outer.name}` "
        f"(lr {spec.sync.outer.lr}, momentum {spec.sync.outer.momentum}); model {spec.model.describe()}, "
        f"{report['compute']['parameters_total']:,} parameters "
        f"({report['compute']['parameters_active']:,} active).",
        "## Islands", islands.to_markdown(index=False),
        "## Evaluation (bits per byte, every held-out byte scored)",
        evaluation_table(report).to_markdown(index=False, floatfmt=".4f"),
        "## Compute",
        f"Islands: {report['compute']['islands_tokens']:,} tokens; " + (
            f"standard training: {report['compute']['baseline_tokens']:,} tokens in "
            f"{report['compute']['baseline_steps']} steps of global batch {report['compute']['baseline_global_batch']}."
            if report["compute"]["baseline_tokens"] is not None else
            "standard training: not trained (evaluation.baseline: none)."),
        "## Communication",
        f"Inter-island {comm['inter_island_bytes']:,} B, intra-island {comm['intra_island_bytes']:,} B; "
        f"a per-step fp32 ring all-reduce would have sent {comm['allreduce_equivalent_bytes']:,} B across islands"
        + (f" ({reduction:,.1f}x more)." if reduction else "."),
        per_learner.to_markdown(index=False),
        "## Consensus",
        f"Max relative distance of a learner's weights from their mean: "
        f"{report['consensus']['max_weight_distance']:.4f}; utilisation {report['utilisation']:.3f}; "
        f"wall time {report['wall_seconds']:.1f} s." + "".join(
            f" Learner {learner} left out of the model: {reason}."
            for learner, reason in report["consensus"].get("learners_dropped", {}).items()),
        "## Trust",
        ("Records signed by their writers and checked by their readers" if report["trust"]["authenticated"] else
         "**Unauthenticated run**: no signing keys in the spec, so a store writer could plant records") +
        f"; objects refused by kind: {report['trust']['refused'] or 'none'}.",
    ])


def evaluation_table(report: dict) -> pd.DataFrame:
    """One row per held-out evaluation: islands bpb, standard bpb, relative difference and its interval."""
    return pd.DataFrame([{"evaluation": name, "documents": e["documents"], "bytes": e["bytes_scored"],
                          "islands_bpb": e["islands_bpb"], "baseline_bpb": e["baseline_bpb"],
                          "relative_difference": e["relative_difference"],
                          "95% interval": f"[{e['bootstrap_95'][0]:+.2%}, {e['bootstrap_95'][1]:+.2%}]"
                          if e["bootstrap_95"] else "no baseline"}
                         for name, e in report["evals"].items()])


def fault_report(spec: RunSpec, summaries: list[LearnerSummary], fault_markers: list[str]) -> dict:
    """What went wrong during the run and what it cost, injected or not.

    `failures` counts from the learners' own records of their lives, so a learner killed from
    outside counts the same as a drill's: `restarts` (a life that began after one that did not end
    at its capacity window's end: a process death and the task retry that followed),
    `rejoined_from_peer`, and the rounds (and tokens) skipped by rejoining. `recovered`: learners
    that restarted and still finished the run. `rounds_lost`: learner-rounds missing from that
    learner's own record of its rounds (skipped by rejoining from a peer).
    """
    store_faults: dict[str, int] = {}
    for s in summaries:
        for kind, count in s.store_faults_injected.items():
            store_faults[kind] = store_faults.get(kind, 0) + count
    injected = {"kill_learner": layout.count_fault_markers(fault_markers, layout.KILLED_LEARNER),
                "stage_failures": layout.count_fault_markers(fault_markers, layout.FAILED_STAGE),
                "corrupt_object": len(spec.faults_of(CorruptObject)), **{f"store_{k}": v for k, v in store_faults.items()}}
    restarts = {s.learner: restarted_lives(s.lives) for s in summaries}
    skipped = {s.learner: sum(len(life["skipped_rounds"]) for life in s.lives) for s in summaries}
    return {
        "injected": {k: v for k, v in injected.items() if v},
        "failures": {
            "restarts": sum(len(lives) for lives in restarts.values()),
            "rejoined_from_peer": sum(1 for s in summaries for life in s.lives
                                      if (life["resumed_from"] or {}).get("learner", s.learner) != s.learner),
            "rounds_skipped": sum(skipped.values()),
            "tokens_skipped": sum(n * spec.learners[learner].tokens_per_round() for learner, n in skipped.items()),
        },
        "recovered": sum(1 for lives in restarts.values() if lives),
        "rounds_lost": sum(spec.sync.rounds - len({r["round"] for r in s.rounds}) for s in summaries),
        "corrupt_reads_detected": sum(s.corrupt_reads_detected for s in summaries),
        "missed_exchanges": sum(len(s.missed_exchanges) for s in summaries),
        "store_retries": sum(s.store["retries"] for s in summaries),
        "rejoined": {str(s.learner): s.rejoined_from for s in summaries if s.rejoined_from},
    }


def restarted_lives(lives: list[dict]) -> list[dict]:
    """The lives that began because the one before died rather than paused at its window's end."""
    return [life for before, life in zip(lives, lives[1:]) if not before["paused"]]
