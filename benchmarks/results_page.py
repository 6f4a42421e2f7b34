"""A benchmark's or experiment's page in docs/results/: written whole from its result files, never spliced into another
page, under the commit and date those files record (`provenance`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "results"


def provenance() -> dict[str, str]:
    """What a result file records of the code that measured it: the commit (marked when tracked files
    besides results had uncommitted changes) and the date."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    # Result files and pages are what benchmarks write, not code: a chain of benchmarks stays clean.
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results",
                ":(exclude,glob)experiments/*/results/**", ":!docs/results")
    return {"commit": git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty else ""),
            "date": time.strftime("%Y-%m-%d")}


def recorded(results: list[dict]) -> dict[str, str | None]:
    """The commits and dates that result files made at different times record, each once (None where none do)."""
    def distinct(field: str) -> str | None:
        values = list(dict.fromkeys(r[field] for r in results if r.get(field)))
        return ", ".join(values) if values else None

    return {"commit": distinct("commit"), "date": distinct("date")}


def write_results_page(name: str, markdown: str, *, sources: str, command: str, commit: str | None = None,
                       date: str | None = None, pages: Path = PAGES) -> Path:
    """Write `pages/<name>.md`: the benchmark's own Markdown (its first line its `# title`), with, under the
    title, the commit and date its result files record (or that they record none), where those files are
    (`sources`, relative to the repository root) and the command that writes the page."""
    title, _, body = markdown.partition("\n")
    measured = (f"Measured at commit {commit}" if commit else "Measured at a commit not recorded") + (
        f" on {date}." if date else ", on a date not recorded.")
    link = Path("../..") / sources  # the pages live two folders below the repository root
    page = pages / f"{name}.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"{title}\n\n{measured} Result files: [`{sources}`]({link.as_posix()}). "
                    f"Written by `{command}` from them; rerun it rather than editing this page.\n{body.rstrip()}\n")
    return page
