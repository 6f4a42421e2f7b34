"""`archipelago`: the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from infra.spec import SpecError, load_spec

# Ephemeral Prefect: no telemetry off the machine, and room for a slow first start (database migrations).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.config)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from eval.report import evaluation_table_from_report
    from flows.lifecycle import lifecycle

    report = lifecycle(spec=spec)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
    comm = report["communication"]
    print(f"\nrun {report['run_id']} ({report['sync_mode']}), {report['wall_seconds']:.0f} s")
    print(evaluation_table_from_report(report).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"tokens: islands {report['compute']['islands_tokens']:,}, standard {report['compute']['baseline_tokens']:,}")
    print(f"inter-island bytes {comm['inter_island_bytes']:,} vs per-step all-reduce "
          f"{comm['allreduce_equivalent_bytes']:,}; max weight distance {report['consensus']['max_weight_distance']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="archipelago", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the whole lifecycle of a run spec")
    run_parser.add_argument("config", help="run spec YAML")
    run_parser.add_argument("--report", help="write the report JSON here")
    run_parser.set_defaults(handler=run)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
