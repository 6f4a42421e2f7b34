"""Three ways to train the same model across two islands joined by a real, rate-limited link.

Run as root, from the repository root:

    .venv/bin/python -m benchmarks.shaped_link \\
        [--standard configs/shaped-allreduce.yaml] [--allreduce configs/shaped-allreduce.yaml] \\
        [--butterfly configs/shaped-butterfly-streaming.yaml] [--rounds N] [--rate-mbit R] [--dp-max-steps N] \\
        [--repeats 3] [--one-store]

Arms, all on one link and one data preparation recipe, in this order:
  standard   per-step all-reduce data parallelism: one gloo process per island, each training on its
             island's shards, summing gradients over the link after every step (`benchmarks.allreduce_dp`);
             the same model, data and tokens as the standard baseline (it uses `training.baseline`'s
             plan). Its model is built from the `--standard` config's islands, model and data.
  allreduce  DiLoCo: learners exchange pseudo-gradients through the store once per round.
  butterfly  pairwise exchange with partner i XOR 2^s. The arm is whatever `--butterfly` configures,
             so fragments, overlap and compression are a change of that YAML file only.

The network. Each island is a network namespace (`arch-<tag>-<island>`); one veth pair joins them and
`tc tbf` shapes BOTH directions of it to the same rate. Nothing else is connected: every byte that
moves between the islands crosses that pair, so its interface counters (read inside the namespace)
are the inter-island bytes, headers included. A benchmark process never touches the host's interfaces.

The stores. The run's SeaweedFS S3 endpoint runs in the first island's namespace, bound to that
island's veth address; by default every other island gets a SeaweedFS of its own in its namespace,
with its own credentials (`islands[].store`, see infra/stores.py), so its learners' shards,
checkpoints and messages stay on its side and only what a learner reads from the other island's
store crosses the link. `--one-store` puts every island on the first island's store instead, as a
single bucket at one site would: then the remote island's checkpoint writes, message writes and
shard reads cross the link too, and the results split them out.

The sites. A Prefect server runs in the first island's namespace, bound to its end of the link, and
each island has its own process worker, started inside its namespace, polling that server (the
second island's worker over the link). An islands arm asks for a run of each island's `segment`
deployment, the one `make ui` registers; the island's worker executes it and its learners start
there, so the driver never launches a learner, and Prefect's own traffic (polls, task states, logs)
crosses the link and is counted in its bytes. Each island's worker, and with it its segments and
learners, runs on cores of its own (half the machine's), as separate sites' would; the servers run
on any. The standard arm's two gloo ranks are not learners:
the driver starts each inside its island's namespace. Each arm runs `--repeats` times
(default 3), arm by arm within each repeat, and the results keep every run's figures.

The rate. Scaling the brief literally (32 B parameters over 25 Gbit/s, i.e. 0.78 bit/s per
parameter) gives this 0.44 M-parameter model 0.35 Mbit/s: one fp32 copy of the model then takes 41 s
to cross, several hundred of our inner steps, and the per-step all-reduce arm alone would need hours.
That scaling also assumes our steps take as long as the brief's, which they do not. What decides
utilisation is the link against what the traffic needs in the time compute takes, so we keep THAT
ratio instead: Streaming DiLoCo (arXiv 2501.18512) finds that per-step data parallelism needs 100 to
300 Gbit/s for 95% compute utilisation at the scales the brief works at, so the brief's 25 Gbit/s is
25 / sqrt(100 x 300) = 1/6.9 of what data parallelism needs. Here we measure what our per-step
all-reduce needs for 95% (its gradient bytes each way per step, in 5/95 of a measured step's compute
on this machine) and shape the link to the same 1/6.9 of it. Per-step data parallelism is then as
starved on this link as on the brief's. `--rate-mbit` overrides; the literal figure is recorded too.
No latency is added (netem is not available here): the link is narrow, not long.

Sizing. The benchmark configs are the demo with fewer rounds (`--rounds` overrides all arms) so the three
arms fit in about 20 minutes on two shared cores; `--dp-max-steps N` runs only the first N steps of
the standard arm and extrapolates its wall time and bytes linearly (its bpb is then not reported).

Results go to benchmarks/results/shaped_link.json (`--out`) and its page in docs/results/. Teardown (every
process left in the namespaces, the namespaces, and with them the veth pair) runs in `finally`, on
Ctrl-C and on SIGTERM. The orchestration runs inside the store's namespace (`--drive`, internal).

This module is the command line and the driver; the link-rate arithmetic is in `benchmarks.link_rates`,
the islands' places on the link in `benchmarks.link_sites`, and the arms' runs in `benchmarks.link_arms`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.link_arms import OUTAGE_ARM, outage_drill, run_islands, run_standard
from benchmarks.link_rates import (TARGET_UTILISATION, brief_scaled_rate_bps, calibrate_step_seconds, dp_matched_rate_bps,
                              dp_need_bps, predict, predict_standard)
from benchmarks.link_sites import arm_spec, credentials_env, island_sites, warm_data_cache
from benchmarks.netns import IslandEnd, LinkPlan, existing_namespaces, log, require_root_and_tools, run_checked, teardown
from benchmarks.results_page import provenance
from benchmarks.shaped_link_report import headline, write_reports

FP32 = 4
RESULTS = Path("benchmarks/results")


# -- root-side: build the link, run the driver -------------------------------------------------------

def interrupt(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` (server, namespaces) runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--standard", default="configs/shaped-allreduce.yaml",
                        help="config of the per-step all-reduce arm (its islands, model, data)")
    parser.add_argument("--allreduce", default="configs/shaped-allreduce.yaml", help="config of the DiLoCo arm")
    parser.add_argument("--butterfly", default="configs/shaped-butterfly-streaming.yaml",
                        help="config of the butterfly arm (default: fragments, overlap, int4 with error feedback)")
    parser.add_argument("--arms", default="standard,allreduce,butterfly", help="which arms to run, in order")
    parser.add_argument("--rounds", type=int, default=None, help="override every arm's sync.rounds")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="override the islands arms' training.checkpoint_every (default: each config's)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate; default matched to the brief")
    parser.add_argument("--dp-utilisation", type=float, default=None,
                        help="shape the link so that per-step all-reduce computes this share of the time (e.g. 0.15, "
                             "as a 32B model's data parallelism over 25 Gbit/s would), from the step calibrated here")
    parser.add_argument("--dp-max-steps", type=int, default=None,
                        help="run only this many standard-arm steps and extrapolate its wall time and bytes")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved arm by arm")
    parser.add_argument("--one-store", action="store_true",
                        help="every island on the first island's store (default: each island its own SeaweedFS)")
    parser.add_argument("--outage-s", type=float, default=0,
                        help="after the arms, run the butterfly arm once more with the last island's store "
                             "frozen this many seconds (the outage drill)")
    parser.add_argument("--outage-after-s", type=float, default=15,
                        help="when the drill's outage starts, in seconds after its segments are asked for")
    parser.add_argument("--out", default=str(RESULTS / "shaped_link.json"))
    parser.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        try:
            return drive(json.loads(Path(args.drive).read_text()))
        except KeyboardInterrupt:
            return 130  # the root side tears everything down

    require_root_and_tools()
    from infra.spec import load_spec
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"standard", "allreduce", "butterfly"}
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {sorted(unknown)}")
    if args.outage_s and ("butterfly" not in arms or args.one_store):
        raise SystemExit("--outage-s: the drill reruns the butterfly arm on the islands' own stores; "
                         "keep butterfly in --arms and drop --one-store")
    configs = {arm: getattr(args, arm) for arm in arms}
    specs = {arm: load_spec(path) for arm, path in configs.items()}  # bad configs fail here, named
    islands = {arm: [i.name for i in spec.islands] for arm, spec in specs.items()}
    if len({tuple(v) for v in islands.values()}) != 1:
        raise SystemExit(f"every arm must have the same islands; got {islands}")
    reference = next(iter(specs.values()))
    warm_data_cache(specs.values())  # the namespaces have no route to the package index

    from training.model.registry import build_model
    parameters = build_model(reference).parameter_counts()["total"]
    step_seconds = calibrate_step_seconds(reference)
    matched = dp_matched_rate_bps(parameters * FP32, step_seconds)
    if args.rate_mbit and args.dp_utilisation:
        raise SystemExit("--rate-mbit and --dp-utilisation both set the rate: give one")
    rate = args.rate_mbit * 1e6 if args.rate_mbit else \
        dp_need_bps(parameters * FP32, step_seconds, args.dp_utilisation) if args.dp_utilisation else matched
    chosen = "override" if args.rate_mbit else f"dp_utilisation {args.dp_utilisation}" if args.dp_utilisation \
        else "dp_matched"
    rate_info = {"rate_bps": int(rate), "chosen": chosen,
                 "dp_matched_rate_bps": matched, "brief_literal_rate_bps": brief_scaled_rate_bps(parameters),
                 "dp_need_at_95pct_bps": dp_need_bps(parameters * FP32, step_seconds),
                 "calibrated_step_seconds": step_seconds, "parameters": parameters}
    log(f"{parameters:,} parameters; a global step takes {step_seconds:.3f} s here; per-step DP needs "
        f"{rate_info['dp_need_at_95pct_bps'] / 1e6:.1f} Mbit/s for 95%; link shaped to {rate / 1e6:.2f} Mbit/s "
        f"(literal brief scaling: {rate_info['brief_literal_rate_bps'] / 1e6:.3f} Mbit/s)")

    plan = LinkPlan.for_islands(islands[arms[0]], rate)
    plan.validate(existing_namespaces())
    workdir = Path(tempfile.mkdtemp(prefix="arch-shaped-"))
    job = {"plan": asdict(plan), "arms": arms, "configs": configs, "rounds": args.rounds,
           "repeats": args.repeats, "island_stores": not args.one_store,
           "dp_max_steps": args.dp_max_steps, "rate": rate_info, "workdir": str(workdir),
           "outage_s": args.outage_s, "outage_after_s": args.outage_after_s,
           "checkpoint_every": args.checkpoint_every,
           "out": str(Path(args.out).resolve())}
    (workdir / "job.json").write_text(json.dumps(job))
    driver = None
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        for command in plan.setup_commands():
            run_checked(command)
        log(f"link up: {plan.ends[0].namespace} {plan.ends[0].address} <-> {plan.ends[1].address} "
            f"{plan.ends[1].namespace}, tbf {rate / 1e6:.2f} Mbit/s each way")
        driver = subprocess.Popen([*plan.exec_in(plan.server.island), sys.executable, "-m", "benchmarks.shaped_link",
                                   "--drive", str(workdir / "job.json")], start_new_session=True)
        code = driver.wait()
        if code:
            raise SystemExit(f"the benchmark driver failed (exit status {code}); see its output above")
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        return 130
    finally:
        teardown(plan, driver)
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    return 0


# -- inside the store's namespace: the arms --------------------------------------------------------

def drive(job: dict) -> int:
    from infra.seaweed import seaweed_server

    signal.signal(signal.SIGTERM, interrupt)
    plan = LinkPlan(tag=job["plan"]["tag"], ends=tuple(IslandEnd(**e) for e in job["plan"]["ends"]),
                    rate_bps=job["plan"]["rate_bps"])
    started = time.monotonic()
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(seaweed_server(Path(job["workdir"]) / "seaweed", host=plan.server.address))
        os.environ.update(server.env())
        log(f"S3 endpoint {server.endpoint_url} in {plan.server.namespace}")
        island_stores, island_servers = {}, {}
        if job["island_stores"]:
            for end in plan.ends[1:]:  # the first island keeps its objects in the run's store, beside it
                own = servers.enter_context(seaweed_server(
                    Path(job["workdir"]) / f"seaweed-{end.island}", buckets=(end.island,), host=end.address,
                    wrapper=plan.exec_in(end.island)))
                prefix = credentials_env(end.island)
                os.environ.update({f"{prefix}_AWS_ACCESS_KEY_ID": own.access_key,
                                   f"{prefix}_AWS_SECRET_ACCESS_KEY": own.secret_key})
                island_stores[end.island] = {"url": f"s3://{end.island}/shaped", "endpoint_url": own.endpoint_url,
                                             "credentials_env": prefix}
                island_servers[end.island] = own
                log(f"S3 endpoint {own.endpoint_url} in {end.namespace}: island {end.island}'s own store")
        profile_store = {"url": "s3://archipelago/profile", "endpoint_url": server.endpoint_url}
        predicted = {arm: predict(arm_spec(job["configs"][arm], job["rounds"], server.endpoint_url, island_stores,
                                           job["checkpoint_every"]),
                                  plan.rate_bps, profile_store) for arm in job["arms"] if arm != "standard"}
        if "standard" in job["arms"] and predicted:
            predicted["standard"] = predict_standard(
                arm_spec(job["configs"]["standard"], job["rounds"], server.endpoint_url, {}), plan.rate_bps,
                job["rate"]["calibrated_step_seconds"], predicted.get("allreduce", next(iter(predicted.values()))))
        islands_arms = [arm for arm in job["arms"] if arm != "standard"]
        api_url = servers.enter_context(island_sites(plan, arm_spec(
            job["configs"][islands_arms[0]], job["rounds"], server.endpoint_url, island_stores),
            Path(job["workdir"]))) if islands_arms else None
        runs: dict[str, list[dict]] = {arm: [] for arm in job["arms"]}
        ran = {}
        for repeat in range(job["repeats"]):  # arm by arm within a repeat, so arms compare side by side
            for arm in job["arms"]:
                spec = arm_spec(job["configs"][arm], job["rounds"], server.endpoint_url,
                                island_stores if arm != "standard" else {},
                                job["checkpoint_every"] if arm != "standard" else None)
                ran[arm] = spec
                log(f"arm {arm}, run {repeat + 1}/{job['repeats']}: {job['configs'][arm]}, {spec.sync.rounds} rounds")
                result = run_standard(spec, plan, job["dp_max_steps"]) if arm == "standard" else \
                    run_islands(spec, plan, arm, api_url)
                runs[arm].append(result)
                log(f"arm {arm} run {repeat + 1} done: {json.dumps(headline(result))}")
        if job["outage_s"]:
            runs[OUTAGE_ARM] = [outage_drill(job, plan, island_stores, island_servers, server.endpoint_url, api_url)]
    configs = {**job["configs"], OUTAGE_ARM: job["configs"].get("butterfly")}
    results = {arm: {**arm_result(configs[arm], arm_runs), **({"predicted": predicted[arm]} if arm in predicted
                                                                     else {})} for arm, arm_runs in runs.items()}
    for arm, spec in ran.items():  # what each arm ran, so a reader need not trust its config file unchanged
        results[arm]["settings"] = spec.model_dump(mode="json", include={"model", "training", "sync"})
    results_targets = targets(results)
    document = {**provenance(), "time_to_quality_ratio": results_targets.get("time_to_quality", {}).get("ratio"),
                "link": {**job["rate"], "plan": job["plan"], "store_island": plan.server.island,
                         "island_stores": sorted(island_stores)},
                "arms": results, "targets": results_targets, "bench_seconds": time.monotonic() - started}
    out = Path(job["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(write_reports(document, out), flush=True)
    return 0


def arm_result(config: str, runs: list[dict]) -> dict:
    """An arm's runs, and per run the figures its targets are judged on (lists, in run order)."""
    return {"config": config, "runs": runs,
            "wall_s": [r["wall_seconds"] for r in runs],
            "link_bytes": [r["inter_island_bytes_measured"]["total"] for r in runs],
            "exchange_bytes_counted": [r["inter_island_bytes_counted"] for r in runs],
            "utilisation": [r["utilisation"] for r in runs]}


def targets(results: dict) -> dict:
    """The targets, judged on each arm's median over its runs."""
    def median(arm: str, figure) -> float:
        return statistics.median(figure(r) for r in results[arm]["runs"])

    out = {}
    if "standard" in results and "butterfly" in results:
        out["butterfly_bytes_reduction_measured"] = (median("standard", lambda r: r["inter_island_bytes_measured"]["total"])
                                                     / median("butterfly", lambda r: r["inter_island_bytes_measured"]["total"]))
        out["butterfly_bytes_reduction_exchanges"] = (median("standard", lambda r: r["inter_island_bytes_exchanges"])
                                                      / median("butterfly", lambda r: r["inter_island_bytes_exchanges"]))
        counted = median("butterfly", lambda r: r["inter_island_bytes_counted"])
        out["butterfly_bytes_reduction_counted"] = (median("standard", lambda r: r["inter_island_bytes_counted"]) / counted
                                                    if counted else None)
        out["reduction_target"] = 500
        out["time_to_quality"] = time_to_quality(results["standard"]["runs"], results["butterfly"]["runs"])
    if "butterfly" in results:
        out["butterfly_utilisation"] = statistics.median(results["butterfly"]["utilisation"])
        out["utilisation_target"] = TARGET_UTILISATION
        out["butterfly_link_over_exchanges"] = statistics.median(
            link / counted for link, counted in zip(results["butterfly"]["link_bytes"],
                                                    results["butterfly"]["exchange_bytes_counted"]))
        out["butterfly_link_less_prefect_over_exchanges"] = statistics.median(
            (r["inter_island_bytes_measured"]["total"] - r["control_plane_bytes"]) / r["inter_island_bytes_counted"]
            for r in results["butterfly"]["runs"])
    return out


def time_to_quality(standard_runs: list[dict], islands_runs: list[dict]) -> dict:
    """How long the islands take to reach per-step all-reduce's final held-out bpb on every evaluation, over
    that standard run's own wall time (medians over runs). An islands run reaches a bpb where its held-out
    curve crosses it, linearly between curve points; one that never does gives None, and `final_gap` says
    by how much its last point missed (its bpb over the target, less one, on the worst evaluation)."""
    finals = [r["bpb"] for r in standard_runs if r.get("bpb")]
    if not finals or not all(r.get("heldout_curve") for r in islands_runs):
        return {"ratio": None, "why": "the standard arm ran a subset of its steps (--dp-max-steps) or the islands "
                                      "arm kept no held-out curve: no bpb to reach, or no times to reach it"}
    target = {e: statistics.median(f[e] for f in finals) for e in finals[0]}
    standard_wall = statistics.median(r["wall_seconds"] for r in standard_runs if r.get("bpb"))

    def reached_at(curve: list[dict], evaluation: str) -> float | None:
        for before, point in zip([None, *curve], curve):
            if point["bpb"][evaluation] <= target[evaluation]:
                if before is None:
                    return point["seconds"]
                fall = (before["bpb"][evaluation] - target[evaluation]) / (before["bpb"][evaluation] - point["bpb"][evaluation])
                return before["seconds"] + fall * (point["seconds"] - before["seconds"])
        return None

    seconds = []
    for run in islands_runs:
        per_evaluation = [reached_at(run["heldout_curve"], e) for e in target]
        seconds.append(None if None in per_evaluation else max(per_evaluation))
    final_gap = max(statistics.median(r["heldout_curve"][-1]["bpb"][e] for r in islands_runs) / target[e] - 1
                    for e in target)
    reached = [s for s in seconds if s is not None]
    return {"ratio": statistics.median(reached) / standard_wall if len(reached) == len(seconds) else None,
            "islands_seconds": seconds, "standard_wall_s": standard_wall, "target_bpb": target,
            "final_gap": final_gap}


if __name__ == "__main__":
    sys.exit(main())
