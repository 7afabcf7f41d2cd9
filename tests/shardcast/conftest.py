"""Fixtures for the shardcast tests (helpers live in shardcast_helpers.py)."""

from __future__ import annotations

import pytest

from shardcast.keys import generate_signing_key, public_key_b64


@pytest.fixture
def key(tmp_path):
    return generate_signing_key(tmp_path / "run-key.pem")


@pytest.fixture
def pub(key) -> str:
    return public_key_b64(key)
