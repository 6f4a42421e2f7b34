"""Kill drill: one learner of a 6-learner, 3-island run SIGKILLed from outside, against the same run
without the kill.

The learner is killed by signal from this driver (not by the run's own fault injection) once it has
committed the checkpoint of the round before `--kill-round`, so it dies inside that round; it is
started again a second later, as the lifecycle's `train-learner` task retries it. What is measured
per arm: wall time of the islands phase (all learners, from start to the last one finishing) and
bpb of the consolidated model on both held-out evaluations. The target (issue #13, item 6): with the
kill, wall time within 1.3x and bpb within 0.5% of the run without it.

    .venv/bin/python -m benchmarks.kill_drill                    # both arms, --repeats runs each
    .venv/bin/python -m benchmarks.kill_drill --kill-learner 5 --kill-round 20   # the torchrun learner (2 processes)

Results: `benchmarks/results/kill_drill_learner<L>_round<R>.json` (every run, written after each; a
rerun resumes where the last stopped) and the page `docs/results/kill-drill-learner<L>-round<R>.md`
(medians). Progress: `benchmarks/results/kill_drill.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import Log, new_run, train_islands
from benchmarks.results_page import provenance, recorded, write_results_page
from eval.evaluate import heldout_bpb
from infra import layout
from infra.launch import LEARNER_MODULE
from infra.spec import parse_spec
from training.learner.ledger import read_summaries

RESULTS = Path("benchmarks/results")


def drill_spec(store_url: str) -> dict:
    """Six learners on three islands that differ in batch, inner steps and processes per learner."""
    return {
        "name": "kill-drill", "seed": 0,
        "islands": [
            {"name": "east", "learners": 3, "batch_size": 8, "seq_len": 128, "inner_steps": 8},
            {"name": "west", "learners": 2, "batch_size": 16, "seq_len": 128, "inner_steps": 4},
            {"name": "south", "learners": 1, "batch_size": 8, "seq_len": 128, "inner_steps": 8,
             "processes_per_learner": 2},
        ],
        "model": {"layers": 2, "width": 128, "heads": 4},
        "data": {"corpora": [
            {"name": "prose", "source": "shakespeare", "eval_fraction": 0.1, "max_eval_bytes": 60000},
            {"name": "code", "source": "python_stdlib", "max_documents": 200, "eval_fraction": 0.1,
             "max_eval_bytes": 60000}]},
        "training": {"lr": 0.003, "warmup_steps": 8},
        "sync": {"mode": "butterfly", "rounds": 30, "outer": {"name": "nesterov", "lr": 1.0, "momentum": 0.0}},
        "store": {"url": store_url},
    }


def learner_pids(run_id: str, learner: int) -> list[int]:
    """Processes running learner `learner` of the run (a torchrun group's launcher and workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if LEARNER_MODULE.encode() in argv and b"--learner" in argv and run_id.encode() in argv and \
                argv[argv.index(b"--learner") + 1] == str(learner).encode():
            pids.append(int(entry.name))
    return pids


def kill_when_due(store, run_id: str, learner: int, kill_round: int, log: Log, done: threading.Event) -> None:
    while not done.is_set():
        if store.is_committed(layout.checkpoint(learner, kill_round - 1)):
            time.sleep(0.2)  # inside the round, not at its very start
            pids = learner_pids(run_id, learner)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            log(f"  SIGKILL learner {learner} in round {kill_round} (pids {pids})")
            return
        time.sleep(0.1)


def run_arm(kill: bool, args, log: Log) -> dict:
    store_url = str(Path(".archipelago/kill-drill").resolve())
    spec = parse_spec(drill_spec(store_url))
    run_id, store, _ = new_run(spec, "kill" if kill else "clean")
    done = threading.Event()
    killer = threading.Thread(target=kill_when_due, args=(store, run_id, args.kill_learner, args.kill_round, log, done),
                              daemon=True) if kill else None
    started = time.monotonic()
    if killer:
        killer.start()
    consensus = train_islands(spec, run_id, log, restarts=2)
    wall = time.monotonic() - started
    done.set()
    summaries = read_summaries(spec, store)
    result = {**provenance(), "arm": arm_name(kill, args), "wall_s": round(wall, 1),
              "bpb": heldout_bpb(spec, store, layout.CONSOLIDATED),
              "max_weight_distance": consensus["max_weight_distance"],
              "missed_exchanges": [dict(m, learner=s.learner) for s in summaries for m in s.missed_exchanges],
              "lives": {s.learner: s.lives for s in summaries if len(s.lives) > 1},
              "kill": {"learner": args.kill_learner, "round": args.kill_round} if kill else None}
    shutil.rmtree(Path(store_url) / "runs" / run_id, ignore_errors=True)
    return result


def arm_name(kill: bool, args) -> str:
    return f"kill learner {args.kill_learner} in round {args.kill_round}" if kill else "clean"


def medians(runs: list[dict]) -> dict:
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {"runs": len(mine), "wall_s": statistics.median(r["wall_s"] for r in mine),
                    **{f"bpb_{name}": statistics.median(r["bpb"][name] for r in mine) for name in mine[0]["bpb"]}}
    return out


def markdown(runs: list[dict]) -> str:
    m = medians(runs)
    bpb = [k for k in m["clean"] if k.startswith("bpb_")]
    killed = next((r["kill"] for r in runs if r["kill"]), None)
    lines = [f"# Kill drill: learner {killed['learner']} killed in round {killed['round']}, against the clean run"
             if killed else "# Kill drill: the clean runs so far", "",
             "| arm | runs | wall s (median) | " + " | ".join(bpb) + " | wall vs clean | largest bpb change |",
             "|---|---|---|" + "---|" * len(bpb) + "---|---|"]
    for arm, row in m.items():
        ratio = row["wall_s"] / m["clean"]["wall_s"]
        worst = max(abs(row[k] / m["clean"][k] - 1) for k in bpb)
        lines.append(f"| {arm} | {row['runs']} | {row['wall_s']:.1f} | " + " | ".join(f"{row[k]:.4f}" for k in bpb)
                     + f" | {ratio:.3f}x | {100 * worst:.2f}% |")
    lines += ["", "Targets (issue #13): wall time at most 1.3x and bpb within 0.5% of the clean run."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm; the table gives medians")
    parser.add_argument("--kill-learner", type=int, default=1)
    parser.add_argument("--kill-round", type=int, default=11)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    log = Log(RESULTS / "kill_drill.log")
    # One file per kill point, so every kill arm is compared with clean runs made beside it.
    path = RESULTS / f"kill_drill_learner{args.kill_learner}_round{args.kill_round}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    for repeat in range(args.repeats):
        for kill in (False, True):  # side by side, so both arms see the same machine load
            arm = arm_name(kill, args)
            if sum(r["arm"] == arm for r in runs) > repeat:
                continue
            log(f"run {repeat + 1}/{args.repeats}, arm {arm}")
            runs.append(run_arm(kill, args, log))
            log(f"  {arm}: {runs[-1]['wall_s']} s, bpb {runs[-1]['bpb']}")
            path.write_text(json.dumps({"runs": runs}, indent=1))
    page = write_results_page(path.stem.replace("_", "-"), markdown(runs), sources=str(path),
                              command=f"python -m benchmarks.kill_drill --kill-learner {args.kill_learner} "
                                      f"--kill-round {args.kill_round}", **recorded(runs))
    print(page.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
