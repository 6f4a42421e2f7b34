"""Failures end to end: real SeaweedFS, real Prefect API, learners as real processes."""

import asyncio
import re

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import FlowRunSort

from infra import layout
from infra.spec import parse_spec
from infra.store import run_store
from tests.test_lifecycle import TINY


def tiny(**changes):
    return parse_spec({**TINY, **changes})


def test_run_survives_a_killed_learner_store_errors_and_a_corrupt_object(s3_env):
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    spec = tiny(sync={**TINY["sync"], "rounds": 6, "partner_timeout_s": 20},
                faults=[{"kind": "kill_learner", "learner": 1, "round": 2},
                        {"kind": "store_errors", "rate": 0.05},
                        {"kind": "corrupt_object", "learner": 0, "round": 1}])
    report = run_lifecycle(spec, new_run_id(spec))

    faults = report["faults"]
    assert faults["injected"]["kill_learner"] == 1 and faults["recovered"] == 1
    assert sum(v for k, v in faults["injected"].items() if k.startswith("store_")) > 0
    assert faults["store_retries"] > 0
    assert faults["corrupt_reads_detected"] == 1  # learner 0's round-1 message, read by its partner 1
    assert "1" in faults["rejoined"]
    for scores in report["evals"].values():
        assert 0 < scores["islands_bpb"] < 8
    store = run_store(spec.store, report["run_id"])
    assert all(store.is_committed(layout.checkpoint(i, 5)) for i in range(3))


def _latest_flow_run():
    async def read():
        async with get_client() as client:
            return (await client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1))[0]
    return asyncio.run(read())


def test_a_failed_evaluation_reruns_only_evaluation_and_report(s3_env, prefect_api, tmp_path, capsys):
    from flows.cli import main
    from flows.lifecycle import stage_states

    config = tmp_path / "fail-evaluation.yaml"
    config.write_text(yaml.safe_dump({**TINY, "faults": [{"kind": "fail_stage", "stage": "evaluate"}]}))
    assert main(["run", str(config)]) == 1
    out, err = capsys.readouterr()
    run_id = re.search(r"^run (\S+): store", out, re.M).group(1)
    assert "failed on purpose" in err and f"archipelago resume {run_id}" in err
    assert re.search(r"^  failed: evaluate$", out, re.M)
    failed = _latest_flow_run()
    assert failed.state.is_failed()

    assert main(["resume", run_id, "--config", str(config)]) == 0  # the store's spec must be this one
    out, _ = capsys.readouterr()
    retried = _latest_flow_run()
    assert retried.id != failed.id and f"stages of flow run {retried.id}" in out
    states = stage_states(retried.id)
    executed = {name for name, state in states.items() if state == "Completed"}
    cached = {name for name, state in states.items() if state == "Cached"}
    assert executed == {"evaluate", "evaluate-curve", "report", "figures"}
    assert cached >= {"start-run", "prepare-data", "consolidate", "train-standard-baseline"}
    assert sum(n.startswith("train-") and "-learner-" in n for n in cached) == 3
    assert re.search(r"^  ran: evaluate, evaluate-curve, figures, report$", out, re.M)
