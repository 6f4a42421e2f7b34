"""Where tests write `files` corpora: in the session's data root (tests/conftest.py), apart from the
stores a test's tmp_path holds, which no data root may hold."""

import os
from pathlib import Path

from training.data.corpora import DATA_ROOT_ENV


def corpus_folder(tmp_path: Path) -> Path:
    """This test's own folder in the data root."""
    folder = Path(os.environ[DATA_ROOT_ENV]) / tmp_path.name
    folder.mkdir(exist_ok=True)
    return folder
