"""A failed run advises `resume` only where a resume can get past the failure; otherwise it says what to fix."""

import pytest
import torch
import yaml

from infra.resumable import what_to_fix
from infra.spec import SpecError
from infra.store import StoreError
from infra.supervision import LearnerFailed, LearnerMisconfigured
from training.data.corpora import DataError


@pytest.mark.parametrize("error, fixable_by_resume", [
    (DataError("model.init_from: ... does not fit the spec's model"), False),
    (SpecError("invalid run spec: model: ..."), False),
    (LearnerMisconfigured("learner 0 cannot start: ..."), False),
    (LearnerFailed("learner 0 failed (killed by signal 9)"), True),
    (StoreError("the store did not answer"), True),
    (RuntimeError("anything else"), True),
])
def test_only_errors_a_resume_would_meet_again_need_a_fix_first(error, fixable_by_resume):
    assert (what_to_fix(error) is None) == fixable_by_resume


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_a_learner_that_cannot_start_on_its_host_fails_the_run_without_advising_resume(
        tmp_path, capsys, prefect_api):
    from flows.cli import main

    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump({
        "name": "no-gpu",
        "islands": [{"name": "east", "device": "cuda", "learners": 2, "batch_size": 2, "seq_len": 16,
                     "inner_steps": 1}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "code", "source": "python_stdlib", "max_documents": 12}]},
        "sync": {"rounds": 2}, "evaluation": {"baseline": "none"},
        "store": {"url": str(tmp_path / "store")}}))
    assert main(["run", str(config)]) == 1
    out, err = capsys.readouterr()
    assert "cannot start: learner 0: island east has device cuda, and torch finds no CUDA device on this host" in err
    assert "a learner cannot start on its island's host as the spec asks" in err
    assert "archipelago resume" not in err
