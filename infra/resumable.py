"""Whether a failed run can be resumed as it is, or needs a fix first.

A resume reruns the same spec from the run's store: it gets past a crash, a killed learner, a store or a
host that went away, but not an error that the spec, its data or a host's setup make, which it would meet
again. Those are refused before any work where they can be seen (the spec at load, data paths and memory
in the run's preflight); the ones that show only once the run is under way are told apart here.
"""

from __future__ import annotations

from infra.spec import SpecError
from infra.supervision import LearnerMisconfigured


def what_to_fix(err: BaseException) -> str | None:
    """What a run that failed with `err` needs before it can go on, when a resume alone would fail the
    same way; None when a resume may get past it."""
    if isinstance(err, LearnerMisconfigured):
        return ("a learner cannot start on its island's host as the spec asks: fix that host's setup, or the "
                "spec (then start a new run); a resume before that fails the same way")
    if isinstance(err, SpecError):  # the spec, its data (training.data.corpora.DataError), its memory plan
        return ("the spec or its data cannot run as they are: fix what the error names and start a new run "
                "(a resume reruns the same spec)")
    return None
