"""The shaped-link bench's results: a headline per arm and the Markdown table of bench/results."""

from __future__ import annotations


def headline(result: dict) -> dict:
    return {"wall_s": round(result["wall_seconds"], 1), "link_bytes": round(result["inter_island_bytes_measured"]["total"]),
            "utilisation": round(result["utilisation"], 3), "bpb": result["bpb"]}


def markdown(document: dict) -> str:
    link = document["link"]
    arms = document["arms"]
    evals = sorted({name for r in arms.values() for name in (r["bpb"] or {})})
    header = ["arm", "config", "wall s", "inter-island bytes (veth, both ways)", "of which exchanges", "counted bytes",
              "utilisation", "utilisation incl. start-up", "compute/(compute+sync)"] + [f"bpb {e}" for e in evals]
    rows = []
    for arm, r in arms.items():
        bpb = r["bpb"] or {}
        rows.append([arm + (" (extrapolated)" if r.get("extrapolated") else ""), f"`{r['config']}`",
                     f"{r['wall_seconds']:.0f}", f"{r['inter_island_bytes_measured']['total']:,.0f}",
                     f"{r['inter_island_bytes_exchanges']:,.0f}",
                     f"{r['inter_island_bytes_counted']:,.0f}", f"{r['utilisation']:.1%}",
                     f"{r['utilisation_process_wall']:.1%}" if "utilisation_process_wall" in r else "-",
                     f"{r['utilisation_round_loop']:.1%}" if "utilisation_round_loop" in r else "-"]
                    + [f"{bpb[e]:.4f}" if e in bpb else "-" for e in evals])
    lines = [f"# Shaped link: {len(arms)} arms over one {link['rate_bps'] / 1e6:.2f} Mbit/s link",
             "", f"Rate: {link['chosen']} (per-step DP needs {link['dp_need_at_95pct_bps'] / 1e6:.1f} Mbit/s for "
             f"95% here at {link['calibrated_step_seconds']:.3f} s/step; literal brief scaling "
             f"{link['brief_literal_rate_bps'] / 1e6:.3f} Mbit/s). Store endpoint in island "
             f"`{link['store_island']}`.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    for arm, r in arms.items():
        payload = r.get("remote_island_store_payload")
        if payload:
            lines += ["", f"`{arm}`: of its {r['inter_island_bytes_measured']['total']:,.0f} link bytes, the remote island's "
                          f"store traffic was {payload['checkpoints_written']:,} checkpoint bytes written, "
                          f"{payload['messages_written']:,} message bytes written, {payload['messages_read']:,} message "
                          f"bytes read (same-island partners included) and {payload['shards_read']:,} shard bytes read."]
    t = document["targets"]
    if "butterfly_bytes_reduction_measured" in t:
        lines += ["", f"Butterfly vs per-step all-reduce, inter-island bytes: {t['butterfly_bytes_reduction_measured']:.1f}x "
                      f"less on the wire, {t['butterfly_bytes_reduction_exchanges']:.1f}x less in exchanges on the wire "
                      f"(the link less remote checkpoints and shards; the all-reduce's step loop), "
                      f"{t['butterfly_bytes_reduction_counted'] or 0:.1f}x by the learners' counters "
                      f"(target {t['reduction_target']}x)."]
    if "butterfly_utilisation" in t:
        lines += [f"Butterfly utilisation {t['butterfly_utilisation']:.1%} (target {t['utilisation_target']:.0%})."]
    lines += ["", "Columns. *inter-island bytes*: both directions of the veth pair, headers included. *of which "
              "exchanges*: islands arms, that less the remote island's checkpoint writes and start-up shard reads "
              "(what an island-local checkpoint store would keep off the link); standard, its step loop only. "
              "*counted*: islands arms, the learners' own inter-island message reads; standard, 2 x gradient bytes "
              "per step. *utilisation*: learner compute seconds over wall seconds from the end of each learner's "
              "first round to the end of its last (standard: compute over each rank's step-loop wall); *incl. "
              "start-up*: over each learner process's whole life; *compute/(compute+sync)*: the learners' own "
              "split, which leaves out checkpoint writes. Learners share 2 CPU cores with each other and with "
              "other work on the machine."]
    return "\n".join(lines) + "\n"
