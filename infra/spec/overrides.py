"""Command-line overrides of a run spec: `--set section.field=value`, laid over the YAML before the
spec is validated, so an override is held to the same schema as the file (and a typo in its path or
value gets the same error naming the field).

A path's parts are mapping keys, or list indices (`islands.0.batch_size=4`); a key the YAML lacks is
added (the schema then accepts or names it). The value is parsed as YAML: `4` is a number, `true` a
boolean, `null` empty, `[a, b]` a list, anything else a string.
"""

from __future__ import annotations

from collections.abc import Sequence

import yaml


class OverrideError(ValueError):
    """An override that cannot be applied to the spec's YAML; the message names it."""


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """`raw` (a spec's YAML as loaded) with each `path=value` of `overrides` applied in order; `raw` is
    left as it was."""
    raw = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy of plain YAML data
    for override in overrides:
        path, equals, text = override.partition("=")
        parts = path.split(".")
        if not equals or not all(parts):
            raise OverrideError(f"--set {override!r}: expected section.field=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or " ".join(str(err).split())
            raise OverrideError(f"--set {override!r}: the value is not valid YAML: {problem}") from None
        _assign(raw, parts, value, override)
    return raw


def _assign(node, parts: list[str], value, override: str) -> None:
    for depth, part in enumerate(parts):
        at = ".".join(parts[:depth]) or "the spec"
        last = depth == len(parts) - 1
        if isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # a section the YAML leaves out (or empty)
                    node[part] = {}
                node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise OverrideError(f"--set {override!r}: {at} is a list of {len(node)} entries, addressed by "
                                    f"their index from 0, not {part!r}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        else:
            raise OverrideError(f"--set {override!r}: {at} is {node!r}, not a section with fields")
