"""The run's ed25519 key: the origin signs every manifest, relays and clients verify with the public key.

The signature covers `PolicyManifest.signing_payload()` (every field but the signature, canonical JSON),
so the per-file digests and the run id are signed too: one signature authenticates every byte of a
version, and a manifest signed with the same key in another run is told apart by its run id.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.manifests import PolicyManifest


class ManifestError(ValueError):
    """A manifest that must not be trusted: unsigned, forged, malformed or not the one asked for."""


def generate_signing_key(path: Path) -> Ed25519PrivateKey:
    """Make a new key and write it as PEM, readable by the owner only (created 0600, never widened)."""
    path = Path(path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an ed25519 private key")
    return key


def load_or_generate_signing_key(path: Path) -> Ed25519PrivateKey:
    path = Path(path)
    return load_signing_key(path) if path.exists() else generate_signing_key(path)


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """base64 of the raw 32-byte public key: what workers get to check manifests."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def parse_public_key(public_key_b64_str: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(public_key_b64_str, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise ValueError(f"not a base64 raw ed25519 public key: {e}") from None


def sign_manifest(manifest: PolicyManifest, key: Ed25519PrivateKey) -> PolicyManifest:
    signature = key.sign(manifest.signing_payload())
    return manifest.model_copy(update={"signature": base64.b64encode(signature).decode()})


def verify_manifest(manifest: PolicyManifest, public_key: str | Ed25519PublicKey) -> None:
    """Raise ManifestError unless the manifest carries a valid signature by the run's key."""
    public = parse_public_key(public_key) if isinstance(public_key, str) else public_key
    if not manifest.signature:
        raise ManifestError(f"manifest of version {manifest.version} is unsigned")
    signature = manifest.signature_bytes()
    if len(signature) != 64:
        raise ManifestError(f"manifest of version {manifest.version} has a malformed signature")
    try:
        public.verify(signature, manifest.signing_payload())
    except InvalidSignature:
        raise ManifestError(f"manifest of version {manifest.version} has a forged signature") from None


def check_run(manifest: PolicyManifest, run_id: str) -> None:
    """Raise ManifestError unless a (verified) manifest belongs to this run."""
    if manifest.run_id != run_id:
        raise ManifestError(f"manifest of version {manifest.version} belongs to run {manifest.run_id[:80]!r}, not "
            f"{run_id!r}")


def parse_verified_manifest(body: bytes, public_key: str | Ed25519PublicKey, version: int | None = None, *,
    run_id: str) -> PolicyManifest:
    """Parse untrusted manifest bytes; check the signature, the run and (if given) the version asked for."""
    try:
        manifest = PolicyManifest.model_validate_json(body)
    except ValueError as e:
        raise ManifestError(f"malformed manifest: {str(e)[:300]}") from None
    verify_manifest(manifest, public_key)
    check_run(manifest, run_id)
    if version is not None and manifest.version != version:
        raise ManifestError(f"asked for version {version}, got a manifest for version {manifest.version}")
    return manifest
