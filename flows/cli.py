"""`archipelago`: run, resume and inspect runs from the command line."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Literal

import yaml

from infra import layout
from infra.lease import LeaseHeld
from infra.spec import RunSpec, SpecError, check_windows_ahead, load_spec, parse_spec, spec_sha256
from infra.store import StoreError, run_store
from infra.store_spec import StoreSpec
from infra.stores import check_stores_reachable, open_run

# Ephemeral Prefect: no telemetry off the machine, and room for a slow first start (database migrations).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def preflight(spec: RunSpec) -> dict:
    """What a run is checked for before any work: its memory plan, per rank and per host (refused with
    the plan's figures and what would fit), that its stores answer, and that every path it names
    resolves under the data root. Returns the memory plan."""
    from training.data.corpora import check_data_paths
    from training.planning.fit import check_fits

    memory = check_fits(spec)
    check_stores_reachable(spec)
    check_data_paths(spec)
    return memory


def dry_run(spec: RunSpec) -> int:
    """`run --dry-run`: the `preflight` checks, then the model built on the meta device (its shapes, no
    memory) against the spec and the memory plan; prints what would run, and stops before Prefect or
    any training."""
    from tasks.planning import memory_markdown
    from training.planning.preflight import check_model_on_meta

    try:
        memory = preflight(spec)
        model = check_model_on_meta(spec, memory["parameters"])
    except (SpecError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(memory_markdown(memory) + "\n")
    print(f"run {spec.name}: model {spec.model.describe()}, {model['parameters']:,} parameters in "
          f"{model['blocks']} blocks (built on the meta device), {spec.sync.rounds} rounds of {spec.sync.mode}; "
          f"store {spec.store.url}")
    for island in spec.islands:
        options = [name for name in ("fsdp_mixed_precision", "activation_checkpointing") if getattr(island, name)]
        print(f"island {island.name}: {island.learners} learners of {island.processes_per_learner} {island.device} "
              f"processes on {island.nodes_per_learner} node(s), {island.parallelism}, {island.precision}"
              + (f", {', '.join(options)}" if options else "") + f"; {island.batch_size} sequences of "
              f"{island.seq_len} per step, {island.inner_steps} inner steps a round")
    print("dry run: every check passed; nothing was started")
    return 0


def _launch(spec: RunSpec, run_id: str, report_path: str | None) -> int:
    """Check the run (`preflight`) before any work, run the lifecycle, print the result table."""
    try:
        preflight(spec)
    except (SpecError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from eval.report import evaluation_table
    from flows.interrupts import exit_status, interruptible
    from flows.lifecycle import run_lifecycle
    from flows.temporary_server import ServerDidNotStart, prefect_api
    from infra.resumable import what_to_fix

    print(f"run {run_id}: store {spec.store.url}", flush=True)
    with interruptible(f"continue with: {resume_command(spec, run_id)}") as received:
        try:
            with prefect_api():
                state = run_lifecycle(spec, run_id, return_state=True)
                _print_stages(state.state_details.flow_run_id)
                report = state.result()
        except KeyboardInterrupt:
            signum = received[0] if received else signal.SIGINT
            print(f"\nrun {run_id} interrupted ({signum.name}): {_after_interrupt(spec, run_id)}", file=sys.stderr)
            return exit_status(signum)
        except ServerDidNotStart as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except LeaseHeld as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # noqa: BLE001 - the user needs the way back in, whatever failed
            print(f"\nrun {run_id} failed: {type(err).__name__}: {err}\n" + (
                what_to_fix(err) or f"completed stages are kept; continue with: {resume_command(spec, run_id)}"),
                file=sys.stderr)
            return 1
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=2))
    comm = report["communication"]
    print(f"\nrun {report['run_id']} ({report['sync_mode']}), {report['wall_seconds']:.0f} s")
    print(evaluation_table(report).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    standard = report["compute"]["baseline_tokens"]
    print(f"tokens: islands {report['compute']['islands_tokens']:,}, "
          + (f"standard {standard:,}" if standard is not None else "no standard training (evaluation.baseline: none)"))
    print(f"inter-island bytes {comm['inter_island_bytes']:,} vs per-step all-reduce "
          f"{comm['allreduce_equivalent_bytes']:,}; max weight distance {report['consensus']['max_weight_distance']:.4f}")
    if report["faults"]["injected"]:
        print(f"faults: {json.dumps(report['faults'])}")
    return 0


def _after_interrupt(spec: RunSpec, run_id: str) -> str:
    """What an interrupted run left behind, and how to go on from it."""
    try:
        started = open_run(spec, run_id, writer=None).exists(layout.SPEC)
    except StoreError:
        started = True  # the resume will say what is wrong with the store
    if not started:
        return "it had not started; there is nothing to resume"
    return f"its learners are stopped and its lease released; continue with: {resume_command(spec, run_id)}"


def resume_command(spec: RunSpec, run_id: str) -> str:
    """The command line that continues the run from its store."""
    endpoint = f" --endpoint-url {spec.store.endpoint_url}" if spec.store.endpoint_url else ""
    return f"archipelago resume {run_id} --store {spec.store.url}{endpoint}"


STAGE_VERBS = {"Completed": "ran", "Cached": "reused from an earlier attempt", "Failed": "failed"}


def _print_stages(flow_run_id) -> None:
    """Which stages this attempt ran, which it took from an earlier attempt's results, which failed."""
    from flows.lifecycle import stage_states

    by_state: dict[str, list[str]] = {}
    for name, state in stage_states(flow_run_id).items():
        by_state.setdefault(state, []).append(name)
    print(f"\nstages of flow run {flow_run_id}:")
    for state, names in sorted(by_state.items()):
        print(f"  {STAGE_VERBS.get(state, state.lower())}: {', '.join(sorted(names))}")


def load_spec_or_say_why(path: str, purpose: Literal["train", "plan"] = "train",
                         overrides: Sequence[str] = ()) -> RunSpec | None:
    try:
        return load_spec(path, purpose, overrides)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    try:
        check_windows_ahead(spec, datetime.now(timezone.utc))
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if any(island.windows for island in spec.islands):
        print("note: capacity windows are kept by runs started from the `lifecycle` deployment "
              "(archipelago serve); `run` trains every island now", file=sys.stderr)
    if args.dry_run:
        return dry_run(spec)
    from training.stages import new_run_id

    return _launch(spec, new_run_id(spec), args.report)


def resume(args: argparse.Namespace) -> int:
    """Continue a run from its store: completed stages come back from their persisted results,
    learners restart from their newest checkpoints. With `--config`, the spec is the user's file and
    the store's copy must be that spec (signed by the control plane when it has keys); without, the
    store's copy is taken as it is."""
    try:
        if args.config:
            spec = load_spec(args.config, overrides=args.overrides)
            stored = open_run(spec, args.run_id, writer=None).get_json(layout.SPEC)
            if spec_sha256(stored) != spec_sha256(spec):
                print(f"error: cannot resume {args.run_id}: its store holds another spec than {args.config}",
                      file=sys.stderr)
                return 2
        else:
            store = run_store(StoreSpec(url=args.store, endpoint_url=args.endpoint_url), args.run_id)
            spec = RunSpec.model_validate(store.get_json(layout.SPEC))
    except (StoreError, ValueError) as err:  # ValueError: pydantic's and SpecError, for bad input
        print(f"error: cannot resume {args.run_id}: {err}", file=sys.stderr)
        return 2
    return _launch(spec, args.run_id, args.report)


def prepare(args: argparse.Namespace) -> int:
    """Only the data preparation of a run spec, into the store under a fresh `prepare-` run id: to see
    the splits (and their near-duplicate groups) before spending compute on training."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    raw = spec.model_dump(mode="json")
    if args.seed is not None:
        raw["seed"] = args.seed
    if args.store is not None:
        raw["store"]["url"] = args.store
    try:
        spec = parse_spec(raw)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from training.data.corpora import check_data_paths
    from training.data.shards import prepare_dataset
    from training.stages import start_run

    run_id = f"prepare-{spec.name}-{secrets.token_hex(8)}"
    try:
        check_data_paths(spec)
        store = start_run(spec, run_id)
        manifest = prepare_dataset(spec, store)
    except (StoreError, ValueError, OSError, RuntimeError) as err:
        print(f"error: data preparation failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(f"run {run_id}: data split with split_seed {spec.data.split_seed} (seed {spec.seed})")
    for name, corpus in manifest["corpora"].items():
        validation = manifest["validation"].get(name, {"documents": 0, "bytes": 0})
        heldout = manifest["heldout"][name]
        print(f"  {name}: {corpus['documents']} documents; train {corpus['train_documents']} ({corpus['train_bytes']:,} "
              f"bytes), validation {validation['documents']} ({validation['bytes']:,} bytes), held-out "
              f"{heldout['documents']} ({heldout['bytes']:,} bytes); near-duplicates: "
              f"{corpus['near_duplicate_documents']} documents merged into {corpus['near_duplicate_groups']} groups")
    print(f"manifest: {store.address(layout.DATA_MANIFEST)}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """What a run will deliver on a link, before paying for it: per island and for the run; first,
    each island's memory per rank, and a refusal if its ranks would not fit its accelerators."""
    spec = load_spec_or_say_why(args.config, "train" if args.profile_run else "plan", args.overrides)
    if spec is None:
        return 2
    from tasks.planning import plan_markdown, windows_markdown
    from training.planning.windows import WindowsTooShort
    from training.planning.planner import complete_step_seconds, plan_run
    from training.planning.profile import ProfilingFailed, check_profiling_fits_here, profile_run

    given = {}
    for item in args.step_seconds:
        island, _, seconds = item.partition("=")
        try:
            given[island] = float(seconds)
        except ValueError:
            print(f"error: --step-seconds {item!r}: expected ISLAND=SECONDS", file=sys.stderr)
            return 2
    unknown = set(given) - {i.name for i in spec.islands}
    if unknown:
        print(f"error: --step-seconds names island(s) {', '.join(sorted(unknown))} that the spec does not have",
              file=sys.stderr)
        return 2
    try:
        check_profiling_fits_here(spec, given, args.profile_run)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.figure and not any(island.windows for island in spec.islands):
        print("error: --figure draws capacity windows, and no island has any (islands[].windows)", file=sys.stderr)
        return 2
    try:
        spec = with_memory(with_memory(spec, "device_memory_gb", args.device_memory_gb), "host_memory_gb",
                           args.host_memory_gb)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from tasks.planning import memory_markdown
    from training.planning.fit import memory_plan, refusals

    memory = memory_plan(spec)
    print(memory_markdown(memory) + "\n")
    problems = refusals(spec, memory)
    if problems:
        if args.json:
            Path(args.json).write_text(json.dumps({"memory": memory, "refused": problems}, indent=2) + "\n")
        print("\n".join(f"error: {problem}" for problem in problems), file=sys.stderr)
        return 2
    overheads = {}
    if args.profile_run:
        try:
            profile = profile_run(spec)
        except (SpecError, ProfilingFailed) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        step_seconds, ready_s = {**profile.step_seconds, **given}, profile.startup_s
        overheads = {"round_overhead_s": profile.round_overhead_s, "teardown_s": profile.teardown_s}
        print(f"profiling run of {len(spec.learners)} learners here: {json.dumps(profile.to_json())}")
        for island, parts in profile.round_parts_s.items():
            print(f"island {island}, a round's mean seconds: " + ", ".join(f"{part} {seconds:.4f}"
                                                                           for part, seconds in parts.items()))
            part, seconds = profile.largest_part(island)
            print(f"island {island}: besides its inner steps ({parts['inner_steps']:.4f} s), a round's largest part "
                  f"is {part} ({seconds:.4f} s, {seconds / parts['inner_steps']:.0%} of them)")
            print(f"island {island}: a checkpoint adds {profile.checkpoint_s[island]:.2f} s to the rounds it reaches, "
                  f"every {spec.training.checkpoint_every} rounds ({parts['checkpoint']:.4f} s a round)")
    else:
        try:
            step_seconds, ready_s = complete_step_seconds(spec, given)
        except (SpecError, ProfilingFailed) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for island in spec.islands:
            if island.name not in given:
                print(f"island {island.name}: {step_seconds[island.name]:.4f} s per inner step, measured here with "
                      f"all {len(spec.learners)} learners stepping at once")
    startup_s = args.startup_s if args.startup_s is not None else ready_s
    try:
        result = plan_run(spec, step_seconds, args.link_gbps * 1e9, startup_s or 0.0, **overheads)
    except WindowsTooShort as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan_markdown(result))
    if result["windows"]:
        print("\n" + windows_markdown(result["windows"]))
    if args.figure:
        from eval.figures import windows_timeline

        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        Path(args.figure).write_bytes(windows_timeline(result["windows"]))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "memory": memory}, indent=2) + "\n")
    return 0


def with_memory(spec: RunSpec, field: str, overrides: list[str]) -> RunSpec:
    """The spec with `--device-memory-gb` or `--host-memory-gb` (islands[].`field`) applied: GB for every
    island, or ISLAND=GB for one."""
    flag = "--" + field.replace("_", "-")
    memory = {island.name: getattr(island, field) for island in spec.islands}
    for item in overrides:
        name, _, value = item.rpartition("=")
        try:
            gigabytes = float(value)
        except ValueError:
            gigabytes = 0.0
        if not 0 < gigabytes < float("inf"):
            raise SpecError(f"{flag} {item!r}: expected GB or ISLAND=GB, GB a number above 0")
        if name and name not in memory:
            raise SpecError(f"{flag} {item!r}: the spec has no island {name}")
        memory.update({name: gigabytes} if name else dict.fromkeys(memory, gigabytes))
    return spec.model_copy(update={"islands": [island.model_copy(update={field: memory[island.name]})
                                               for island in spec.islands]})


def serve(args: argparse.Namespace) -> int:
    """A local Prefect server, a process work pool and worker per island, and the deployments."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    from flows.serve import serve as serve_spec

    serve_spec(spec, args.port, Path(args.home).resolve(), Path(args.logs).resolve())
    return 0


def deploy(args: argparse.Namespace) -> int:
    """The work pools and deployments of a spec's islands, on the Prefect server that PREFECT_API_URL
    names (with PREFECT_API_AUTH_STRING when it asks for one); workers are started at each site. Without
    one, Prefect would deploy to a temporary server of its own that is gone when the command ends."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("error: deploy needs the Prefect server to deploy to: set PREFECT_API_URL (e.g. "
              "https://<server>/api, or http://127.0.0.1:4200/api for `archipelago serve`)", file=sys.stderr)
        return 2
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    from flows.cluster_pools import store_key_variables, store_secret
    from flows.serve import PoolTypeConflict, pools_of, register

    try:
        deployments = register(spec)
    except PoolTypeConflict as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, deployment_id in deployments.items():
        print(f"deployment {name}: {deployment_id}")
    print("start a worker per pool, where the project is installed: "
          + "; ".join(f"prefect worker start --pool {pool} --type {kind}" for pool, kind in pools_of(spec).items()))
    for island in spec.islands:
        if island.pool.type == "kubernetes":
            keys = " ".join(f"--from-literal={name}=..." for name in store_key_variables(spec, island.name))
            print(f"island {island.name}'s pods read their store keys from Secret {store_secret(spec, island.name)}: "
                  f"kubectl -n {island.pool.namespace} create secret generic {store_secret(spec, island.name)} {keys}")
    return 0


def export(args: argparse.Namespace) -> int:
    """A finished run's consolidated model in the transformers format. The spec is the user's file, not
    the store's copy: with signing keys, the model read is checked against them."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    from training.model.export import SEPARATOR, NotExportable, export_model
    from training.model.registry import load_model

    try:
        model, _ = load_model(spec, open_run(spec, args.run_id), layout.CONSOLIDATED)
        out = export_model(spec, model, Path(args.out), args.dtype)
    except (StoreError, NotExportable) as err:
        print(f"error: cannot export {args.run_id}: {err}", file=sys.stderr)
        return 2
    ids = ("the UTF-8 bytes' values (0 to 255)" if spec.data.tokenizer is None
           else f"those of tokenizer {spec.data.tokenizer.path} (0 to {spec.separator - 1})")
    print(f"{out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}) and its tokenizer "
          f"with AutoTokenizer.from_pretrained({str(out)!r}); token ids are {ids}, and {spec.separator} the "
          f"document separator {SEPARATOR}, which the tokenizer puts before each text as training saw every document")
    return 0


def export_metrics(args: argparse.Namespace) -> int:
    """A run's ledgers and report from its store into an experiment tracker (eval/tracking.py): the same
    series its islands' relays and its report stage log while it runs."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    from eval.tracking import BACKENDS, TrackingUnavailable, open_sink, replay_run
    from infra.tracking_spec import TrackingSpec

    backend, target = args.to
    if backend not in BACKENDS:
        print(f"error: --to {backend}: expected one of {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    try:
        settings = TrackingSpec(backend=backend, uri=target, project=args.project or spec.tracking.project)
    except ValueError as err:
        print(f"error: --to {backend} TARGET: {err.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        store = open_run(spec, args.run_id, writer=None)
        sink = open_sink(settings, spec.name, args.run_id, "export", primary=True)
        try:
            logged = replay_run(spec, store, sink)
            link = sink.link()
        finally:
            sink.close(finished=True)
    except (StoreError, TrackingUnavailable) as err:
        print(f"error: cannot export the metrics of {args.run_id}: {err}", file=sys.stderr)
        return 2
    print(f"{args.run_id}: {logged['points']} values of {logged['learners']} learners"
          + (" and the report" if logged["report"] else " (no report yet)") + f" in {backend}: {link.url}")
    print(link.description)
    return 0


def tokenizer(args: argparse.Namespace) -> int:
    """A byte-level BPE vocabulary trained on the training side of a spec's corpora, and the spec's
    `data.tokenizer` section that uses it."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides)
    if spec is None:
        return 2
    from training.data.corpora import DataError, check_data_paths, data_root
    from training.data.tokenizer import train_tokenizer

    try:
        root, out = data_root(spec), Path(args.out).resolve()
        check_data_paths(spec, tokenizer=False)  # the spec's tokenizer may be the file this makes
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not out.is_relative_to(root):
        print(f"error: --out {out} is not under the data root {root}, where data preparation reads it",
              file=sys.stderr)
        return 2
    size = train_tokenizer(spec, args.vocab_size, out)
    print(f"# {out}: {size} ids. In the run spec:")
    print(yaml.safe_dump({"data": {"tokenizer": {"path": str(out.relative_to(root)), "vocab_size": size}}},
                         sort_keys=False).rstrip())
    return 0


def keys(args: argparse.Namespace) -> int:
    """A signing key pair per writer (the control plane and each named island, infra/authority.py): each
    private key into a file of its own that only its owner can read, never to the terminal; the spec's
    `signing` sections with the public keys to stdout."""
    from infra.authority import CONTROL, generate_keypair

    writers = [CONTROL, *args.islands]
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    taken = [w for w in writers if (folder / f"{w}.key").exists()]
    if taken:
        print(f"error: {', '.join(str(folder / f'{w}.key') for w in taken)} already exist; keys are never "
              "overwritten (a run signed with them could no longer be checked)", file=sys.stderr)
        return 2
    sections = {}
    for writer in writers:
        private, public = generate_keypair()
        path = folder / f"{writer}.key"
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
            file.write(private + "\n")
        sections[writer] = {"public_key": public,
                            "private_key_env": f"ARCHIPELAGO_SIGNING_KEY_{writer.upper().replace('-', '_')}"}
    print("# In the run spec: the control plane's keys at the top level, each island's under its entry.")
    print(yaml.safe_dump({"signing": sections[CONTROL],
                          "islands": [{"name": island, "signing": sections[island]} for island in args.islands]},
                         sort_keys=False).rstrip())
    print("# Each writer's environment, and only its: export <private_key_env>=$(cat <writer>.key), or a Prefect "
          f"Secret block; the private keys are in {folder}/.")
    return 0


def version_text() -> str:
    """The installed package's version, and the commit when the code runs from a git checkout."""
    text = f"archipelago {version('archipelago')}"
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / ".git").exists():
        git = ["git", "-C", str(checkout)]
        try:
            commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, timeout=10).stdout.strip()
            changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                     text=True, check=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return text
        text += f" (commit {commit}{', with uncommitted changes' if changed else ''})"
    return text


class VersionAction(argparse.Action):
    """`--version`, computed only when asked for (it may run git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="archipelago", description=__doc__)
    parser.add_argument("--version", action=VersionAction)
    # Every command that loads a run spec takes --set, applied to its YAML before validation (infra/overrides.py).
    spec_options = argparse.ArgumentParser(add_help=False)
    spec_options.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.FIELD=VALUE",
                              help="override a field of the run spec (repeatable; lists by index, e.g. "
                                   "islands.0.batch_size=4; the value is YAML)")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", parents=[spec_options], help="run the whole lifecycle of a run spec")
    run_parser.add_argument("config", help="run spec YAML")
    run_parser.add_argument("--report", help="write the report JSON here")
    run_parser.add_argument("--dry-run", action="store_true",
                            help="check everything a run is checked for (the spec, its memory per rank and per host, "
                                 "its stores, its data paths), build its model on the meta device, print what would "
                                 "run and stop")
    run_parser.set_defaults(handler=run)
    resume_parser = commands.add_parser("resume", parents=[spec_options], help="continue an interrupted or failed run")
    resume_parser.add_argument("run_id")
    resume_parser.add_argument("--config", help="the run's spec YAML: the store's copy must be it (else the store's "
                                                "copy is taken as it is, with --store)")
    resume_parser.add_argument("--store", default=".archipelago/store", help="the run's store root")
    resume_parser.add_argument("--endpoint-url", default=None, help="S3 endpoint, if not $AWS_ENDPOINT_URL")
    resume_parser.add_argument("--report", help="write the report JSON here")
    resume_parser.set_defaults(handler=resume)
    prepare_parser = commands.add_parser(
        "prepare", parents=[spec_options], help="only split and shard a run spec's data into the store, and summarise the splits")
    prepare_parser.add_argument("config", help="run spec YAML")
    prepare_parser.add_argument("--seed", type=int, default=None, help="the run's seed, instead of the spec's")
    prepare_parser.add_argument("--store", default=None, help="store root, instead of the spec's store.url")
    prepare_parser.set_defaults(handler=prepare)
    plan_parser = commands.add_parser(
        "plan", parents=[spec_options], help="predict a run's utilisation, bytes and wall time on a link, without training")
    plan_parser.add_argument("config", help="run spec YAML")
    plan_parser.add_argument("--link-gbps", type=float, default=25.0, help="inter-island link, Gbit/s each way")
    plan_parser.add_argument("--step-seconds", action="append", default=[], metavar="ISLAND=S",
                             help="seconds per inner step of an island's learners (measured here when not given)")
    plan_parser.add_argument("--startup-s", type=float, default=None,
                             help="seconds before the first inner step (measured with the step times when not given)")
    plan_parser.add_argument("--profile-run", action="store_true",
                             help="profile with the run's own learners for a few rounds here (its data is prepared "
                                  "in a temporary folder): adds each round's time besides inner steps, start-up and "
                                  "teardown to the plan")
    plan_parser.add_argument("--device-memory-gb", action="append", default=[], metavar="[ISLAND=]GB",
                             help="check the islands' ranks against accelerators of this memory (all islands, "
                                  "or one), in place of islands[].device_memory_gb")
    plan_parser.add_argument("--host-memory-gb", action="append", default=[], metavar="[ISLAND=]GB",
                             help="check the islands' learners against hosts of this memory (all islands, or one), "
                                  "in place of islands[].host_memory_gb")
    plan_parser.add_argument("--json", help="write the plan as JSON here")
    plan_parser.add_argument("--figure", metavar="PATH",
                             help="write the timeline of the islands' capacity windows here (PNG)")
    plan_parser.set_defaults(handler=plan)
    serve_parser = commands.add_parser(
        "serve", parents=[spec_options], help="start a Prefect server, one worker per island's work pool, and the deployments")
    serve_parser.add_argument("config", nargs="?", default="configs/demo.yaml",
                              help="run spec: its islands get work pools, and it pre-fills the UI's form")
    serve_parser.add_argument("--port", type=int, default=4200, help="Prefect server and UI port")
    serve_parser.add_argument("--home", default=".archipelago/prefect", help="the server's PREFECT_HOME")
    serve_parser.add_argument("--logs", default=".archipelago/logs", help="server and worker logs")
    serve_parser.set_defaults(handler=serve)
    deploy_parser = commands.add_parser(
        "deploy", parents=[spec_options], help="create the work pools (locked job template) and deployments of a spec's islands on the "
                       "Prefect server of PREFECT_API_URL")
    deploy_parser.add_argument("config", help="run spec: its islands get work pools, and the lifecycle's form defaults to it")
    deploy_parser.set_defaults(handler=deploy)
    export_parser = commands.add_parser(
        "export", parents=[spec_options], help="write a run's consolidated model in the transformers format (config.json, model.safetensors)")
    export_parser.add_argument("config", help="the run's spec YAML")
    export_parser.add_argument("run_id")
    export_parser.add_argument("--out", required=True, help="folder to write")
    export_parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    export_parser.set_defaults(handler=export)
    metrics_parser = commands.add_parser(
        "export-metrics", parents=[spec_options], help="replay a run's ledgers and report from its store into TensorBoard, MLflow or W&B")
    metrics_parser.add_argument("run_id")
    metrics_parser.add_argument("--config", required=True, help="the run's spec YAML")
    metrics_parser.add_argument("--to", nargs=2, required=True, metavar=("BACKEND", "TARGET"),
                                help="tensorboard DIR, mlflow TRACKING_URI, or wandb DIR|URL")
    metrics_parser.add_argument("--project", default=None,
                                help="MLflow experiment or W&B project (default: the spec's tracking.project, or name)")
    metrics_parser.set_defaults(handler=export_metrics)
    tokenizer_parser = commands.add_parser("tokenizer", help="make a tokenizers vocabulary for a run")
    tokenizer_commands = tokenizer_parser.add_subparsers(dest="tokenizer_command", required=True)
    train_parser = tokenizer_commands.add_parser(
        "train", parents=[spec_options], help="train byte-level BPE on the training side of a spec's corpora (never held-out text)")
    train_parser.add_argument("config", help="run spec YAML: its corpora and split")
    train_parser.add_argument("--vocab-size", type=int, default=4096)
    train_parser.add_argument("--out", required=True, help="the tokenizer's JSON file, under the data root")
    train_parser.set_defaults(handler=tokenizer)
    keys_parser = commands.add_parser(
        "keys", help="make signing key pairs for the control plane and islands, and print the spec's signing sections")
    keys_parser.add_argument("islands", nargs="+", help="the islands' names, as in the spec")
    keys_parser.add_argument("--out", default=".archipelago/keys", help="folder for the private keys (files 0600)")
    keys_parser.set_defaults(handler=keys)
    args = parser.parse_args(argv)
    if args.command == "resume" and args.overrides and not args.config:
        print("error: --set changes a spec file: resume takes it with --config (the store's copy is taken as it is)",
              file=sys.stderr)
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
