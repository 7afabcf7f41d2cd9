"""deploy/netns/multihost.py for the tests: imported from its folder, and a topology made for one test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "netns"))
import multihost as mh  # noqa: E402


@contextmanager
def netns_topology(**kw) -> Iterator[mh.Topology]:
    """A Topology up for the block and removed after it; a skip with the reason where namespaces cannot be made."""
    try:
        mh.check_netns_support()
    except mh.NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    topo = mh.Topology(**kw)
    try:
        yield topo.up()
    finally:
        topo.down()
