"""The learners' progress protocol: one JSON object per stdout line, with an "event" field.

The island's Prefect task and the benchmarks relay these lines; anything else a learner prints
(a library's warning, a traceback) is passed on as text.
"""

from __future__ import annotations

import json


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def parse(line: str) -> dict | None:
    """The event a line carries, or None for a line that is not one."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None
