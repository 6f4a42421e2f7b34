"""`archipelago run` and `resume`: the checks before any work, the lifecycle on a Prefect API that an
interrupt stops cleanly, and what the user is told at the end (the result table, what to fix, or how to
resume)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from infra import layout
from infra.lease import LeaseHeld
from infra.spec import RunSpec, SpecError, check_windows_ahead, load_raw_spec, parse_spec, spec_sha256
from infra.store import StoreError, run_store
from infra.spec.store import StoreSpec
from infra.stores import check_stores_reachable, open_run


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
    from training.planning.markdown import memory_markdown
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
    if spec.signing is None:
        print(f"warning: run {run_id} is unauthenticated (unauthenticated: true): nothing it reads from its stores "
              "is checked, so anyone who can write them can change what it trains and reports", file=sys.stderr)
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
    if spec.signing is None:
        return f"archipelago resume {run_id} --store {spec.store.url}{endpoint} --unauthenticated"
    return (f"archipelago resume {run_id} --store {spec.store.url}{endpoint} "
            f"--control-public-key {spec.signing.public_key}")


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
                         overrides: Sequence[str] = (), host_keys: Literal["sign", "read"] | None = None
                         ) -> RunSpec | None:
    """The spec of a YAML file, or None once the error is printed. `host_keys`: a spec without keys gets
    this host's (infra/local_keys.py), as `run`, `resume`, `serve` and `deploy` sign by default: "sign" with
    the private keys in this process's environment, "read" with the public keys alone."""
    from infra.local_keys import with_host_keys

    try:
        raw = load_raw_spec(path, overrides)
        return parse_spec(with_host_keys(raw, sign=host_keys == "sign") if host_keys else raw, purpose)
    except (SpecError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    spec = load_spec_or_say_why(args.config, overrides=args.overrides, host_keys="sign")
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
    learners restart from their newest checkpoints. With `--config`, the spec is the user's file (signed
    with this host's keys when it has none, as `run` does) and the store's copy must be that spec;
    without, the store's copy is taken only when it is signed by the control-plane key the operator pins
    (`--control-public-key`): a store writer could otherwise swap in a spec of their own, without keys.
    `--unauthenticated` takes a run without keys as its store holds it, unchecked, as the operator says."""
    from infra.local_keys import with_host_keys, with_pinned_host_keys

    try:
        if args.config:
            spec = parse_spec(with_host_keys(load_raw_spec(args.config, args.overrides)))
            stored = open_run(spec, args.run_id, writer=None).get_json(layout.SPEC)
            if spec_sha256(stored) != spec_sha256(spec):
                print(f"error: cannot resume {args.run_id}: its store holds another spec than {args.config}",
                      file=sys.stderr)
                return 2
        else:
            store_spec = StoreSpec(url=args.store, endpoint_url=args.endpoint_url)
            if args.unauthenticated:
                spec = RunSpec.model_validate(run_store(store_spec, args.run_id).get_json(layout.SPEC))
                if spec.signing is not None:
                    raise SpecError("its stored spec has signing keys: pin its control key with --control-public-key")
            elif not args.control_public_key:
                print(f"error: cannot resume {args.run_id} from --store alone: its spec.json is trusted only when "
                      "it verifies against the control plane's public key; pass --control-public-key KEY (the "
                      "spec's signing.public_key, as the run's failure message prints it), the spec file with "
                      "--config, or --unauthenticated for a run without keys", file=sys.stderr)
                return 2
            else:
                spec = stored_spec(store_spec, args.run_id, args.control_public_key)
                with_pinned_host_keys(spec)
    except (StoreError, ValueError, OSError) as err:  # ValueError: pydantic's and SpecError, for bad input
        print(f"error: cannot resume {args.run_id}: {err}", file=sys.stderr)
        return 2
    return _launch(spec, args.run_id, args.report)


def stored_spec(store_spec: StoreSpec, run_id: str, control_public_key: str) -> RunSpec:
    """The spec a run's store holds, if the control plane whose public key is `control_public_key` signed it
    (else Unauthenticated, a StoreError) and it names that key as its own."""
    from infra.authority import CONTROL, Authority, public_key_of

    pinned = Authority({CONTROL: public_key_of(control_public_key)}, island_of_learner=())
    spec = RunSpec.model_validate(run_store(store_spec, run_id, pinned).get_json(layout.SPEC))
    if spec.signing is None or spec.signing.public_key != control_public_key:
        raise SpecError("its stored spec does not name --control-public-key as the control plane's key")
    return spec
