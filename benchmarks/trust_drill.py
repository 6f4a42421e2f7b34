"""Trust drill: an attacker holding west's writer key plants objects in the middle of a signed run on
SeaweedFS, against the same run without the attack.

Two islands, east and west, each with its own signing key; the run's store is one SeaweedFS bucket
that the attacker can write, with west's S3 credentials and west's signing key. Once east's first
learner has committed a checkpoint of round 2 or later, the attacker plants, each signed with west's key:
a checkpoint of that learner two rounds ahead, its message of the next round, a life of its that
skips every round, a summary of another east learner, a lease claim of the next term, the
consolidated model's newest rewrite and the standard model's. Both arms run the product's
lifecycle (`flows.lifecycle.run_lifecycle`) against a Prefect test server.

    .venv/bin/python -m benchmarks.trust_drill

After the attacked run, its `evaluate` stage's result record is replaced by one with flattering bpb,
signed with west's key, and the run is resumed: the stage must run again and report its own bpb.

Result: `benchmarks/results/trust_drill.json`: `refused` (counts by kind of object, the attacked run's
report), `refused_on_resume` (what the resume refused: the forged stage result, the planted lease
claim its lease check reads, the planted models again), `bpb_relative` (per evaluation, attacked against
clean), `crashes` (learner lives that did not end cleanly), `resumed_bpb_equal`, `planted`, and both
reports' bpb.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.results_page import provenance, write_results_page
from infra import layout
from infra.authority import CONTROL, Authority, generate_keypair
from infra.seaweed import seaweed_server
from infra.spec import parse_spec
from infra.store import ObjectStore, refused_in_process
from infra.stores import open_run
from training.learner.ledger import read_summaries

RESULT = Path("benchmarks/results/trust_drill.json")
KEY_VARIABLES = {CONTROL: "DRILL_SIGNING_KEY_CONTROL", "east": "DRILL_SIGNING_KEY_EAST", "west": "DRILL_SIGNING_KEY_WEST"}


def drill_spec(public_keys: dict[str, str]) -> dict:
    def signing(writer: str) -> dict:
        return {"public_key": public_keys[writer], "private_key_env": KEY_VARIABLES[writer]}

    return {
        "name": "trust-drill", "seed": 0,
        "islands": [{"name": "east", "learners": 2, "batch_size": 8, "seq_len": 64, "inner_steps": 4,
                     "signing": signing("east")},
                    {"name": "west", "learners": 2, "batch_size": 8, "seq_len": 64, "inner_steps": 2,
                     "signing": signing("west")}],
        "model": {"layers": 2, "width": 64, "heads": 2},
        "data": {"corpora": [
            {"name": "prose", "source": "shakespeare", "max_documents": 12, "eval_fraction": 0.2,
             "max_eval_bytes": 40000},
            {"name": "code", "source": "python_stdlib", "max_documents": 60, "eval_fraction": 0.2,
             "max_eval_bytes": 40000}]},
        "training": {"warmup_steps": 4},
        "sync": {"mode": "butterfly", "rounds": 40, "partner_timeout_s": 30,
                 "outer": {"name": "nesterov", "lr": 1.0, "momentum": 0.0}},
        "store": {"url": "s3://archipelago/drill"},
        "signing": signing(CONTROL),
    }


def plant(attacker: ObjectStore, spec, victim: int, after_round: int) -> list[str]:
    """Plant, signed with west's key, every object the drill names; returns their keys."""
    weights = torch.zeros(8)
    planted = []

    def commit(key: str, tensors: dict, meta: dict) -> None:
        attacker.commit_tensors(key, tensors, meta)
        planted.append(f"{key}.json")

    def record(key: str, body: dict) -> None:
        attacker.put_json(key, body)
        planted.append(key)

    # Rounds far enough ahead that the victim has not written them yet.
    commit(layout.message(victim, after_round + 10), {"delta": weights}, {"learner": victim, "round": after_round + 10})
    commit(layout.checkpoint(victim, after_round + 12), {"weights": weights}, {"inner_step": 0})
    record(layout.learner_life(victim, 7), {"learner": victim, "life": 7, "start_round": spec.sync.rounds,
                                           "skipped_rounds": list(range(spec.sync.rounds)), "resumed_from": None})
    record(layout.learner_summary(victim + 1), {"learner": victim + 1, "island": "east"})
    record("lease/000002/claim.json", {"holder": "attacker", "expires_at": "9999-01-01T00:00:00+00:00"})
    for model in (layout.CONSOLIDATED, layout.BASELINE):
        commit(layout.rewrite(model, 3), {"weights": weights}, {})
    return planted


def forge_stage_result(spec, report: dict) -> str:
    """Replace the attacked run's `evaluate` record with one whose bpb flatters the islands, signed with
    west's key (raw S3 access can delete what the store's conditional writes keep); returns its path."""
    from tasks.results import RecordSigning

    store = ObjectStore.from_spec(spec.store)
    folder = "prefect-results"
    for key in store.list(folder):
        record = json.loads(json.loads(store.get_bytes(key))["record"])
        result = json.loads(record.get("result", "null")) if "metadata" in record else None
        if isinstance(result, dict) and all(isinstance(result.get(name), dict) and "islands" in result[name]
                                            for name in report["evals"]):
            for name in report["evals"]:
                result[name]["islands"]["bpb"] = 0.01
            forged = json.dumps({**record, "result": json.dumps(result)}).encode()
            store.fs.rm_file(store.address(key))
            store.put_bytes(key, RecordSigning.of(spec, "west").sign(key.removeprefix(f"{folder}/"), forged))
            return key
    raise RuntimeError("no evaluate record found to forge")


def run_arm(spec, attack: bool, log) -> dict:
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    run_id = new_run_id(spec)
    planted: list[str] = []
    done = threading.Event()

    def attacker() -> None:
        # West's key, as the attacker holds it; the victim is east's first learner.
        store = ObjectStore.from_spec(spec.store, authority=Authority.of(spec, "west")).child(f"runs/{run_id}")
        while not done.is_set():
            reached = max(layout.checkpoint_rounds(store.list(layout.learner_prefix(0))), default=-1)
            if reached >= 2:
                planted.extend(plant(store, spec, victim=0, after_round=reached))
                log(f"  planted {len(planted)} objects signed with west's key")
                return
            time.sleep(0.05)

    thread = threading.Thread(target=attacker, daemon=True)
    if attack:
        thread.start()
    started = time.monotonic()
    report = run_lifecycle(spec, run_id)
    done.set()
    return {"run_id": run_id, "wall_s": round(time.monotonic() - started, 1), "report": report, "planted": planted}


def results_markdown(result: dict) -> str:
    """The drill's page: what was planted, what was refused, and the run's bpb against the clean one."""
    refused = "\n".join(f"| {kind} | {result['refused'].get(kind, 0)} | {result['refused_on_resume'].get(kind, 0)} |"
                        for kind in sorted(set(result["refused"]) | set(result["refused_on_resume"])))
    bpb = "\n".join(f"| {name} | {result['bpb']['clean'][name]:.4f} | {result['bpb']['attacked'][name]:.4f} | "
                    f"{relative:+.2%} |" for name, relative in result["bpb_relative"].items())
    planted = "\n".join(f"- `{key}`" for key in result["planted"])
    return f"""# Trust drill: objects planted with one island's key in the middle of a signed run

An attacker holding west's S3 credentials and signing key plants, once east's first learner has
checkpointed round 2, the objects below; after the run it replaces the `evaluate` stage's result
record with one of flattering bpb and the run is resumed. Same spec and seed without the attack as
the reference. Learner lives that did not end cleanly: {result['crashes']}. Missed exchanges: clean
{result['missed_exchanges']['clean']}, attacked {result['missed_exchanges']['attacked']}. The resume
reported the bpb it computed itself: {result['resumed_bpb_equal']}.

Planted:
{planted}

| refused, by kind | in the attacked run | on its resume |
|---|---|---|
{refused}

| evaluation | clean bpb | attacked bpb | relative |
|---|---|---|---|
{bpb}
"""


def run_lifecycle_again(spec, run_id: str) -> dict:
    from flows.lifecycle import run_lifecycle

    return run_lifecycle(spec, run_id)


def main() -> None:
    from prefect.testing.utilities import prefect_test_harness

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    public = {}
    for writer, variable in KEY_VARIABLES.items():
        os.environ[variable], public[writer] = generate_keypair()
    spec = parse_spec(drill_spec(public))
    with tempfile.TemporaryDirectory(prefix="trust-drill-") as folder, \
            seaweed_server(Path(folder), buckets=("archipelago",)) as server, \
            prefect_test_harness(server_startup_timeout=120):
        os.environ.update(server.env())
        arms = {}
        for attack in (False, True):
            log(f"arm {'attacked' if attack else 'clean'}: starting")
            arms[attack] = run_arm(spec, attack, log)
            log(f"arm {'attacked' if attack else 'clean'}: {arms[attack]['wall_s']} s")
        attacked, clean = arms[True], arms[False]
        forged = forge_stage_result(spec, attacked["report"])
        log(f"forged the evaluate stage's record ({forged}); resuming the attacked run")
        before = refused_in_process()
        resumed = run_lifecycle_again(spec, attacked["run_id"])
        refused_on_resume = {kind: count - before.get(kind, 0) for kind, count in refused_in_process().items()
                             if count > before.get(kind, 0)}
        summaries = read_summaries(spec, open_run(spec, attacked["run_id"]))
    reports = {arm: arms[flag]["report"] for arm, flag in (("clean", False), ("attacked", True))}
    result = {
        **provenance(),
        "planted": attacked["planted"] + [forged],
        "refused": attacked["report"]["trust"]["refused"],
        "refused_on_resume": refused_on_resume,
        "resumed_bpb_equal": resumed["evals"] == attacked["report"]["evals"],
        "bpb_relative": {name: e["islands_bpb"] / clean["report"]["evals"][name]["islands_bpb"] - 1
                         for name, e in attacked["report"]["evals"].items()},
        "crashes": sum(1 for s in summaries for before in s.lives[:-1] if not before["paused"]),
        "missed_exchanges": {arm: r["faults"]["missed_exchanges"] for arm, r in reports.items()},
        "bpb": {arm: {name: e["islands_bpb"] for name, e in r["evals"].items()} for arm, r in reports.items()},
        "wall_s": {"clean": clean["wall_s"], "attacked": attacked["wall_s"]},
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    write_results_page("trust-drill", results_markdown(result), sources=str(RESULT),
                       command="python -m benchmarks.trust_drill", commit=result["commit"], date=result["date"])
    log(json.dumps({k: result[k] for k in ("refused", "refused_on_resume", "bpb_relative", "crashes",
                                           "missed_exchanges")}))


if __name__ == "__main__":
    main()
