"""`archipelago plan`: memory per rank and per host first (refused with the plan's figures), then
utilisation, bytes and wall time on a link, from given, measured or profiled inner-step seconds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flows.cli_run import load_spec_or_say_why
from infra.spec import RunSpec, SpecError


def plan(args: argparse.Namespace) -> int:
    """What a run will deliver on a link, before paying for it: per island and for the run; first,
    each island's memory per rank, and a refusal if its ranks would not fit its accelerators."""
    spec = load_spec_or_say_why(args.config, "train" if args.profile_run else "plan", args.overrides)
    if spec is None:
        return 2
    from training.planning.markdown import plan_markdown, windows_markdown
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
    from training.planning.markdown import memory_markdown
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
