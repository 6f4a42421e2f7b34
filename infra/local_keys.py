"""The signing keys a host keeps for its writers, so that a run signs by default.

`archipelago keys` makes a key pair per writer into a folder; `archipelago run`, `serve` and `deploy`
give a spec without keys (and without `unauthenticated: true`) the keys of `<keys root>/<spec name>/`,
made there on first use and kept, so a resume or a later run of the same spec signs with the same keys
and its spec (and hash) stays the same. The root is `$ARCHIPELAGO_KEYS_DIR`, else `.archipelago/keys`
of the working directory: mode 0700, each private key a file of its own, mode 0600. It must lie outside
the data root (training/data/corpora.py refuses a root that holds it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from infra.authority import CONTROL, generate_keypair, public_key_from_private, signing_section

KEYS_DIR_ENV = "ARCHIPELAGO_KEYS_DIR"
SIGNING_KEY_PREFIX = "ARCHIPELAGO_SIGNING_KEY_"
DEFAULT_KEYS_DIR = ".archipelago/keys"
# A spec's and an island's names as the spec allows them: the only names that become a path here.
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,47}$")


def keys_root() -> Path:
    return Path(os.environ.get(KEYS_DIR_ENV) or DEFAULT_KEYS_DIR).resolve()


def private_key_env(writer: str) -> str:
    """The environment variable a writer's private key is in where it runs."""
    return SIGNING_KEY_PREFIX + writer.upper().replace("-", "_")


def owner_only_folder(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def new_private_key(folder: Path, writer: str) -> str:
    """A new key pair of `writer`: its private key into `<folder>/<writer>.key` (0600, never over an
    existing file); returns the public key."""
    private, public = generate_keypair()
    with os.fdopen(os.open(folder / f"{writer}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(private + "\n")
    return public


def signing_of(folder: Path, writer: str) -> tuple[dict, str]:
    """`writer`'s spec section (public key, variable) and private key from `folder`, made there when missing."""
    path = folder / f"{writer}.key"
    if not path.exists():
        new_private_key(folder, writer)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} is readable by other users: chmod 600 it")
    private = path.read_text().strip()
    return {"public_key": public_key_from_private(private), "private_key_env": private_key_env(writer)}, private


def with_host_keys(raw: dict, sign: bool = True) -> dict:
    """`raw` (a spec's YAML, not yet validated) with the signing sections of this host's keys for its
    spec name and, to `sign`, every writer's private key put in this process's environment, which its
    learners inherit only their own island's of (infra/supervision.py). Unchanged when the spec has
    keys, says `unauthenticated: true`, or its names are not ones the spec allows (validation then
    says why)."""
    islands = raw.get("islands")
    name = raw.get("name", "archipelago")
    if raw.get("signing") is not None or raw.get("unauthenticated") or not isinstance(islands, list) \
            or not all(isinstance(i, dict) and isinstance(i.get("name"), str) and _NAME.fullmatch(i["name"])
                       for i in islands) \
            or any(i.get("signing") is not None for i in islands) or not isinstance(name, str) \
            or not _NAME.fullmatch(name):
        return raw
    owner_only_folder(keys_root())
    folder = owner_only_folder(keys_root() / name)
    sections = {}
    for writer in [CONTROL, *(i["name"] for i in islands)]:
        sections[writer], private = signing_of(folder, writer)
        if sign:
            os.environ[sections[writer]["private_key_env"]] = private
    return {**raw, "signing": sections[CONTROL],
            "islands": [{**island, "signing": sections[island["name"]]} for island in islands]}


def with_pinned_host_keys(spec) -> None:
    """Put in this process's environment the private keys this host keeps for `spec`'s writers whose
    variables are unset, each only when its public key is the one the spec names (a resume from a store)."""
    folder = keys_root() / spec.name
    for writer in [CONTROL, *(i.name for i in spec.islands)]:
        section, path = signing_section(spec, writer), folder / f"{writer}.key"
        if section is None or os.environ.get(section.private_key_env) or not path.is_file():
            continue
        private = path.read_text().strip()
        if public_key_from_private(private) == section.public_key:
            os.environ[section.private_key_env] = private
