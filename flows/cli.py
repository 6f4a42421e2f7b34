"""`archipelago`: run, resume and inspect runs from the command line."""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

from flows.cli_gpu_check import add_gpu_check_parser
from flows.cli_plan import plan
from flows.cli_run import load_spec_or_say_why, resume, run
from infra import layout
from infra.spec import SpecError, parse_spec
from infra.store import StoreError
from infra.stores import open_run

# No telemetry off the machine from any Prefect client or server this command starts.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


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


def serve(args: argparse.Namespace) -> int:
    """A local Prefect server, a process work pool and worker per island, and the deployments."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides, host_keys="sign")
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
    spec = load_spec_or_say_why(args.config, overrides=args.overrides, host_keys="read")
    if spec is None:
        return 2
    from flows.cluster_pools import secret_key_variables, store_secret
    from flows.serve import PoolTypeConflict, pools_of, register
    from infra.local_keys import keys_root

    try:
        deployments = register(spec)
    except PoolTypeConflict as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, deployment_id in deployments.items():
        print(f"deployment {name}: {deployment_id}")
    print("start a worker per pool, where the project is installed: "
          + "; ".join(f"prefect worker start --pool {pool} --type {kind}" for pool, kind in pools_of(spec).items()))
    if (keys_root() / spec.name).is_dir():
        print(f"signing keys: {keys_root() / spec.name}/<writer>.key; each worker holds only its own writer's, in "
              "the spec's private_key_env (the control plane's: control.key)")
    for island in spec.islands:
        if island.pool.type == "kubernetes":
            keys = " ".join(f"--from-literal={name}=..." for name in secret_key_variables(spec, island.name))
            print(f"island {island.name}'s pods read their store and signing keys from Secret "
                  f"{store_secret(spec, island.name)}: kubectl -n {island.pool.namespace} create secret generic {store_secret(spec, island.name)} {keys}")
    return 0


def export(args: argparse.Namespace) -> int:
    """A finished run's consolidated model in the transformers format. The spec is the user's file, not
    the store's copy (with this host's keys when it has none, as `run` signed it): the model read is
    checked against its public keys; no private key is needed to read."""
    spec = load_spec_or_say_why(args.config, overrides=args.overrides, host_keys="read")
    if spec is None:
        return 2
    from training.model.export import SEPARATOR, NotExportable, export_model
    from training.model.registry import load_model

    try:
        model, _ = load_model(spec, open_run(spec, args.run_id, writer=None), layout.CONSOLIDATED)
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
    from infra.spec.tracking import TrackingSpec

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
        sink = open_sink(settings, spec.name, args.run_id, "export", primary=True, from_spec=False)
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
    from infra.authority import CONTROL
    from infra.local_keys import new_private_key, owner_only_folder, private_key_env

    writers = [CONTROL, *args.islands]
    folder = owner_only_folder(Path(args.out))
    taken = [w for w in writers if (folder / f"{w}.key").exists()]
    if taken:
        print(f"error: {', '.join(str(folder / f'{w}.key') for w in taken)} already exist; keys are never "
              "overwritten (a run signed with them could no longer be checked)", file=sys.stderr)
        return 2
    sections = {}
    for writer in writers:
        sections[writer] = {"public_key": new_private_key(folder, writer), "private_key_env": private_key_env(writer)}
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
    # Every command that loads a run spec takes --set, applied to its YAML before validation (infra/spec/overrides.py).
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
    resume_parser.add_argument("--control-public-key", default=None,
                               help="with --store: the control plane's public key (the spec's signing.public_key); "
                                    "the store's copy of the spec is taken only when it verifies against it")
    resume_parser.add_argument("--unauthenticated", action="store_true",
                               help="with --store: a run without signing keys, its stored spec taken unchecked")
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
    add_gpu_check_parser(commands, spec_options)
    args = parser.parse_args(argv)
    if args.command == "resume" and args.overrides and not args.config:
        print("error: --set changes a spec file: resume takes it with --config (the store's copy is taken as it is)",
              file=sys.stderr)
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
