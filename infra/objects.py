"""What a store's objects are, apart from any store: the shape of keys and store urls, checksums,
the references JSON documents point with, and the JSON envelope a document travels in.

Nothing here reads or writes a store, so the run spec (which checks its store urls and hashes
itself) and readers of documents that no store served use the same rules as `infra.store`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from infra.store_errors import StoreError

# A segment cannot start with '.', which keeps out '.', '..' and hidden temporary files.
KEY_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]*")
_KEY = re.compile(rf"{KEY_SEGMENT.pattern}(/{KEY_SEGMENT.pattern})*")
# S3's bucket naming rules (3-63 lowercase letters, digits, dots and hyphens, alphanumeric ends).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# What a JSON document may weigh unless its reader says otherwise: commits, records and manifests are
# kilobytes; a checkpoint's commit carries the learner's ledger, which grows with its rounds.
JSON_MAX_BYTES = 16 << 20
# A document nested deeper than this is refused before it is parsed (json.loads would recurse).
_JSON_MAX_DEPTH = 64
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise StoreError(f"invalid object key {key!r}: use relative paths of [A-Za-z0-9_.=-] segments")
    return key


def parse_store_url(url: str) -> str:
    """The normalised store root: an absolute local folder path, or s3://bucket[/prefix].

    Anything that would silently land somewhere unintended is refused: an unexpanded `~`
    (it would become a folder named `~`), a mistyped scheme such as `s3:/bucket` (it would
    become a local folder named `s3:`), other schemes, and empty or blank urls.
    """
    def refuse(why: str) -> StoreError:
        return StoreError(f"store url {url!r}: {why}; use a local folder or s3://bucket[/prefix]")

    if not isinstance(url, str) or not url.strip():
        raise refuse("empty")
    if url != url.strip() or any(ord(c) < 32 for c in url):
        raise refuse("leading/trailing whitespace or control characters")
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].rstrip("/").partition("/")
        if not bucket:
            raise refuse("no bucket")
        if not _BUCKET.fullmatch(bucket):
            raise refuse(f"bucket {bucket!r} is not a valid S3 bucket name")
        if prefix and not _KEY.fullmatch(prefix):
            raise refuse(f"prefix {prefix!r} must be [A-Za-z0-9_.=-] segments separated by single '/'")
        return f"s3://{bucket}" + (f"/{prefix}" if prefix else "")
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path.startswith("/"):
            raise refuse("a file:// url needs an absolute path (file:///path)")
    elif _SCHEME.match(url):
        raise refuse(f"unsupported scheme {url.split(':', 1)[0]!r}")
    else:
        path = url
    if path.startswith("~"):
        raise refuse("'~' is not expanded; give the folder's full path")
    return str(Path(path).resolve())


@dataclass(frozen=True)
class ObjectRef:
    """Where an object lives and what its bytes must hash to; what JSON documents point with."""

    key: str
    sha256: str
    nbytes: int

    def to_json(self) -> dict:
        return {"key": self.key, "sha256": self.sha256, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, raw: dict) -> "ObjectRef":
        return cls(key=raw["key"], sha256=raw["sha256"], nbytes=int(raw["nbytes"]))


def canonical_json(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def json_document(body: dict, digest: str | None = None, signature: dict | None = None) -> bytes:
    """A JSON object as the store writes it: the body beside the sha256 of its canonical form, and
    its writer's signature when it has one."""
    envelope = {"sha256": digest or sha256(canonical_json(body)), "body": body}
    if signature is not None:
        envelope["signature"] = signature
    return json.dumps(envelope, sort_keys=True, indent=1).encode()


# The end of a signed document as `json_document` writes it (keys sorted, so the body comes first):
# its recorded sha256 and signature, read from the last bytes alone.
_SIGNED_TAIL = re.compile(rb'"sha256": "([0-9a-f]{64})",\s*"signature": \{\s*"by": "([^"\\]{1,200})",'
                          rb'\s*"ed25519": "([A-Za-z0-9+/=]{1,200})"\s*\}\s*\}\s*$')
_SIGNED_TAIL_MAX_BYTES = 1024


def signed_tail(raw: bytes) -> tuple[str, dict] | None:
    """(recorded sha256, signature) from a signed document's last bytes, without parsing the rest; None when
    its end is not that of a signed document. A signature can then be checked before a large body is
    parsed: the envelope parsed afterwards must still record the same digest and signature."""
    found = _SIGNED_TAIL.search(raw[-_SIGNED_TAIL_MAX_BYTES:])
    if found is None:
        return None
    digest, writer, signature = (part.decode() for part in found.groups())
    return digest, {"by": writer, "ed25519": signature}


def verified_envelope(raw: bytes) -> dict | None:
    """The envelope of a JSON document whose body is an object matching its recorded sha256; else None.
    Nesting is bounded before parsing: json.loads recurses, and a document of brackets would crash it."""
    if _nesting_depth(raw) > _JSON_MAX_DEPTH:
        return None
    try:
        envelope = json.loads(raw)
        body, recorded = envelope["body"], envelope["sha256"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(recorded, str):
        return None
    return envelope if sha256(canonical_json(body)) == recorded else None


def _nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings counted too: an upper bound)."""
    depth = deepest = 0
    for byte in raw.translate(None, delete=_NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest
