"""A benchmark's page in docs/results/: written whole from its result files, never spliced into another page."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "results"


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
