"""transformers causal LMs trained across islands by the whole lifecycle: a dense Llama (with no
baseline: `evaluation.baseline: none`) and a sparse Mixtral (against standard training), each on a
BPE vocabulary `archipelago tokenizer train` makes from the built-in corpora, 2 islands (of 2 learners
and of 1), learners as real processes, `archipelago run` on a local store."""

from __future__ import annotations

import json

import pytest
import yaml

from flows.cli import main
from infra import layout
from infra.local_keys import with_host_keys
from infra.spec import load_spec, parse_spec
from infra.store import run_store
from tests.corpora import corpus_folder
from tests.test_lifecycle import TINY
from tests.test_models import MODELS
from training.planning.planner import plan_run

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name, baseline", [("llama", "none"), ("mixtral", "standard")])
def test_a_transformers_model_trains_across_islands_to_its_report(name, baseline, tmp_path, prefect_api, capsys):
    config = tmp_path / f"{name}.yaml"
    raw = {
        "name": f"hf-{name}", "model": MODELS[name],
        "islands": [{"name": "east", "learners": 2, "batch_size": 4, "seq_len": 32, "inner_steps": 3},
                    {"name": "west", "learners": 1, "batch_size": 8, "seq_len": 32, "inner_steps": 2}],
        "data": {"corpora": TINY["data"]["corpora"]},
        "training": {"warmup_steps": 2},
        "sync": {"mode": "butterfly", "rounds": 3, "partner_timeout_s": 60,
                 "transport": {"fragments": 2, "compression": "int8"}},
        "evaluation": {"baseline": baseline},
        # The Llama run's learner 1 is SIGKILLed mid-round and resumes from its checkpoint.
        "faults": [{"kind": "kill_learner", "learner": 1, "round": 1}] if name == "llama" else [],
        "store": {"url": str(tmp_path / "store")},
    }
    config.write_text(yaml.safe_dump(raw))
    vocabulary = corpus_folder(tmp_path) / "tokenizer.json"
    assert main(["tokenizer", "train", str(config), "--vocab-size", "512", "--out", str(vocabulary)]) == 0
    raw["data"]["tokenizer"] = yaml.safe_load(capsys.readouterr().out)["data"]["tokenizer"]
    config.write_text(yaml.safe_dump(raw))
    report_path = tmp_path / "report.json"
    assert main(["run", str(config), "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    spec = load_spec(config)

    tokens = (2 * 4 * 3 + 8 * 2) * 32 * 3
    compute = report["compute"]
    assert report["baseline"] == baseline and compute["islands_tokens"] == tokens
    for scores in report["evals"].values():
        assert 0 < scores["islands_bpb"] < 9
        if baseline == "standard":
            assert 0 < scores["baseline_bpb"] < 9 and compute["baseline_tokens"] == tokens
        else:
            assert scores["baseline_bpb"] is None and compute["baseline_tokens"] is None
    printed = capsys.readouterr().out
    assert ("no standard training (evaluation.baseline: none)" in printed) == (baseline == "none")
    assert compute["parameters_total"] == spec.model.parameter_count(spec.max_seq_len, spec.vocab_size)
    assert 256 < spec.vocab_size <= 513
    assert (compute["parameters_active"] < compute["parameters_total"]) == (name == "mixtral")
    # The learners' counted exchange bytes are the planner's, link class by link class.
    # The run signed with this host's keys (`run` gives a spec without keys them): so does its plan.
    signed = parse_spec(with_host_keys(yaml.safe_load(config.read_text()), sign=False))
    planned = plan_run(signed, {"east": 0.01, "west": 0.01}, 1e18)["exchange_bytes"]
    assert report["communication"]["inter_island_bytes"] == planned["inter"] > 0
    assert report["communication"]["intra_island_bytes"] == planned["intra"] > 0
    if name == "llama":
        assert report["faults"]["injected"]["kill_learner"] == 1 and report["faults"]["recovered"] == 1
    store = run_store(spec.store, report["run_id"])
    assert store.is_committed(layout.CONSOLIDATED)
    assert store.is_committed(layout.BASELINE) == (baseline == "standard")
    assert not store.list(layout.BASELINE_SNAPSHOTS) or baseline == "standard"
