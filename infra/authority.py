"""Who may write what in a run's stores, and the signatures that prove it.

A store is data, never authority: whoever can write a bucket can put any bytes under any key,
together with the sha256 they are checked against. So every JSON document that a learner or the
control plane acts on carries an Ed25519 signature by its writer, over the document's name (the
run's prefix and its key, so a valid document cannot be replayed under another name or in another
run) and the sha256 of its body. Tensors and message parts are covered through the sha256 that a
signed document records for them.

There is one writer per island (its learners write their own rounds, lives and summaries) and one
for the control plane (spec, data, models, report, lease). Each signs with a private key from its
own environment (`signing.private_key_env`, filled from the environment or a Prefect Secret block,
never from the spec); readers check against the public keys in the spec, which the control plane
pins for its learners by the spec's hash. Which writer may sign a name is fixed by the layout
(`writer_of`): a learner's objects by its island, everything else by the control plane, so an
island's key cannot forge a record of another island or of the control plane.

A run without keys is unauthenticated: nothing is signed or checked, and its report says so.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from infra.objects import signed_tail
from infra.store_errors import IntegrityError

CONTROL = "control"
_DOMAIN = b"archipelago-object-v1\0"
_RUN_KEY = re.compile(r"^runs/[^/]+/(.*)$")
_LEARNER_KEY = re.compile(r"^(?:learners/|liveness/learner-)(\d{3,})/")
# Drill markers (`layout.fault_marker`) are written by learners and by the control plane alike; a
# forged one can only keep an injected fault from striking.
_ANY_WRITER = ("faults/", "_probe/")
# Standard training's model and snapshots, possibly rewritten (layout.rewrite): an island may train it.
_BASELINE_KEY = re.compile(r"^(?:rewrites/\d+/)?models/baseline")


class Unauthenticated(IntegrityError):
    """A document whose signature is missing, malformed, by the wrong writer, or does not verify."""


def encode_key(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _decode_key(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64") from None
    if len(raw) != 32:
        raise ValueError(f"{what} must be 32 bytes (an Ed25519 key), got {len(raw)}")
    return raw


def public_key_of(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_decode_key(text, "public key"))


def generate_keypair() -> tuple[str, str]:
    """(private, public), base64: the private key goes into the writer's environment, the public one into the spec."""
    from cryptography.hazmat.primitives import serialization
    private = Ed25519PrivateKey.generate()
    raw_private = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())
    raw_public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return encode_key(raw_private), encode_key(raw_public)


def public_key_from_private(text: str) -> str:
    """The public key (base64) of a private key (base64)."""
    from cryptography.hazmat.primitives import serialization
    private = Ed25519PrivateKey.from_private_bytes(_decode_key(text, "private key"))
    return encode_key(private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def placeholder_signature(writer: str) -> dict:
    """A signature's shape and size (Ed25519 signatures are 64 bytes), for planning what a document weighs."""
    return {"by": writer, "ed25519": encode_key(bytes(64))}


def _message(name: str, digest: str) -> bytes:
    return _DOMAIN + name.encode() + b"\0" + digest.encode()


@dataclass(frozen=True)
class Signer:
    writer: str  # CONTROL or an island's name
    key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def from_environment(cls, writer: str, variable: str) -> "Signer":
        text = os.environ.get(variable)
        if not text:
            raise KeyError(f"writer {writer!r}: its signing key is not in the environment (${variable}); "
                           f"the run's spec lists public keys, so its objects must be signed")
        try:
            return cls(writer, Ed25519PrivateKey.from_private_bytes(_decode_key(text, f"${variable}")))
        except ValueError as err:
            raise KeyError(f"writer {writer!r}: ${variable} {err}") from None

    def sign(self, name: str, digest: str) -> dict:
        return {"by": self.writer, "ed25519": encode_key(self.key.sign(_message(name, digest)))}


def kind_of(name: str) -> str:
    """What sort of object a name is, for counts of refused objects in the report."""
    key = _RUN_KEY.match(name)
    key = key.group(1) if key else name
    for marker, kind in (("/message", "message"), ("/checkpoint", "checkpoint"), ("/curve-weights", "curve-weights"),
                         ("/life-", "life"), ("/paused-", "pause"), ("/rendezvous-", "rendezvous"), ("/summary", "summary"), ("lease/", "lease"),
                         ("spec.json", "spec"), ("data/", "data"), ("models/", "model"), ("rewrites/", "model"),
                         ("report/", "report")):
        if marker in key or key.startswith(marker):
            return kind
    return "other"


def signing_section(spec, writer: str):
    """The spec's signing keys of `writer` (CONTROL or an island's name); None in a run without keys."""
    if spec.signing is None:
        return None
    return spec.signing if writer == CONTROL else next(i for i in spec.islands if i.name == writer).signing


def foreign_signing_keys(spec, writer: str) -> list[str]:
    """The environment variables holding every other writer's private key: what a process of `writer`
    (an island's learner) must not inherit where one environment holds several (a single-host run)."""
    if spec.signing is None:
        return []
    sections = {CONTROL: spec.signing, **{island.name: island.signing for island in spec.islands}}
    own = sections[writer].private_key_env
    return sorted({section.private_key_env for section in sections.values()} - {own})


@dataclass(frozen=True)
class Authority:
    """One process's part in a run's signatures: the key it signs with (None: it writes nothing that is
    read as authority) and every writer's public key."""

    public_keys: dict[str, Ed25519PublicKey]
    island_of_learner: tuple[str, ...]
    signer: Signer | None = None
    baseline_island: str | None = None  # the island that trains standard training, besides the control plane

    @classmethod
    def of(cls, spec, writer: str | None) -> "Authority | None":
        """The authority of `writer` (CONTROL, an island's name, or None for a reader alone) in a run;
        None when the run has no keys."""
        if spec.signing is None:
            return None
        keys = {CONTROL: public_key_of(spec.signing.public_key)}
        keys.update({island.name: public_key_of(island.signing.public_key) for island in spec.islands})
        signer = None
        if writer is not None:
            signer = Signer.from_environment(writer, signing_section(spec, writer).private_key_env)
        return cls(keys, tuple(slot.island.name for slot in spec.learners), signer, spec.evaluation.baseline_island)

    def writer_of(self, name: str) -> tuple[str, ...]:
        """Who may sign the object `name` (relative to the store's outermost root)."""
        key = _RUN_KEY.match(name)
        if key is None:
            return (CONTROL,)
        rest = key.group(1)
        if rest.startswith(_ANY_WRITER):
            return tuple(self.public_keys)
        if self.baseline_island is not None and _BASELINE_KEY.match(rest):
            return (CONTROL, self.baseline_island)
        learner = _LEARNER_KEY.match(rest)
        if learner is None:
            return (CONTROL,)
        index = int(learner.group(1))
        return (self.island_of_learner[index],) if index < len(self.island_of_learner) else ()

    def sign(self, name: str, digest: str) -> dict | None:
        return None if self.signer is None else self.signer.sign(name, digest)

    def verify_unparsed(self, name: str, document: bytes) -> tuple[str, dict]:
        """The sha256 and signature a stored JSON document records, read from its last bytes and checked
        before its body is parsed (Unauthenticated otherwise); the parsed document must record the same."""
        tail = signed_tail(document)
        if tail is None:
            raise Unauthenticated(f"object {name}: not signed")
        self.verify(name, *tail)
        return tail

    def verify(self, name: str, digest: str, signature) -> None:
        """Raise Unauthenticated unless `signature` is a valid signature of (name, digest) by a writer
        allowed to write `name` (see `verify_signature`)."""
        verify_signature({writer: self.public_keys[writer] for writer in self.writer_of(name)}, name, digest,
                         signature)


def verify_signature(public_keys: dict[str, Ed25519PublicKey], name: str, digest: str, signature) -> None:
    """Raise Unauthenticated unless `signature` is a valid signature of (name, digest) by one of the writers
    of `public_keys`, the only ones allowed to write `name`. The refusal names the object, never what the
    document claims."""
    if not isinstance(signature, dict) or not isinstance(signature.get("by"), str) \
            or not isinstance(signature.get("ed25519"), str):
        raise Unauthenticated(f"object {name}: not signed")
    writer = signature["by"]
    if writer not in public_keys:
        raise Unauthenticated(f"object {name}: signed by a writer that may not write it")
    try:
        raw = base64.b64decode(signature["ed25519"], validate=True)
        public_keys[writer].verify(raw, _message(name, digest))
    except (binascii.Error, ValueError, InvalidSignature):
        raise Unauthenticated(f"object {name}: its signature does not verify") from None
