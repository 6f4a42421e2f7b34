"""The shaped link's arms: one run of an islands arm (DiLoCo or butterfly, through each island's
Prefect worker) or of the per-step all-reduce arm, the outage drill, and the figures each run reports."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

from benchmarks.harness import new_run
from benchmarks.link_sites import SEGMENT_LEAD_S, arm_spec, dp_threads, free_port
from benchmarks.netns import ConnectionBytes, IslandEnd, LinkPlan, link_bytes, log, run_concurrently
from benchmarks.shaped_link_report import headline

OUTAGE_ARM = "butterfly-outage"
OUTAGE_PARTNER_TIMEOUT_S = 5.0


def run_islands(spec, plan: LinkPlan, arm: str, api_url: str) -> dict:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from eval.curve import islands_heldout_curve
    from eval.evaluate import heldout_bpb
    from eval.report import allreduce_equivalent, store_bytes
    from infra import layout
    from tasks.segments import run_segment
    from training.baseline import BaselinePlan
    from training.consolidate import consolidate
    from training.learner.ledger import read_summaries
    from training.model.registry import build_model

    run_id, store, manifest = new_run(spec, arm)
    shard_bytes = {s["learner"]: s["object"]["nbytes"] for s in manifest["shards"]}
    segments: dict[str, dict] = {}
    errors: list[BaseException] = []

    start_at = datetime.now(timezone.utc) + timedelta(seconds=SEGMENT_LEAD_S)
    auth_string = PREFECT_API_AUTH_STRING.value()  # island_sites' string, from this thread's settings

    def island(end: IslandEnd) -> None:
        try:
            # settings are per thread
            with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}):
                flow_run = run_segment(spec, run_id, end.island, start_at=start_at)
            segments[end.island] = {"flow_run": flow_run.name, "work_pool": flow_run.work_pool_name,
                                    "seconds": flow_run.total_run_time.total_seconds(),
                                    # when the flow began, in seconds after its scheduled start
                                    "timeline_s": {"flow": round((flow_run.start_time - start_at).total_seconds(), 2)}}
            log(f"  {arm}/{end.island}: segment {flow_run.name} done on work pool {flow_run.work_pool_name} "
                f"in {segments[end.island]['seconds']:.1f} s")
        except BaseException as err:  # re-raised below, once every island has ended
            errors.append(err)

    # Prefect's traffic between the second island's worker and flow runs and the server: measured apart.
    began = datetime.now(timezone.utc)
    with ConnectionBytes(urlsplit(api_url).port, plan.ends[1].address) as control_plane:
        wall, measured = run_concurrently(plan, [(island, end) for end in plan.ends])
    if errors:
        raise errors[0]
    consensus = consolidate(spec, store)
    bpb = heldout_bpb(spec, store, layout.CONSOLIDATED)
    summaries = read_summaries(spec, store)
    round_ended: dict[int, float] = {}  # when the last learner ended each round (Unix seconds)
    for s in summaries:
        for r in s.rounds:
            round_ended[r["round"]] = max(round_ended.get(r["round"], 0.0), r["ended_at"])
    remote = [s for s in summaries if s.island != plan.server.island]
    computing = sum(s.seconds_computing for s in summaries)
    syncing = sum(s.seconds_syncing for s in summaries)
    parameters = build_model(spec).parameter_counts()["total"]
    # With one store for both islands, the link also carries the remote island's writes (messages,
    # checkpoints) and its reads of every partner, plus its shards at start-up. With a store per
    # island only what a learner reads from the other island's store crosses.
    one_store = all(island.store is None for island in spec.islands)
    payload = {"messages_written": sum(s.bytes_written for s in remote),
               "checkpoints_written": sum(s.checkpoint_bytes for s in remote),
               "messages_read": sum(s.bytes_read_intra + s.bytes_read_inter for s in remote),
               "shards_read": sum(shard_bytes[s.learner] for s in remote)} if one_store else None
    return {
        "run_id": run_id, "sync_mode": spec.sync.mode, "rounds": spec.sync.rounds, "learners": len(summaries),
        "tokens": sum(s.tokens for s in summaries),
        # From the segments' scheduled start, when both islands' flows began.
        "wall_seconds": wall - (start_at - began).total_seconds(), "segments": segments,
        "inter_island_bytes_measured": measured,
        "control_plane_bytes": control_plane.total,
        "inter_island_bytes_counted": sum(s.bytes_read_inter for s in summaries),
        # Requests across the link with a store per island: per message read, its commit (brought by
        # the last of its polls) and its parts.
        "inter_island_messages_read": sum(s.links["inter"]["messages_read"] for s in summaries),
        "inter_island_polls": sum(s.links["inter"]["polls"] for s in summaries),
        "remote_island_store_payload": payload,
        "per_store": store_bytes(summaries),
        # The link less Prefect's traffic and what island-local checkpoints and shards keep off it: the
        # exchanges as the store placement carries them (with HTTP, polling and TCP overhead).
        "inter_island_bytes_exchanges": measured["total"] - control_plane.total - (
            payload["checkpoints_written"] + payload["shards_read"] if payload else 0),
        "project_allreduce_estimate_bytes": allreduce_equivalent(
            spec, parameters, BaselinePlan.of(spec).steps)["inter_island_bytes"],
        "seconds_computing": computing, "seconds_syncing": syncing,
        "utilisation": steady_utilisation(summaries),
        "round_ends_s": round_ends(summaries),
        "utilisation_round_loop": computing / (computing + syncing),
        "bpb": bpb,
        # The islands' model along the run, on every held-out byte, with when its round ended after the
        # segments' scheduled start: when they reach a bpb (benchmarks.shaped_link's time to quality).
        "heldout_curve": [{**point, "seconds": round(round_ended[point["round"]] - start_at.timestamp(), 2)}
                          for point in islands_heldout_curve(spec, store)],
        "consensus": {k: consensus[k] for k in ("max_weight_distance", "max_pairwise_distance")},
        "missed_exchanges": sum(len(s.missed_exchanges) for s in summaries),
        "store_retries": sum(s.store.get("retries", 0) for s in summaries),
    }


def outage_drill(job: dict, plan: LinkPlan, island_stores: dict, island_servers: dict, endpoint_url: str,
                 api_url: str) -> dict:
    """The butterfly arm once more, with the last island's own store frozen (SIGSTOP: its connections
    stay open and nothing answers) `outage_s` seconds from `outage_after_s` after the learners start,
    then thawed: its partners record missed exchanges, its own learners wait and retry."""
    island = plan.ends[-1].island
    if island not in island_servers:
        raise SystemExit("--outage-s needs the islands' own stores (drop --one-store)")
    pid = island_servers[island].pid
    from infra.spec import parse_spec

    raw = arm_spec(job["configs"]["butterfly"], job["rounds"], endpoint_url, island_stores,
                   job["checkpoint_every"]).model_dump(mode="json")
    # A partner that cannot be reached for this long is an exchange missed, not a round stalled.
    spec = parse_spec({**raw, "sync": {**raw["sync"], "partner_timeout_s": OUTAGE_PARTNER_TIMEOUT_S}})
    window: dict[str, float] = {}
    began = time.monotonic()

    def freeze_then_thaw() -> None:
        time.sleep(job["outage_after_s"])
        os.killpg(pid, signal.SIGSTOP)
        window["from_s"] = time.monotonic() - began
        try:
            time.sleep(job["outage_s"])
        finally:
            os.killpg(pid, signal.SIGCONT)
            window["to_s"] = time.monotonic() - began

    log(f"outage drill: {island}'s store frozen {job['outage_s']} s from {job['outage_after_s']} s into the run")
    drill = threading.Thread(target=freeze_then_thaw, daemon=True)
    drill.start()
    try:
        result = run_islands(spec, plan, OUTAGE_ARM, api_url)
    finally:
        drill.join()
    result["outage"] = {"island": island, **window, "seconds": window["to_s"] - window["from_s"]}
    log(f"outage drill done: {json.dumps(headline(result))}, missed exchanges {result['missed_exchanges']}, "
        f"store retries {result['store_retries']}")
    return result


def steady_utilisation(summaries: list) -> float:
    """Compute seconds over wall seconds once every learner has finished its first round: for each
    learner, from the end of its first round that ends at or after that moment to the end of its
    last, with every inner step, exchange, outer step and checkpoint in between. Left out is start-up:
    Prefect's flow runs (each island's worker picks its segment up at its own next poll), imports,
    shards, and the wait of a learner that started early for partners that had not."""
    everyone_started = max(s.rounds[0]["ended_at"] for s in summaries)
    computing = wall = 0.0
    for s in summaries:
        steady = [r for r in s.rounds if r["ended_at"] >= everyone_started]
        computing += sum(r["compute_s"] for r in steady[1:])
        wall += steady[-1]["ended_at"] - steady[0]["ended_at"]
    return computing / wall


def round_ends(summaries: list) -> dict[int, dict]:
    """Each learner's start (its first life's record) and round end times, in seconds after the first
    learner's first round ended."""
    zero = min(s.rounds[0]["ended_at"] for s in summaries)
    return {s.learner: {"started": round(datetime.fromisoformat(s.lives[0]["started_at"]).timestamp() - zero, 2),
                        "rounds": [round(r["ended_at"] - zero, 2) for r in s.rounds]} for s in summaries}


def relay(prefix: str):
    def on_line(line: str) -> None:
        print(f"  {prefix} {line}", flush=True)
    return on_line


def run_standard(spec, plan: LinkPlan, max_steps: int | None) -> dict:
    from eval.evaluate import heldout_bpb
    from infra import layout

    run_id, store, _ = new_run(spec, "standard")
    port = free_port(plan.server.address)
    threads = dp_threads(len(plan.ends))
    summaries: dict[int, dict] = {}
    loop_counters: dict[str, dict] = {}
    failures: list[str] = []

    def rank(index: int, end: IslandEnd) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
               "MASTER_ADDR": plan.server.address, "MASTER_PORT": str(port), "RANK": str(index),
               "WORLD_SIZE": str(len(plan.ends)), "GLOO_SOCKET_IFNAME": end.device}
        command = [*plan.exec_in(end.island), sys.executable, "-m", "benchmarks.allreduce_dp", "--store", spec.store.url,
                   "--endpoint-url", spec.store.endpoint_url, "--run-id", run_id, "--island", end.island,
                   "--threads", str(threads)] + (["--max-steps", str(max_steps)] if max_steps else [])
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            relay(f"standard/{end.island}/rank{index}")(line.rstrip("\n"))
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "started":
                    loop_counters["before"] = plan.counters()
                if event.get("event") == "summary":
                    summaries[index] = event
                    if index == 0:  # rank 0 reports after the last all-reduce; its commit stays on its island
                        loop_counters["after"] = plan.counters()
        if proc.wait():
            failures.append(f"rank {index} ({end.island}) exited with {proc.returncode}")

    wall, measured = run_concurrently(plan, [(rank, k, e) for k, e in enumerate(plan.ends)])
    if failures:
        raise RuntimeError("; ".join(failures))
    first = summaries[0]
    run, planned = first["steps_run"], first["steps_planned"]
    scale = planned / run  # 1 unless --dp-max-steps asked for a measured subset
    loop = link_bytes(loop_counters["before"], loop_counters["after"], plan)
    loop_wall = max(s["seconds_wall"] for s in summaries.values())
    # Two ranks: the all-reduce sends the whole gradient buffer each way per step ((N-1)/N x 2 x size).
    counted = run * 2 * (len(plan.ends) - 1) * first["gradient_bytes_per_step"]
    computing = sum(s["seconds_computing"] for s in summaries.values())
    return {
        "run_id": run_id, "steps_run": run, "steps_planned": planned, "extrapolated": run < planned,
        "tokens": first["global_tokens"] * scale,
        # Start-up (imports, data over the link) once, the step loop scaled to every planned step.
        "wall_seconds": wall + loop_wall * (scale - 1), "wall_seconds_measured": wall,
        "inter_island_bytes_measured": {k: v + loop[k] * (scale - 1) for k, v in measured.items()},
        "inter_island_bytes_measured_raw": measured, "inter_island_bytes_step_loop": loop,
        "inter_island_bytes_counted": counted * scale,
        "inter_island_bytes_exchanges": loop["total"] * scale,
        "gradient_bytes_per_step": first["gradient_bytes_per_step"],
        "seconds_computing": computing,
        "seconds_communicating": sum(s["seconds_communicating"] for s in summaries.values()),
        # Each rank's compute over its step loop; waiting for the other island is not compute.
        "utilisation": computing / sum(s["seconds_wall"] for s in summaries.values()),
        "per_rank": summaries,
        "bpb": heldout_bpb(spec, store, layout.BASELINE) if run == planned else None,
    }
