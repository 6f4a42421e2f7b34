"""The README's "Your own data and model" as a new user runs it: its command lines, as written, in a
fresh folder with only the project's venv and a shrunk copy of `configs/own-data.yaml` (fewer rounds and
steps, one learner an island), on texts of the user's own. The last line starts TensorBoard's server;
instead of it, the test reads the event files that server would show."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Your own data and model"
STEP_SERIES = ("inner_loss", "learning_rate", "grad_norm", "peak_memory_bytes")


def readme_lines() -> list[str]:
    """The command lines of the section's first code block, comments stripped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", text[text.index(SECTION):], re.S).group(1)
    return [line.split("   #")[0].strip() for line in block.splitlines() if line.strip()]


def shrunk_config() -> dict:
    raw = yaml.safe_load((ROOT / "configs/own-data.yaml").read_text())
    for island, steps in zip(raw["islands"], (3, 2)):
        island.update(learners=1, batch_size=4, seq_len=32, inner_steps=steps)
    raw["sync"]["rounds"] = 2
    raw["training"]["warmup_steps"] = 2
    raw["evaluation"] = {"baseline": "none"}  # standard training has tests of its own
    return raw


def own_texts(folder: Path) -> None:
    """About 0.34 MB of the user's own text (room for 2,048 ids): standard-library modules, as plain .txt
    files in subfolders."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    modules = sorted(p for p in stdlib.glob("*.py") if 15_000 < p.stat().st_size < 60_000)[:12]
    for n, module in enumerate(modules):
        (folder / f"part{n % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"part{n % 3}" / f"{module.stem}.txt").write_text(module.read_text())


def test_the_readme_path_from_own_texts_to_an_exported_model_and_per_step_curves(tmp_path):
    lines = readme_lines()
    assert lines[0].startswith("export ARCHIPELAGO_DATA_ROOT=") and "tensorboard --logdir" in lines[-1]
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/own-data.yaml").write_text(yaml.safe_dump(shrunk_config()))
    home = tmp_path / "home"
    own_texts(home / "my-texts")
    # A new user's shell: no test data root, no Prefect API of the test session.
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("ARCHIPELAGO_", "PREFECT_API", "PREFECT_HOME"))}
    env["HOME"] = str(home)
    script = tmp_path / "own-data.sh"

    def run(line: str) -> str:
        script.write_text("set -euo pipefail\n" + "\n".join(done + [line]) + "\n")
        result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        return result.stdout

    done: list[str] = []
    for line in lines[:-1]:
        if "RUN_ID" in line:
            report = json.loads((tmp_path / "reports/own-data.json").read_text())
            line = line.replace("RUN_ID", shlex.quote(report["run_id"]))
        if line.startswith("export ") or line.startswith("mkdir"):
            done.append(line)  # the shell's own state, kept for the lines after it
            continue
        run(line)

    assert sorted(p.name for p in (tmp_path / "data/texts").rglob("*.txt")) == \
        sorted(p.name for p in (home / "my-texts").rglob("*.txt"))
    for scores in report["evals"].values():
        assert 0 < scores["islands_bpb"] < 12

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = tmp_path / "exported/own-data"
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    trained = Tokenizer.from_file(str(tmp_path / "data/tokenizer.json"))
    text = "def own_data(path):\n    return path.read_text()\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == trained.encode(text, add_special_tokens=False).ids
    # The model's ids: the vocabulary's 2,048, then the document separator.
    assert model.config.vocab_size == len(tokenizer) == 2049 and tokenizer.eos_token_id == 2048
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 2049) and torch.isfinite(logits).all()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((tmp_path / ".archipelago/tensorboard").iterdir())
    assert [run.name for run in runs] == [report["run_id"]]
    scalars: dict[str, list] = {}
    for events in runs[0].rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(event.step for event in accumulator.Scalars(tag))
    for series in STEP_SERIES:  # learners are numbered over the run: east's is 0, west's 1
        for tag, steps in (("east/learner-0", 3), ("west/learner-1", 2)):
            assert sorted(set(scalars[f"{series}/{tag}"])) == list(range(1, 2 * steps + 1)), series
