"""`archipelago gpu-check`: what it says when its input is wrong, before anything trains."""

from __future__ import annotations

import pytest
import torch

from flows.cli import main
from infra import layout
from training.gpu_check import PRECISIONS, check_run_store


def test_run_without_prepared_runs_names_the_missing_ones_and_the_step_that_makes_them(tmp_path, capsys):
    check_run_store(str(tmp_path), "fp32").put_json(layout.SPEC, {"name": "gpu-fp32"})
    assert main(["gpu-check", "run", "--store", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no prepared check run bf16 in ") and "archipelago gpu-check prepare" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run trains")
def test_run_on_a_machine_without_cuda_says_where_it_runs(tmp_path, capsys):
    for precision in PRECISIONS:
        check_run_store(str(tmp_path), precision).put_json(layout.SPEC, {"name": f"gpu-{precision}"})
    assert main(["gpu-check", "run", "--store", str(tmp_path), "--out", str(tmp_path / "result.json")]) == 2
    assert capsys.readouterr().err == "error: no CUDA device here: `archipelago gpu-check run` trains on the GPU machine\n"
    assert not (tmp_path / "result.json").exists()


def test_prepare_with_a_missing_config_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["gpu-check", "prepare", "--config", str(tmp_path / "absent.yaml"), "--store", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: run spec not found: {tmp_path / 'absent.yaml'}"
    with pytest.raises(SystemExit) as exited:
        main(["gpu-check", "check"])
    assert exited.value.code == 2
