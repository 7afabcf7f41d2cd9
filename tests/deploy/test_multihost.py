"""Four hosts on one machine (network namespaces, veth, a bridge): the orchestrator host runs
`swarmrl run`, the relay host `swarmrl shardcast relay`, two worker hosts `swarmrl worker`. Every byte
between them crosses the virtual 10.213.0.0/24 network, which exists only inside the namespaces."""

from __future__ import annotations

import json
import re
import signal
import sqlite3

import pytest
from netns_topology import mh, netns_topology

pytestmark = pytest.mark.e2e

MIN_STEPS = 6
# The run trains until both workers have had work accepted and MIN_STEPS are done, then the test stops it with
# SIGTERM (after its current step): on a busy machine one worker's engine can start after a fixed-length run has
# ended, and which worker starts first is not what this test checks.
CAP_STEPS = 200


@pytest.fixture
def topology():
    with netns_topology() as topo:
        yield topo


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_workers_on_other_hosts_join_pull_through_relay_and_train(topology, tmp_path):
    cluster = mh.launch(topology, tmp_path, CAP_STEPS)
    try:
        admin = {"Authorization": f"Bearer {mh.ADMIN_TOKEN}"}

        # Workers on other hosts registered through the orchestrator's address on the virtual network.
        def both_registered():
            status, body = topology.http_get("w1", cluster.orch_url + "/v1/workers", admin)
            if status != 200:
                return None
            names = {w["name"] for w in json.loads(body)["workers"]}
            return names >= {"netns-w1", "netns-w2"}

        mh.wait_for(both_registered, 120, "both workers to register", cluster.procs)
        # Isolation: nothing listens on a worker host's own loopback; the orchestrator is only reachable
        # at the orchestrator host's address.
        status, _ = topology.http_get("w1", f"http://127.0.0.1:{mh.ORCH_PORT}/healthz", timeout_s=3)
        assert status == 0

        def both_accepted_and_trained():
            status, body = topology.http_get("w1", cluster.orch_url + "/v1/workers", admin)
            if status != 200:
                return None
            accepted = {w["name"]: w["submissions_accepted"] for w in json.loads(body)["workers"]}
            return (len(mh.metrics_rows(cluster.run_dir)) >= MIN_STEPS and accepted.get("netns-w1", 0) > 0
                    and accepted.get("netns-w2", 0) > 0)

        mh.wait_for(both_accepted_and_trained, 300, f"{MIN_STEPS} steps and work accepted from both workers",
                    cluster.procs)
        cluster.procs["run"].send_signal(signal.SIGTERM)  # a clean stop after the current step: exit code 0
        code = cluster.procs["run"].wait(timeout=180)
        logs = {name: cluster.log(name).read_text(errors="replace") for name in ("run", "relay", "w1", "w2")}
        assert code == 0, logs["run"][-3000:]

        # Versions advanced one per optimizer step, each trained on verified rollouts.
        rows = mh.metrics_rows(cluster.run_dir)
        steps = len(rows)
        assert MIN_STEPS <= steps < CAP_STEPS and [r["version"] for r in rows] == list(range(1, steps + 1))
        with sqlite3.connect(f"file:{cluster.run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True) as con:
            trained = con.execute(
                "SELECT sub.status, w.name FROM samples s JOIN submissions sub ON sub.submission_id = s.submission_id "
                "JOIN workers w ON w.worker_id = sub.worker_id WHERE s.status = 'trained'"
            ).fetchall()
            accepted = dict(con.execute("SELECT name, accepted FROM workers").fetchall())
        assert len(trained) == steps * 16
        assert {status for status, _ in trained} == {"accepted"}
        assert set(accepted) == {"netns-w1", "netns-w2"} and all(n > 0 for n in accepted.values()), accepted

        # Weights reached the workers through the relay: the workers know only the relay's URL (the run
        # has no local relays and advertises the relay host), the relay mirrored the new versions from the
        # origin across the network, served shard bytes, and the workers loaded versions beyond 0.
        assert "relay listed version 1" in logs["relay"]
        status, text = topology.http_get("w2", cluster.relay_url + "/metrics")
        assert status == 200 and _metric(text, "shardcast_server_shard_bytes_sent") > 0
        for host in ("w1", "w2"):
            reloaded = [int(v) for v in re.findall(r"reloaded policy version (\d+)", logs[host])]
            assert reloaded and max(reloaded) >= 1, logs[host][-2000:]
            # Registration names the origin as the last fallback; here the workers' network cannot reach it,
            # so any mention of it is a failed attempt: every version they loaded came through the relay.
            assert mh.ORIGIN_PORT != mh.RELAY_PORT
            origin_lines = [line for line in logs[host].splitlines() if f":{mh.ORIGIN_PORT}" in line]
            assert all("failed" in line or "Error" in line for line in origin_lines), origin_lines[:3]
    finally:
        cluster.stop()


def test_missing_prerequisites_give_the_exact_reason(monkeypatch):
    """The multi-host test skips (never passes) when namespaces cannot be made, and says why."""
    monkeypatch.setattr(mh.shutil, "which", lambda name: None)
    with pytest.raises(mh.NetnsUnavailable, match="iproute2"):
        mh.check_netns_support()
    monkeypatch.setattr(mh.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(mh.os, "geteuid", lambda: 1000)
    with pytest.raises(mh.NetnsUnavailable, match="needs root"):
        mh.check_netns_support()
