"""Three ways to train the same model across two islands joined by a real, rate-limited link.

Run as root, from the repository root:

    .venv/bin/python -m bench.shaped_link \\
        [--standard configs/shaped-allreduce.yaml] [--allreduce configs/shaped-allreduce.yaml] \\
        [--butterfly configs/shaped-butterfly-streaming.yaml] [--rounds N] [--rate-mbit R] [--dp-max-steps N] \\
        [--repeats 3] [--one-store]

Arms, all on one link and one data preparation recipe, in this order:
  standard   per-step all-reduce data parallelism: one gloo process per island, each training on its
             island's shards, summing gradients over the link after every step (`bench.allreduce_dp`);
             the same model, data and tokens as the standard baseline (it uses `training.baseline`'s
             plan). Its model is built from the `--standard` config's islands, model and data.
  allreduce  DiLoCo: learners exchange pseudo-gradients through the store once per round.
  butterfly  pairwise exchange with partner i XOR 2^s. The arm is whatever `--butterfly` configures,
             so fragments, overlap and compression are a change of that YAML file only.

The network. Each island is a network namespace (`arch-<tag>-<island>`); one veth pair joins them and
`tc tbf` shapes BOTH directions of it to the same rate. Nothing else is connected: every byte that
moves between the islands crosses that pair, so its interface counters (read inside the namespace)
are the inter-island bytes, headers included. A bench process never touches the host's interfaces.

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

Sizing. The bench configs are the demo with fewer rounds (`--rounds` overrides all arms) so the three
arms fit in about 20 minutes on two shared cores; `--dp-max-steps N` runs only the first N steps of
the standard arm and extrapolates its wall time and bytes linearly (its bpb is then not reported).

Results go to bench/results/shaped_link.json and bench/results/shaped_link.md. Teardown (every
process left in the namespaces, the namespaces, and with them the veth pair) runs in `finally`, on
Ctrl-C and on SIGTERM. The orchestration runs inside the store's namespace (`--drive`, internal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

from bench.harness import new_run
from bench.netns import (ConnectionBytes, IslandEnd, LinkPlan, existing_namespaces, link_bytes, log, require_root_and_tools, run_checked,
                         run_concurrently, teardown)
from bench.shaped_link_report import headline, write_reports

BRIEF_PARAMETERS = 32e9
BRIEF_LINK_BPS = 25e9
# Streaming DiLoCo: per-step data parallelism needs 100-300 Gbit/s for 95% compute utilisation.
BRIEF_DP_NEED_BPS = math.sqrt(100e9 * 300e9)
TARGET_UTILISATION = 0.95
FP32 = 4
RESULTS = Path("bench/results")
OUTAGE_ARM = "butterfly-outage"
OUTAGE_PARTNER_TIMEOUT_S = 5.0
# Prefect across the link, for the second island: its worker polls every 10 s (its runs are scheduled
# ahead, so a quicker poll only starts their processes sooner) and its flow runs ship logs in 10 s
# batches (Prefect's default, 2 s, is a request every 2 s while learners log every round).
WORKER_POLL_S = 10
LOG_BATCH_S = 10
# An islands arm schedules both islands' segments this far ahead, as a capacity window's start would,
# and the workers prefetch that far: each picks its run up at its next poll and starts its process
# (imports take seconds on busy cores), and Prefect holds both flows to the same start. Started as
# soon as each worker polled, or picked up only 10 s ahead (Prefect's default prefetch), one island
# began up to 8 s after the other, and its partners spent those seconds polling for it across the link.
SEGMENT_LEAD_S = 30.0
# Prefect's server, workers and flow-run processes would run on hosts' CPUs beside the accelerators,
# not on them; here they share the learners' cores. Each starts its own session, and the kernel
# shares CPU between sessions (autogroups) before processes, so the session gets the lowest priority:
# it takes what the learners leave. Learners start sessions of their own, at the normal priority.
# With the islands' processes on the same cores, one island's learners, started first, left the other
# island's segment (at that priority) next to no CPU until they waited on it: the second island's
# learners began 6 to 10 s after the first's. Hence `island_cores`.
CONTROL_PLANE_PRIORITY = ("sh", "-c", 'echo 19 > /proc/self/autogroup && exec "$@"', "control-plane")


# -- rate arithmetic ------------------------------------------------------------------------------

def brief_scaled_rate_bps(parameters: int) -> float:
    """The link rate that keeps the brief's ratio of model size to bandwidth (32 B params : 25 Gbit/s)."""
    return parameters * BRIEF_LINK_BPS / BRIEF_PARAMETERS


def dp_need_bps(bytes_each_way_per_step: float, step_seconds: float,
                utilisation: float = TARGET_UTILISATION) -> float:
    """The rate at which a per-step all-reduce's transfer takes (1 - u) / u of a step's compute time,
    i.e. the slowest link on which data parallelism still reaches compute utilisation u."""
    if not 0 < utilisation < 1:
        raise ValueError(f"utilisation must be in (0, 1), got {utilisation}")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    return bytes_each_way_per_step * 8 / (step_seconds * (1 - utilisation) / utilisation)


def dp_matched_rate_bps(bytes_each_way_per_step: float, step_seconds: float) -> float:
    """The link rate that stands to our per-step all-reduce's need as 25 Gbit/s stands to the brief's."""
    return dp_need_bps(bytes_each_way_per_step, step_seconds) * BRIEF_LINK_BPS / BRIEF_DP_NEED_BPS


# -- root-side: build the link, run the driver -------------------------------------------------------

def interrupt(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` (server, namespaces) runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def calibrate_step_seconds(spec, repeats: int = 5) -> float:
    """Median seconds of one per-step all-reduce step's compute here: forward, backward and AdamW on
    the largest island's share of the global batch (the baseline spreads each shard's rows evenly
    over its steps), with the threads each of its ranks gets."""
    import torch
    from training.baseline import BaselinePlan, baseline_optimizer
    from training.model.gpt import build_model

    torch.set_num_threads(dp_threads(len(spec.islands)))
    model = build_model(spec)
    optimizer = baseline_optimizer(spec, model)
    plan = BaselinePlan.of(spec)
    rows = max(-(-sum(r for r, s in zip(plan.planned_rows, plan.slots) if s.island.name == i.name) // plan.steps)
               for i in spec.islands)
    data = torch.randint(0, 256, (rows, spec.max_seq_len + 1))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model.loss(data[:, :-1], data[:, 1:]).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first step pays for allocation


def dp_threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


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
                        help="override the islands arms' sync.checkpoint_every (default: each config's)")
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

    from training.model.gpt import build_model
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
        driver = subprocess.Popen([*plan.exec_in(plan.server.island), sys.executable, "-m", "bench.shaped_link",
                                   "--drive", str(workdir / "job.json")], start_new_session=True)
        code = driver.wait()
        if code:
            raise SystemExit(f"the bench driver failed (exit status {code}); see its output above")
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        return 130
    finally:
        teardown(plan, driver)
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    return 0


def warm_data_cache(specs) -> None:
    from training.data.corpora import shakespeare_files
    if any(c.source == "shakespeare" for spec in specs for c in spec.data.corpora):
        shakespeare_files()


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
        for repeat in range(job["repeats"]):  # arm by arm within a repeat, so arms compare side by side
            for arm in job["arms"]:
                spec = arm_spec(job["configs"][arm], job["rounds"], server.endpoint_url,
                                island_stores if arm != "standard" else {},
                                job["checkpoint_every"] if arm != "standard" else None)
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
    document = {"link": {**job["rate"], "plan": job["plan"], "store_island": plan.server.island,
                         "island_stores": sorted(island_stores)},
                "arms": results, "targets": targets(results), "bench_seconds": time.monotonic() - started}
    out = Path(job["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(write_reports(document, out), flush=True)
    return 0


def predict(spec, rate_bps: float, store: dict) -> dict:
    """The planner's figures for an islands arm, from a profiling run of its learners here, against
    `store` at local speed, before any run on the link (`training.planning.profile`)."""
    from training.planning.planner import plan_run
    from training.planning.profile import profile_run

    profile = profile_run(spec, store)
    planned = plan_run(spec, profile.step_seconds, rate_bps, profile.startup_s, profile.round_overhead_s,
                       profile.teardown_s)
    log(f"plan for {spec.name}: {json.dumps({k: planned[k] for k in ('utilisation', 'wall_s')})}, "
        f"profile {json.dumps(profile.to_json())}")
    return {"utilisation": planned["utilisation"], "wall_s": planned["wall_s"],
            "exchange_bytes": planned["exchange_bytes"]["inter"], "profile": profile.to_json(), "plan": planned}


def predict_standard(spec, rate_bps: float, step_seconds: float, islands_prediction: dict) -> dict:
    """The planner's figures for the per-step all-reduce arm: the step calibrated before the link went
    up, and the islands' profiled start-up and teardown (the same imports, spec and shards)."""
    from training.planning.planner import plan_data_parallel

    profile = islands_prediction["profile"]
    planned = plan_data_parallel(spec, step_seconds, rate_bps, profile["startup_s"], profile["teardown_s"])
    return {"utilisation": planned["utilisation"], "wall_s": planned["wall_s"],
            "exchange_bytes": planned["exchange_bytes"]["inter"], "plan": planned}


def credentials_env(island: str) -> str:
    return f"ISLAND_{island.upper().replace('-', '_')}"


def arm_result(config: str, runs: list[dict]) -> dict:
    """An arm's runs, and per run the figures its targets are judged on (lists, in run order)."""
    return {"config": config, "runs": runs,
            "wall_s": [r["wall_seconds"] for r in runs],
            "link_bytes": [r["inter_island_bytes_measured"]["total"] for r in runs],
            "exchange_bytes_counted": [r["inter_island_bytes_counted"] for r in runs],
            "utilisation": [r["utilisation"] for r in runs]}


def arm_spec(path: str, rounds: int | None, endpoint_url: str, island_stores: dict[str, dict],
             checkpoint_every: int | None = None):
    from infra.spec import load_spec, parse_spec
    raw = load_spec(path).model_dump(mode="json")
    raw["store"] = {**raw["store"], "url": "s3://archipelago/shaped", "endpoint_url": endpoint_url}
    for island in raw["islands"]:
        if island["name"] in island_stores:
            island["store"] = {**raw["store"], **island_stores[island["name"]]}
    if rounds:
        raw["sync"]["rounds"] = rounds
    if checkpoint_every:
        raw["sync"]["checkpoint_every"] = checkpoint_every
    return parse_spec(raw)


def relay(prefix: str):
    def on_line(line: str) -> None:
        print(f"  {prefix} {line}", flush=True)
    return on_line


def island_cores(n: int, islands: int) -> tuple[str, ...]:
    """A command prefix that keeps island `n`'s processes (its worker, segments and learners) on cores of
    its own, as separate sites' would be; with fewer cores than islands, none."""
    cores = os.cpu_count() or 1
    if cores < islands:
        return ()
    share = cores // islands
    return ("taskset", "-c", ",".join(str(c) for c in range(n * share, (n + 1) * share)))


@contextlib.contextmanager
def island_sites(plan: LinkPlan, spec, workdir: Path):
    """The islands as separate sites: a Prefect server in the first island's namespace, bound to its
    end of the link, and per island a worker polling that server from inside the island's own namespace
    (over the link, for the second island). The island's `segment` deployment, the one `make ui`
    registers, runs on that worker, so its learners start there. Yields the server's API URL."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.serve import api_auth_string, prefect_server, register, workers
    from tasks.segments import island_pool

    port = free_port(plan.server.address)
    auth_string = api_auth_string(workdir / "prefect-home")
    with prefect_server(port, workdir / "prefect-home", workdir, auth_string, host=plan.server.address,
                        wrapper=CONTROL_PLANE_PRIORITY) as api_url, \
            temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}):
        register(spec)
        pools = {island_pool(end.island): (*plan.exec_in(end.island), *island_cores(n, len(plan.ends)),
                                           *CONTROL_PLANE_PRIORITY) for n, end in enumerate(plan.ends)}
        # Not `make ui`'s 2 s: a poll from the second island crosses the link.
        with workers(list(pools), api_url, auth_string, workdir, wrappers=pools, query_seconds=WORKER_POLL_S,
                     prefetch_seconds=SEGMENT_LEAD_S + WORKER_POLL_S, log_batch_seconds=LOG_BATCH_S):
            log(f"Prefect server {api_url} in {plan.server.namespace}; a worker per island in its namespace: "
                f"{', '.join(pools)} (logs in {workdir})")
            yield api_url


def run_islands(spec, plan: LinkPlan, arm: str, api_url: str) -> dict:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from eval.evaluate import heldout_bpb
    from eval.report import allreduce_equivalent, store_bytes
    from infra import layout
    from tasks.segments import run_segment
    from training.baseline import BaselinePlan
    from training.consolidate import consolidate
    from training.learner.ledger import read_summaries
    from training.model.gpt import build_model

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
        "bpb": bpb, "consensus": {k: consensus[k] for k in ("max_weight_distance", "max_pairwise_distance")},
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


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


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
        command = [*plan.exec_in(end.island), sys.executable, "-m", "bench.allreduce_dp", "--store", spec.store.url,
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


if __name__ == "__main__":
    sys.exit(main())
