"""The outer step's compute and state per learner, whole against sharded (`sync.shard_outer_step`).

For each config, the model's fragments as its learners lay them out: one learner's outer optimizer over
the whole fragment (every learner of a group took that step before) against each learner's over its own
shard (`SyncMode.outer_span`), stepped alternately from the same anchor and pseudo-gradients, median of
`--repeats` steps each after one untimed step (Shampoo's first builds its state). One thread, as a
learner's transport thread steps. The sharded step's time per learner is its slowest shard's: the group
waits for every shard.

    .venv/bin/python -m benchmarks.outer_step [--repeats 7] [CONFIG ...]

Writes benchmarks/results/outer_step.json and docs/results/outer-step.md, stamped with the git commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.results_page import provenance, write_results_page
from infra.spec import load_spec
from training.exchange.fragments import FragmentLayout
from training.exchange.modes import sync_mode
from training.exchange.outer import OuterOptimizer
from training.model.registry import build_model

CONFIGS = ("configs/brief-hierarchical.yaml",)
RESULTS = Path("benchmarks/results/outer_step.json")


def timed_steps(outer: OuterOptimizer, anchor: torch.Tensor, delta: torch.Tensor, repeats: int) -> tuple[float, int]:
    """Median seconds of a step after an untimed first, and the elements of the optimizer's state."""
    outer.step(anchor, delta)
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        outer.step(anchor, delta)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds), sum(v.numel() for v in outer.state()[0].values())


def measure(config: str, repeats: int) -> dict:
    spec = load_spec(config)
    model = build_model(spec)
    layout = FragmentLayout.build(model, spec.sync.transport.fragments, spec.sync.transport.layout)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    mode = sync_mode(spec, [[shapes[name].numel() for name in names] for names in layout.names])
    group = mode.anchor_group(0)
    generator = torch.Generator().manual_seed(0)
    fragments = []
    for f, names in enumerate(layout.names):
        size = layout.sizes[f]
        anchor, delta = torch.randn(size, generator=generator), 1e-3 * torch.randn(size, generator=generator)
        whole_s, whole_state = timed_steps(OuterOptimizer.from_spec(spec.sync.outer, [shapes[n] for n in names]),
                                           anchor, delta, repeats)
        shards = []
        for learner in group:
            start, end = mode.outer_span(f, learner)
            outer = OuterOptimizer.from_spec(spec.sync.outer, [shapes[names[i]] for i in mode.outer_parameters(f, learner)])
            seconds, state = timed_steps(outer, anchor[start:end], delta[start:end], repeats)
            shards.append({"learner": learner, "elements": end - start, "seconds": seconds, "state_elements": state})
        fragments.append({"fragment": f, "elements": size, "whole_seconds": whole_s, "whole_state_elements": whole_state,
                          "shards": shards, "sharded_seconds": max(s["seconds"] for s in shards),
                          "largest_shard_state_elements": max(s["state_elements"] for s in shards)})
    whole = sum(f["whole_seconds"] for f in fragments) / len(fragments)
    sharded = sum(f["sharded_seconds"] for f in fragments) / len(fragments)
    return {"config": config, "outer": spec.sync.outer.name, "group": len(group), "fragments": fragments,
            "whole_seconds_per_round": whole, "sharded_seconds_per_round": sharded, "speedup": whole / sharded,
            "state_ratio": max(f["largest_shard_state_elements"] / f["whole_state_elements"] for f in fragments)}


def markdown(results: dict) -> str:
    lines = ["# The outer step per learner, whole against sharded", "",
             f"One thread, median of {results['repeats']} steps. A round steps one fragment; a sharded round "
             "waits for its slowest shard. State: the outer optimizer's tensors (momentum, graft, Shampoo's "
             "statistics and roots).", "",
             "| config | outer | learners sharing an anchor | whole step s/round | sharded step s/round | speedup | "
             "largest shard's state / whole |", "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        lines.append(f"| {r['config']} | {r['outer']} | {r['group']} | {r['whole_seconds_per_round']:.3f} | "
                     f"{r['sharded_seconds_per_round']:.3f} | {r['speedup']:.1f}x | {r['state_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per optimizer (the median is kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    measured = provenance()
    runs = [measure(config, args.repeats) for config in args.configs]
    for r in runs:
        print(f"{r['config']}: whole {r['whole_seconds_per_round']:.3f} s, sharded {r['sharded_seconds_per_round']:.3f} s "
              f"a round ({r['speedup']:.1f}x), largest shard's state {r['state_ratio']:.2f} of the whole", flush=True)
    results = {**measured, "repeats": args.repeats, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    write_results_page("outer-step", markdown(results), sources=str(RESULTS),
                       command="python -m benchmarks.outer_step", **measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
