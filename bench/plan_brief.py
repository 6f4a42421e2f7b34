"""The brief's run on paper: what each transport setting gets on its link, and the link it needs.

Plans `configs/plan-brief-32b.yaml` (32B-total MoE, 8 learners on a GB300 and a B300 island) under
several settings of `sync.transport` with the planner (`training/planner.py`), at the step times
the config's comments derive, and writes `bench/results/plan_brief.{json,md}`.

    python -m bench.plan_brief [--link-gbps 25]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infra.spec import load_spec, parse_spec
from training.planner import plan_run

CONFIG = "configs/plan-brief-32b.yaml"
STEP_SECONDS = {"gb300": 0.27, "b300": 0.22}
SETTINGS = [
    ("whole model, fp32, no overlap", {"fragments": 1, "tau": 0, "compression": "none"}),
    ("whole model, int4, no overlap", {"fragments": 1, "tau": 0, "compression": "int4"}),
    ("4 fragments, fp32, tau 50", {"fragments": 4, "tau": 50, "compression": "none"}),
    ("4 fragments, int8, tau 50", {"fragments": 4, "tau": 50, "compression": "int8"}),
    ("4 fragments, int4, tau 50", {"fragments": 4, "tau": 50, "compression": "int4"}),
    ("20 fragments, int4, tau 50", {"fragments": 20, "tau": 50, "compression": "int4"}),
]
RESULTS = Path("bench/results")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=25.0)
    args = parser.parse_args()
    base = load_spec(CONFIG).model_dump(mode="json")
    rows = []
    for title, transport in SETTINGS:
        raw = {**base, "sync": {**base["sync"], "transport": {**base["sync"]["transport"], **transport}}}
        planned = plan_run(parse_spec(raw), STEP_SECONDS, args.link_gbps * 1e9)
        rows.append({"setting": title, "transport": transport, **{k: planned[k] for k in (
            "utilisation", "wall_s", "exchange_bytes", "blocked_s", "bandwidth_for_utilisation", "parameters")}})
        print(f"{title}: utilisation {planned['utilisation']:.1%}", flush=True)
    (RESULTS / "plan_brief.json").write_text(json.dumps({"link_gbps": args.link_gbps, "step_seconds": STEP_SECONDS,
                                                         "config": CONFIG, "settings": rows}, indent=2) + "\n")
    lines = [f"| setting | utilisation at {args.link_gbps:g} Gbit/s | wall h | inter-island TB | "
             "link for 90% | for 95% | for 99% |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        need = [f"{b / 1e9:.3g} Gbit/s" if b else "not reachable"
                for b in row["bandwidth_for_utilisation"].values()]
        lines.append(f"| {row['setting']} | {row['utilisation']:.1%} | {row['wall_s'] / 3600:.2f} | "
                     f"{row['exchange_bytes']['inter'] / 1e12:.1f} | " + " | ".join(need) + " |")
    (RESULTS / "plan_brief.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
