"""Round-trip and rejection tests for every wire model."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

import protocol as p
from protocol import limits


def completion(n: int = 40, **kw) -> dict:
    out = dict(
        prompt_index=0,
        sample_index=0,
        token_ids=list(range(3, 3 + n)),
        logprobs=[-0.5] * n,
        finish_reason="length",
        proofs=[b"\x01" * 258] * math.ceil(n / limits.PROOF_CHUNK_TOKENS),
    )
    out.update(kw)
    return out


def submission(**kw) -> dict:
    out = dict(lease_id="lease-1", policy_version=3, model_hash="ab" * 32, completions=[completion()])
    out.update(kw)
    return out


def lease(**kw) -> dict:
    out = dict(
        lease_id="lease-1",
        prompts=[dict(prompt_id="p0", token_ids=[5, 6, 7], seeds=[1, 2])],
        samples_per_prompt=2,
        sampling=dict(temperature=1.0, max_tokens=16, stop_token_ids=[2]),
        policy_version=4,
        min_policy_version=2,
        deadline=1.8e9,
    )
    out.update(kw)
    return out


def manifest(**kw) -> dict:
    out = dict(
        run_id="demo-0123456789ab",
        version=1,
        model_hash="cd" * 32,
        anchor_version=1,
        full_bytes=123,
        shards=[dict(name="model-00001.safetensors", sha256="ef" * 32, size=123)],
        created_at=1.7e9,
        signature=base64.b64encode(b"s" * 64).decode(),
    )
    out.update(kw)
    return out


VALID = [
    (p.WorkerRegistration, dict(name="vol-1", client_version="0.1.0", device="cpu")),
    (
        p.WorkerRegistered,
        dict(
            worker_id="w-1",
            secret="s" * 32,
            heartbeat_interval_s=5.0,
            async_level=2,
            policy_version=0,
            relay_urls=["http://127.0.0.1:9000"],
            manifest_public_key="k" * 44,
            run_id="demo-0123456789ab",
            origin_url="http://10.0.0.1:9000",
        ),
    ),
    (p.Heartbeat, dict(state="generating", loaded_policy_version=3, tokens_per_s=120.5)),
    (p.HeartbeatAck, dict(policy_version=3, min_policy_version=1, heartbeat_interval_s=5.0)),
    (p.LeaseRequest, dict(loaded_policy_version=3, max_prompts=4)),
    (p.TaskLease, lease()),
    (p.LeaseResponse, dict(lease=lease())),
    (p.LeaseResponse, dict(lease=None, retry_after_s=1.0)),
    (p.ReleaseRequest, dict(reason="sigterm")),
    (p.ReleaseAck, dict(lease_id="lease-1", released=True)),
    (p.Completion, completion()),
    (p.RolloutSubmission, submission()),
    (p.SubmissionReceipt, dict(submission_id="sub-1", lease_id="lease-1", num_completions=1)),
    (
        p.Verdict,
        dict(
            submission_id="sub-1",
            status="rejected",
            rejections=[dict(code="proof_mismatch", message="exponents", completion_index=0, chunk_index=1,
            stats={"exp_mismatch": 40.0})],
        ),
    ),
    (p.Verdict, dict(submission_id="sub-1", status="accepted", rewards=[1.0, 0.0], verified_tokens=80)),
    (p.PolicyManifest, manifest()),
    (p.VersionList, dict(versions=[0, 1, 2])),
    (p.WorkerRecord, dict(worker_id="w-1", name="vol", online=True, banned=False, strikes=0)),
    (p.WorkerList, dict(workers=[dict(worker_id="w-1", name="vol", online=True, banned=False, strikes=1)])),
    (p.BanRequest, dict(reason="tampering")),
    (
        p.RunStatus,
        dict(
            run_name="demo",
            step=3,
            policy_version=3,
            async_level=2,
            buffer_depth=10,
            workers_online=2,
            acceptance_rate=0.9,
            submissions_accepted=9,
            submissions_rejected=1,
            groups_dropped_zero_signal=4,
            samples_dropped_stale=0,
            rollout_tokens_per_s=100.0,
            trained_samples_per_s=3.0,
            staleness_histogram={"0": 5, "1": 3},
        ),
    ),
    (p.ErrorBody, dict(error="version_too_old", detail="too old", min_policy_version=2)),
    (p.HealthStatus, dict(ok=True)),
]


@pytest.mark.parametrize("model,data", VALID, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(VALID)])
def test_round_trip(model, data):
    obj = model.model_validate(data)
    text = obj.model_dump_json()
    again = model.model_validate_json(text)
    assert again.model_dump(mode="json") == obj.model_dump(mode="json")
    # Python-mode validation of the JSON-mode dump gives the same object too.
    assert model.model_validate(json.loads(text)).model_dump(mode="json") == obj.model_dump(mode="json")


@pytest.mark.parametrize("model,data", VALID, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(VALID)])
def test_unknown_field_rejected(model, data):
    with pytest.raises(ValidationError, match="[Ee]xtra inputs are not permitted"):
        model.model_validate({**data, "reward": 1.0})


def test_arrays_travel_packed():
    text = p.RolloutSubmission.model_validate(submission()).model_dump_json()
    body = json.loads(text)
    tokens = body["completions"][0]["token_ids"]
    assert isinstance(tokens, str)
    raw = base64.b64decode(tokens)
    assert np.frombuffer(raw, "<i4").tolist() == list(range(3, 43))
    assert np.frombuffer(base64.b64decode(body["completions"][0]["logprobs"]), "<f4").tolist() == [-0.5] * 40


def test_pack_unpack_little_endian():
    arr = np.array([1, -2, 2**31 - 1], dtype=np.int32)
    assert p.pack(arr, "int32") == base64.b64encode(arr.astype("<i4").tobytes()).decode()
    assert p.unpack(p.pack(arr, "int32"), "int32").tolist() == arr.tolist()
    with pytest.raises(ValueError, match="whole number"):
        p.unpack(base64.b64encode(b"abc").decode(), "int32")
    with pytest.raises(ValueError, match="base64"):
        p.unpack("not base64!!", "int32")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(token_ids=[-1] + list(range(39))), "negative token id"),
        (dict(logprobs=[float("nan")] + [-0.5] * 39), "NaN"),
        (dict(logprobs=[0.3] + [-0.5] * 39), "must be <= 0"),
        (dict(logprobs=[-0.5] * 39), "40 tokens but 39 logprobs"),
        (dict(proofs=[b"x"]), "need 2 proofs"),
        (dict(proofs=[b"x" * 259, b"x"]), "at most 258"),
        (dict(token_ids=[], logprobs=[], proofs=[]), "no tokens"),
        (dict(finish_reason="abort"), "finish_reason"),
        (dict(token_ids=[1.5] * 40), "expected integers"),
        (dict(token_ids=[2**40] + list(range(39))), "out of int32 range"),
    ],
)
def test_completion_rejections(change, message):
    with pytest.raises(ValidationError, match=message):
        p.Completion.model_validate(completion(**change))


def test_out_of_vocabulary_rejected_with_context():
    data = json.loads(p.RolloutSubmission.model_validate(submission()).model_dump_json())
    p.RolloutSubmission.model_validate(data, context={"vocab_size": 64})
    with pytest.raises(ValidationError, match="outside the vocabulary of 20"):
        p.RolloutSubmission.model_validate(data, context={"vocab_size": 20})
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        p.TaskLease.model_validate(lease(), context={"vocab_size": 6})


def test_oversize_arrays_rejected():
    n = limits.MAX_COMPLETION_TOKENS + 1
    with pytest.raises(ValidationError, match="limit is|longer than"):
        p.Completion.model_validate(completion(n=n))
    packed = p.pack(np.zeros(n, np.int32), "int32")
    with pytest.raises(ValidationError, match="longer than"):
        p.Completion.model_validate(completion(token_ids=packed))


def test_submission_rules():
    with pytest.raises(ValidationError, match="appears twice"):
        p.RolloutSubmission.model_validate(submission(completions=[completion(), completion()]))
    with pytest.raises(ValidationError, match="at least 1"):
        p.RolloutSubmission.model_validate(submission(completions=[]))
    with pytest.raises(ValidationError, match="at most"):
        many = [completion(n=1, sample_index=i % 64, prompt_index=i // 64)
            for i in range(limits.MAX_COMPLETIONS_PER_SUBMISSION + 1)]
        p.RolloutSubmission.model_validate(submission(completions=many))
    with pytest.raises(ValidationError, match="model_hash"):
        p.RolloutSubmission.model_validate(submission(model_hash="xyz"))
    with pytest.raises(ValidationError, match="policy_version"):
        p.RolloutSubmission.model_validate(submission(policy_version=-1))
    with pytest.raises(ValidationError, match="lease_id"):
        p.RolloutSubmission.model_validate(submission(lease_id="../etc/passwd"))


def test_lease_rules():
    with pytest.raises(ValidationError, match="2 seeds for 3 samples"):
        p.TaskLease.model_validate(lease(samples_per_prompt=3))
    with pytest.raises(ValidationError, match="min_policy_version is above"):
        p.TaskLease.model_validate(lease(min_policy_version=5))
    with pytest.raises(ValidationError, match="top_k"):
        p.SamplingParams(top_k=0)
    with pytest.raises(ValidationError, match="top_p"):
        p.SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="max_tokens"):
        p.SamplingParams(max_tokens=limits.MAX_COMPLETION_TOKENS + 1)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "a\\b", "x..y", "", "a" * 200])
def test_manifest_rejects_unsafe_shard_names(name):
    with pytest.raises(ValidationError):
        p.PolicyManifest.model_validate(manifest(shards=[dict(name=name, sha256="ef" * 32, size=1)]))


def test_manifest_signing_payload_is_canonical_and_excludes_signature():
    a = p.PolicyManifest.model_validate(manifest())
    b = p.PolicyManifest.model_validate(manifest(signature=""))
    assert a.signing_payload() == b.signing_payload()
    c = p.PolicyManifest.model_validate(manifest(version=2, anchor_version=2))
    assert c.signing_payload() != a.signing_payload()
    d = p.PolicyManifest.model_validate(manifest(run_id="demo-ffffffffffff"))
    assert d.signing_payload() != a.signing_payload()  # the run id is signed
    assert a.signature_bytes() == b"s" * 64
    with pytest.raises(ValidationError, match="not unique"):
        p.PolicyManifest.model_validate(manifest(shards=[dict(name="a", sha256="ef" * 32, size=1)] * 2))


def test_manifest_deltas_name_their_own_files_and_earlier_bases():
    delta = dict(name="delta-from-v0000000004.swdelta", sha256="ab" * 32, size=9)
    ref = dict(base_version=4, base_model_hash="ee" * 32, file=delta["name"])
    only_delta = p.PolicyManifest.model_validate(manifest(version=5, anchor_version=0, shards=[delta], deltas=[ref]))
    assert only_delta.full_shards == [] and only_delta.file(delta["name"]).size == 9
    anchor = p.PolicyManifest.model_validate(manifest(version=5, anchor_version=5, shards=[manifest()["shards"][0],
        delta], deltas=[ref]))
    assert [s.name for s in anchor.full_shards] == ["model-00001.safetensors"]
    bad = [
        manifest(version=5, anchor_version=5, shards=[delta], deltas=[ref]),  # no full shards, yet an anchor
        manifest(version=5, anchor_version=0),  # full shards, yet not an anchor
        manifest(version=5, anchor_version=6, shards=[delta], deltas=[ref]),  # anchor after the version
        manifest(version=4, anchor_version=0, shards=[delta], deltas=[ref]),  # base not earlier
        manifest(version=5, anchor_version=0, shards=[delta], deltas=[{**ref, "file": "missing"}]),
        manifest(version=5, anchor_version=0, shards=[delta], deltas=[ref, ref]),
        manifest(run_id="a/b"),
    ]
    for m in bad:
        with pytest.raises(ValidationError):
            p.PolicyManifest.model_validate(m)


def test_heartbeat_rejects_nan():
    with pytest.raises(ValidationError):
        p.Heartbeat.model_validate_json('{"state": "idle", "tokens_per_s": NaN}')


@pytest.mark.parametrize(
    "field,values,message",
    [
        ("token_ids", [-1] + list(range(39)), "completion 2: negative token id -1"),
        ("token_ids", [70] + list(range(39)), "completion 2: token id 70 is outside the vocabulary of 64"),
        ("logprobs", [-0.5] * 39 + [float("nan")], "completion 2: logprobs contain NaN or infinity at index 39"),
        ("logprobs", [-0.5] * 5 + [float("-inf")] + [-0.5] * 34,
        "completion 2: logprobs contain NaN or infinity at index 5"),
        ("logprobs", [-0.5] * 7 + [0.25] + [-0.5] * 32, "completion 2: logprobs must be <= 0, got 0.25 at index 7"),
    ],
)
@pytest.mark.parametrize("wire", [True, False], ids=["json", "python"])
def test_submission_checks_every_completion_array(field, values, message, wire):
    """A submission checks token ids and logprobs of all its completions in one pass: a bad value in a
    later completion is refused, and the error names that completion."""
    comps = [completion(sample_index=i) for i in range(4)]
    ok = submission(completions=comps)
    bad = submission(completions=[dict(c) for c in comps])
    dtype = "int32" if field == "token_ids" else "float32"
    bad["completions"][2][field] = p.pack(values, dtype) if wire else values
    ctx = {"vocab_size": 64}
    if wire:
        ok_json = p.RolloutSubmission.model_validate(ok).model_dump_json()
        p.RolloutSubmission.model_validate_json(ok_json, context=ctx)
        doc = json.loads(ok_json)
        doc["completions"][2][field] = bad["completions"][2][field]
        with pytest.raises(ValidationError, match=message):
            p.RolloutSubmission.model_validate_json(json.dumps(doc), context=ctx)
    else:
        p.RolloutSubmission.model_validate(ok, context=ctx)
        with pytest.raises(ValidationError, match=message):
            p.RolloutSubmission.model_validate(bad, context=ctx)
    # The same completion on its own is refused by Completion's own checks.
    with pytest.raises(ValidationError, match=message.split(": ", 1)[1].split(" at index")[0].split(" of ")[0]):
        p.Completion.model_validate(bad["completions"][2], context=ctx)


def test_packed_array_json_path_refuses_bad_arrays():
    """From JSON, pydantic-core decodes the base64 (padding optional, URL-safe alphabet accepted, as for
    proofs: the decoded bytes are what every check and the replay fingerprint see); PackedArray then
    refuses partial values and arrays over the cap."""
    doc = json.loads(p.RolloutSubmission.model_validate(submission()).model_dump_json())
    for value, message in [
        ("not base64!!", "valid base64"),
        ("é" * 8, "valid base64"),
        ("QUJD", "not a whole number of 4-byte values"),  # 3 bytes
        ("A" * (4 * ((limits.MAX_COMPLETION_TOKENS * 4 + 2) // 3) + 4), "limit is"),
    ]:
        d = json.loads(json.dumps(doc))
        d["completions"][0]["token_ids"] = value
        with pytest.raises(ValidationError, match=message):
            p.RolloutSubmission.model_validate_json(json.dumps(d))
    unpadded = json.loads(json.dumps(doc))
    unpadded["completions"][0]["token_ids"] = unpadded["completions"][0]["token_ids"].rstrip("=")
    assert p.RolloutSubmission.model_validate_json(json.dumps(unpadded)).completions[0].token_ids.tolist() == list(
        range(3, 43))
    arr = p.RolloutSubmission.model_validate_json(json.dumps(doc)).completions[0].token_ids
    # a view of the decoded bytes
    assert arr.dtype == np.int32 and not arr.flags.writeable and arr.tolist() == list(range(3, 43))



def wire(c: dict) -> dict:
    """A completion as JSON carries it (arrays and proofs base64), built without validating it."""
    return {**c, "token_ids": p.pack(c["token_ids"], "int32"), "logprobs": p.pack(c["logprobs"], "float32"),
            "proofs": [base64.b64encode(b).decode() for b in c["proofs"]]}


def test_json_arrays_land_in_their_own_completions():
    """From JSON, a submission's arrays are decoded together and handed out as slices: each completion
    gets exactly its own values, whatever the lengths (1 to 70 tokens here)."""
    rng = np.random.default_rng(0)
    comps = []
    for i in range(24):
        n = int(rng.integers(1, 71))
        comps.append(completion(n=n, prompt_index=i // 8, sample_index=i % 8, token_ids=rng.integers(0, 64, n).tolist(),
                                logprobs=(-rng.random(n)).astype(np.float32).tolist()))
    sub = p.RolloutSubmission.model_validate_json(json.dumps(submission(completions=[wire(c) for c in comps])),
        context={"vocab_size": 64})
    for c, got in zip(comps, sub.completions):
        assert got.token_ids.dtype == np.int32 and got.logprobs.dtype == np.float32
        assert got.token_ids.tolist() == c["token_ids"] and got.logprobs.tolist() == c["logprobs"]
    one = p.Completion.model_validate_json(json.dumps(wire(comps[5])))  # on its own, too
    assert one.token_ids.tolist() == comps[5]["token_ids"] and one.logprobs.tolist() == comps[5]["logprobs"]


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(logprobs=[-0.5] * 39), "40 tokens but 39 logprobs"),
        (dict(proofs=[b"x"]), "40 tokens need 2 proofs, got 1"),
        (dict(token_ids=[], logprobs=[], proofs=[]), "completion has no tokens"),
    ],
)
def test_json_completion_rules_name_the_completion(change, message):
    comps = [wire(completion(sample_index=i)) for i in range(4)]
    comps[2] = wire(completion(sample_index=2, **change))
    with pytest.raises(ValidationError, match=f"completion 2: {message}"):
        p.RolloutSubmission.model_validate_json(json.dumps(submission(completions=comps)))
    with pytest.raises(ValidationError, match=message):
        p.Completion.model_validate_json(json.dumps(comps[2]))
    partial = [wire(completion(sample_index=i)) for i in range(4)]
    partial[3]["logprobs"] = base64.b64encode(b"\x00" * 6).decode()  # 1.5 float32 values
    with pytest.raises(ValidationError, match="completion 3: logprobs: 6 bytes is not a whole number of 4-byte values"):
        p.RolloutSubmission.model_validate_json(json.dumps(submission(completions=partial)))
