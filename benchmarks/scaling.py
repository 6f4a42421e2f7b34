"""How the exchange's cost grows with the number of learners: butterfly pairs against all-reduce
through the store, measured per learner and round beside the planner's prediction.

    .venv/bin/python -m benchmarks.scaling [--learners 4 8 16 32] [--rounds 3] [--table]

Every arm is a tiny model (`SCALING` below) on two islands of N/2 learners each, every learner its own
OS process (`training.stages.train_learners`), all talking to one SeaweedFS S3 server on loopback that
the benchmark starts and stops. What a learner's transport counted (`training.exchange.transport.LinkCounters`, in
its summary) is set beside what `training.planning.planner.replay` predicts for the same spec:

* requests: PUTs and GETs of message objects and commits. Fixed by the schedule and message sizes,
  so predicted exactly.
* polls: looks for a peer's commit. The plan counts one per message read; a reader that gets there
  before its peer looks again, so the measured figure is at least the plan's and grows with waiting.
* bytes written and read: the messages, commits included.
* seconds syncing: the learner's round loop waiting on the exchange (its ledger's `seconds_syncing`).
  The plan's figure is its time blocked on the link, with the step times the arm itself measured;
  it leaves out the store's latency and the cores the learners share, so it is a floor.

Arms are resumable (one JSON per arm in benchmarks/results/scaling/arms); `--table` rebuilds the table,
the figure and the page docs/results/scaling.md from them. Each arm's training holds the lock file
`--cpu-lock` when given (e.g. `benchmarks.harness.CPU_LOCK`'s), so another benchmark on the same cores can
take turns with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Log, cpu_lock, new_run, relative_change, train_islands
from benchmarks.results_page import provenance, recorded, write_results_page

RESULTS = Path("benchmarks/results/scaling")
MODES = ("butterfly", "allreduce")
# Small enough that 32 learner processes fit on two cores: the benchmark is about requests and bytes, and
# the model's size only scales the bytes.
SCALING = {
    "model": {"layers": 1, "width": 32, "heads": 2},
    "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 200, "eval_fraction": 0.1,
                          "max_eval_bytes": 20000}]},
}


def spec_for(mode: str, learners: int, rounds: int, endpoint_url: str):
    from infra.spec import parse_spec
    return parse_spec({
        "name": f"scaling-{mode}-{learners}", "seed": 0,
        "islands": [{"name": "east", "learners": learners // 2, "batch_size": 2, "seq_len": 32, "inner_steps": 4},
                    {"name": "west", "learners": learners // 2, "batch_size": 4, "seq_len": 32, "inner_steps": 2}],
        **SCALING,
        # Generous: 32 processes on two cores start minutes apart, and a missed exchange would change the counts.
        "sync": {"mode": mode, "rounds": rounds, "partner_timeout_s": 600, "outer": {"name": "nesterov", "lr": 1.0,
                                                                                     "momentum": 0.0}},
        "store": {"url": "s3://archipelago/scaling", "endpoint_url": endpoint_url},
    })


def per_learner_round(totals: list[float], rounds: int) -> float:
    return sum(totals) / len(totals) / rounds


def measure(spec, log: Log) -> dict:
    """Train the arm's learners; their counters per learner and round, and the planner's."""
    from training.learner.ledger import read_summaries
    from training.planning.planner import replay

    run_id, store, _ = new_run(spec, "scaling")
    began = time.monotonic()
    train_islands(spec, run_id, log)
    wall = time.monotonic() - began
    summaries = read_summaries(spec, store)
    rounds = spec.sync.rounds
    links = [s.links for s in summaries]
    step_seconds = {island.name: sum(r["compute_s"] for s in summaries if s.island == island.name for r in s.rounds)
                    / (island.learners * rounds * island.inner_steps) for island in spec.islands}
    plans = replay(spec, step_seconds, 1e18)
    return {
        "mode": spec.sync.mode, "learners": len(summaries), "rounds": rounds, "wall_s": wall,
        "missed_exchanges": sum(len(s.missed_exchanges) for s in summaries),
        "step_seconds": step_seconds,
        "measured": {
            "requests": per_learner_round([sum(c["requests"] for c in link.values()) for link in links], rounds),
            "polls": per_learner_round([sum(c["polls"] for c in link.values()) for link in links], rounds),
            "bytes_written": per_learner_round([s.bytes_written for s in summaries], rounds),
            "bytes_read": per_learner_round([s.bytes_read_intra + s.bytes_read_inter for s in summaries], rounds),
            "seconds_syncing": per_learner_round([s.seconds_syncing for s in summaries], rounds)},
        "planned": {
            "requests": per_learner_round([p.requests for p in plans], rounds),
            "polls": per_learner_round([p.polls for p in plans], rounds),
            "bytes_written": per_learner_round([p.bytes_written for p in plans], rounds),
            "bytes_read": per_learner_round([sum(p.bytes_read.values()) for p in plans], rounds),
            "seconds_syncing": per_learner_round([p.blocked_s for p in plans], rounds)},
    }


def run_arms(sizes: list[int], rounds: int, lock_path: str | None, log: Log) -> None:
    from infra.seaweed import seaweed_server

    todo = [(mode, n) for n in sizes for mode in MODES if not arm_path(mode, n, rounds).exists()]
    if not todo:
        log("every arm is done")
        return
    with tempfile.TemporaryDirectory(prefix="scaling-s3-") as data_dir, seaweed_server(Path(data_dir)) as server:
        os.environ.update(server.env())
        began = time.monotonic()
        for done, (mode, n) in enumerate(todo):
            log(f"arm {mode} N={n} ({done + 1}/{len(todo)})")
            with cpu_lock(lock_path):
                result = {**provenance(), **measure(spec_for(mode, n, rounds, server.endpoint_url), log)}
            arm_path(mode, n, rounds).write_text(json.dumps(result, indent=1) + "\n")
            elapsed = time.monotonic() - began
            log(f"arm {mode} N={n} done in {result['wall_s']:.0f} s: measured {json.dumps(result['measured'])}; "
                f"ETA {elapsed / (done + 1) * (len(todo) - done - 1):.0f} s")


def arm_path(mode: str, learners: int, rounds: int) -> Path:
    return RESULTS / "arms" / f"{mode}-n{learners}-r{rounds}.json"


def load_arms() -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (RESULTS / "arms").glob("*.json")),
                  key=lambda a: (a["mode"], a["learners"]))


def table_markdown(arms: list[dict], figure: str) -> str:
    """The table, then the figure at `figure` (a link relative to where the Markdown lands)."""
    lines = ["# Exchange cost per learner and round against the number of learners", "",
             "Measured: the learners' own transport counters (`python -m benchmarks.scaling`). Planned: "
             "`training.planning.planner.replay` for the same spec. Polls are planned at one per message read (a floor). "
             "Seconds syncing: measured is the round loop's wait on the exchange, planned is time blocked on the "
             "link with the arm's own step times (neither store latency nor shared cores are modelled).", "",
             "| sync | N | requests (measured / planned) | polls (measured / planned) | bytes written | "
             "bytes read (measured / planned) | seconds syncing (measured / planned) | missed |",
             "|---|---|---|---|---|---|---|---|"]
    for a in arms:
        m, p = a["measured"], a["planned"]
        lines.append(
            f"| {a['mode']} | {a['learners']} | {m['requests']:.2f} / {p['requests']:.2f} "
            f"({relative_change(m['requests'], p['requests'])}) | {m['polls']:.2f} / {p['polls']:.2f} | "
            f"{m['bytes_written']:,.0f} ({relative_change(m['bytes_written'], p['bytes_written'])}) | "
            f"{m['bytes_read']:,.0f} / {p['bytes_read']:,.0f} ({relative_change(m['bytes_read'], p['bytes_read'])}) | "
            f"{m['seconds_syncing']:.3f} / {p['seconds_syncing']:.3f} | {a['missed_exchanges']} |")
    lines += ["", f"![exchange cost against N]({figure})", ""]
    return "\n".join(lines)


def plot(arms: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The plan's seconds syncing on loopback are about zero (it models the link, not the shared cores),
    # so that panel shows what was measured only.
    figures = (("requests", "store requests", True), ("polls", "polls (planned: the floor)", True),
               ("bytes_read", "bytes read", True), ("seconds_syncing", "seconds syncing", False))
    fig, axes = plt.subplots(1, len(figures), figsize=(16, 4))
    for ax, (key, label, planned) in zip(axes, figures):
        for mode, colour in zip(MODES, ("tab:blue", "tab:red")):
            mine = [a for a in arms if a["mode"] == mode]
            if not mine:
                continue
            n = [a["learners"] for a in mine]
            ax.plot(n, [a["measured"][key] for a in mine], "o", color=colour, label=f"{mode} measured")
            if planned:
                ax.plot(n, [a["planned"][key] for a in mine], "-", color=colour, alpha=0.6, label=f"{mode} planned")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("learners N")
        ax.set_title(f"{label} per learner and round")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tables() -> None:
    arms = load_arms()
    plot(arms, RESULTS / "scaling.png")
    write_results_page("scaling", table_markdown(arms, figure=f"../../{RESULTS}/scaling.png"), sources=str(RESULTS),
                       command="python -m benchmarks.scaling --table", **recorded(arms))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-lock", help="a lock file to hold while an arm trains")
    parser.add_argument("--table", action="store_true", help="only rebuild the table and figure from finished arms")
    args = parser.parse_args(argv)
    if any(n < 2 or n % 2 for n in args.learners):
        parser.error("--learners: each N must be even (two islands of N/2)")
    (RESULTS / "arms").mkdir(parents=True, exist_ok=True)
    if not args.table:
        run_arms(args.learners, args.rounds, args.cpu_lock, Log(RESULTS / "progress.log"))
    write_tables()
    return 0


if __name__ == "__main__":
    sys.exit(main())
