"""Signing, the model hash, shard layout, and loading a published version into transformers."""

from __future__ import annotations

import base64
import json
import os
import stat

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from shardcast_helpers import RUN, state_dict

from protocol.manifests import PolicyManifest, ShardEntry
from shardcast.files import file_hash, file_matches, signed_entry
from shardcast.keys import (
    ManifestError,
    load_signing_key,
    parse_verified_manifest,
    public_key_b64,
    sign_manifest,
    verify_manifest,
)
from shardcast.origin import Origin
from shardcast.weights import load_version_dir, model_hash, split_aliases


def _manifest(version=3, run_id=RUN) -> PolicyManifest:
    return PolicyManifest(
        run_id=run_id, version=version, model_hash="ab" * 32, anchor_version=version, full_bytes=10,
        shards=[ShardEntry(name="model-00001-of-00001.safetensors", sha256="cd" * 32, size=10)], created_at=1.0,
    )


def test_key_file_is_private_and_reloads(tmp_path, key):
    path = tmp_path / "run-key.pem"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert public_key_b64(load_signing_key(path)) == public_key_b64(key)


def test_signed_manifest_verifies_and_every_change_breaks_it(key, pub):
    signed = sign_manifest(_manifest(), key)
    verify_manifest(signed, pub)
    for change in ({"version": 4}, {"model_hash": "ef" * 32}, {"created_at": 2.0}, {"run_id": "another-run"},
                   {"full_bytes": 11}, {"shards": [ShardEntry(name="model-00001-of-00001.safetensors",
                   sha256="ce" * 32, size=10)]}):
        with pytest.raises(ManifestError, match="forged"):
            verify_manifest(signed.model_copy(update=change), pub)


def test_a_signed_blake3_cannot_be_stripped_or_changed_and_older_manifests_still_verify(tmp_path, key, pub):
    """Receivers check a file with blake3 when its signed entry has one: a relay that strips it (to force the
    slower sha256) or changes it breaks the signature. A manifest signed before the field existed verifies,
    and its files are checked with sha256."""
    data = b"0123456789"
    entry = signed_entry("model-00001-of-00001.safetensors", data)
    assert entry.blake3 is not None and file_hash(entry)[0].name == "blake3"
    signed = sign_manifest(_manifest().model_copy(update={"shards": [entry]}), key)
    verify_manifest(signed, pub)
    for change in ({"blake3": None}, {"blake3": "00" * 32}):
        with pytest.raises(ManifestError, match="forged"):
            verify_manifest(signed.model_copy(update={"shards": [entry.model_copy(update=change)]}), pub)
    # An older origin's manifest: no blake3 key at all in what it signed.
    body = _manifest().model_dump(mode="json", exclude={"signature"})
    body["shards"] = [{"name": entry.name, "sha256": entry.sha256, "size": entry.size}]
    body["signature"] = base64.b64encode(key.sign(json.dumps(body, sort_keys=True, separators=(",",
        ":")).encode())).decode()
    older = parse_verified_manifest(json.dumps(body).encode(), pub, version=3, run_id=RUN)
    assert older.shards[0].blake3 is None and file_hash(older.shards[0])[0].name == "sha256"
    path = tmp_path / entry.name
    path.write_bytes(data)
    assert file_matches(path, older.shards[0]) and file_matches(path, entry)
    path.write_bytes(b"0123456788")
    assert not file_matches(path, older.shards[0]) and not file_matches(path, entry)


def test_unsigned_forged_and_malformed_manifests_are_rejected(key, pub):
    with pytest.raises(ManifestError, match="unsigned"):
        verify_manifest(_manifest(), pub)
    other = sign_manifest(_manifest(), Ed25519PrivateKey.generate())
    with pytest.raises(ManifestError, match="forged"):
        verify_manifest(other, pub)
    with pytest.raises(ManifestError, match="malformed"):
        verify_manifest(_manifest().model_copy(update={"signature": "AAAA"}), pub)
    with pytest.raises(ManifestError, match="malformed manifest"):
        parse_verified_manifest(b"{not json", pub, run_id=RUN)
    with pytest.raises(ManifestError, match="asked for version 9"):
        parse_verified_manifest(sign_manifest(_manifest(3), key).model_dump_json().encode(), pub, version=9, run_id=RUN)


def test_a_manifest_signed_in_another_run_with_the_same_key_is_refused(key, pub):
    """The replay of the issue: same key, earlier run. The signature checks out; the run id does not."""
    earlier = sign_manifest(_manifest(3, run_id="demo-aaaaaaaaaaaa"), key).model_dump_json().encode()
    verify_manifest(PolicyManifest.model_validate_json(earlier), pub)  # a valid signature...
    with pytest.raises(ManifestError, match="belongs to run 'demo-aaaaaaaaaaaa'"):
        parse_verified_manifest(earlier, pub, version=3, run_id="demo-bbbbbbbbbbbb")  # ...of another run
    assert parse_verified_manifest(earlier, pub, version=3, run_id="demo-aaaaaaaaaaaa").run_id == "demo-aaaaaaaaaaaa"


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/b.safetensors", ".hidden", "..", "x..y", "/abs", "a\\b"])
def test_signed_manifest_with_path_traversal_names_is_rejected(key, pub, name):
    """Even a manifest signed by the run's key cannot name a file outside its version folder."""
    body = _manifest().model_dump(mode="json", exclude={"signature"})
    body["shards"][0]["name"] = name
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["signature"] = base64.b64encode(key.sign(payload)).decode()
    with pytest.raises(ManifestError, match="malformed"):
        parse_verified_manifest(json.dumps(body).encode(), pub, run_id=RUN)


def test_model_hash_is_independent_of_sharding_and_sensitive_to_content(tmp_path, key):
    sd = state_dict(layers=4, mb_per_layer=0.25)
    h = model_hash(sd)
    assert model_hash(dict(reversed(list(sd.items())))) == h
    small = Origin(tmp_path / "a", key, run_id=RUN, shard_bytes=100_000).publish(0, sd)
    big = Origin(tmp_path / "b", key, run_id=RUN, shard_bytes=1 << 30).publish(0, sd)
    assert len(small.shards) > len(big.shards) == 1
    assert small.model_hash == big.model_hash == h
    assert model_hash(load_version_dir(tmp_path / "a" / "v0000000000")) == h
    changed = dict(sd)
    changed["model.norm.weight"] = sd["model.norm.weight"].clone()
    changed["model.norm.weight"][0] += 1e-3
    assert model_hash(changed) != h
    assert model_hash({**sd, "model.norm.weight": sd["model.norm.weight"].to(torch.float64)}) != h
    assert model_hash({**sd, "model.norm.weight": sd["model.norm.weight"].reshape(8, 8)}) != h


def test_tied_alias_is_written_once_and_restored(tmp_path, key):
    emb = torch.randn(96, 16)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.ones(16)}
    tensors, aliases = split_aliases(sd)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" not in tensors
    untied = {**sd, "lm_head.weight": emb.clone()}  # equal values, separate memory: not tied
    assert split_aliases(untied)[1] == {}
    assert model_hash(untied) != model_hash(sd)
    origin = Origin(tmp_path / "o", key, run_id=RUN, shard_bytes=1 << 20)
    m = origin.publish(0, sd)
    from safetensors import safe_open

    names = set()
    for s in m.shards:
        with safe_open(str(origin.version_dir(0) / s.name), "pt") as f:
            names |= set(f.keys())
    assert names == {"model.embed_tokens.weight", "model.norm.weight"}
    loaded = load_version_dir(origin.version_dir(0))
    assert set(loaded) == set(sd)
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
    assert model_hash(loaded) == m.model_hash == model_hash(sd)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_untied_model_dir"])
def test_published_version_loads_in_transformers(request, tmp_path, key, fixture):
    from transformers import AutoConfig, Qwen2ForCausalLM

    model_dir = request.getfixturevalue(fixture)
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(123)
    trained = Qwen2ForCausalLM(config).float().eval()  # fresh weights, unlike what is on disk
    sd = trained.state_dict()
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=64 << 10)
    manifest = origin.publish(5, sd)
    assert len(manifest.shards) > 1
    loaded = load_version_dir(origin.version_dir(5))
    assert set(loaded) == set(sd)  # HF names, lm_head included as the alias when tied
    model = Qwen2ForCausalLM.from_pretrained(model_dir).float().eval()
    model.load_state_dict(loaded, strict=True)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trained(ids).logits)
    assert model_hash(model.state_dict()) == manifest.model_hash


def test_a_version_folder_is_written_over_a_temp_folder_left_by_a_killed_writer(tmp_path):
    """A worker stopped while writing a version leaves `.tmp-v<N>`; the next write of that version must not
    fail on it (it did, at 0.6B, and took the worker down at the start of a resumed run)."""
    from shardcast.assemble import write_folder

    state = state_dict()
    temp, final = tmp_path / ".tmp-v0000000003", tmp_path / "v0000000003"
    temp.mkdir()
    (temp / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    write_folder(state, _manifest(), temp, final, shard_bytes=1 << 20, durable=False)
    assert not temp.exists() and (final / "manifest.json").is_file()
    loaded = load_version_dir(final)
    assert set(loaded) >= {k for k in state if k in loaded} and all(torch.equal(loaded[k], state[k]) for k in loaded)
