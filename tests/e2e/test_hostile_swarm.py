"""A hostile swarm cannot stall the run: the real loop (`swarmrl run`: Ray, verifier, trainer, an honest
vLLM worker) with one adversary of each kind at once, each with a join token of its own, talking HTTP:

- a hoarder that leases all it can and lets the leases go just before their deadlines;
- a flooder that sends junk submissions at the cap and forged credentials, as fast as it can;
- a slow-reward adversary whose completions' text makes the run's reward run forever;
- a cheater that gets itself banned, then tries to come back with its join token and its old secret;
- a relay that drip-feeds the right bytes at 2 KB/s, advertised to workers first, before the run's own relay.

The slow-reward adversary needs texts of its choosing to be scored. With full verification no worker can
choose its text (the verifier checks every token against the seeded draw), so this run turns deep checks
off for new workers (`verifier.spot_check_rate.new = 0`), what an operator trading verification for
throughput would do: the reward's time limit must contain it then.

Asserted: no 5xx to anyone, no hang, the run keeps advancing versions, the honest worker is never
struck, and every adversary is refused or contained.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import db, metrics, pids, start_run, stop_run, wait_for

from protocol import api, limits
from swarmrl.processes import free_port
from tools.adversaries import Adversary, Cheater, Flooder, Hoarder, SlowReward
from tools.hostile_relay import HostileRelay

pytestmark = pytest.mark.e2e

ADMIN = "demo-admin-token"
HERE = Path(__file__).resolve().parent


def settled(watch: httpx.Client, run_dir: Path, adversaries: list[Adversary], dripper: HostileRelay,
            start_version: int) -> bool:
    """Every outcome the test asserts has happened (the hoarder refused, the slow texts struck, the cheater banned
    and its comebacks tried, the dripping relay tried, three versions trained and loaded by the honest worker)."""
    hoarder, _, slow, cheater = adversaries
    workers = {w["name"]: w for w in watch.get(api.WORKERS.path,
        headers={"Authorization": f"Bearer {ADMIN}"}).json()["workers"]}
    honest = workers.get("local-0", {})
    return (hoarder.refused > 0 and bool(slow.verdicts) and workers.get("slow", {}).get("strikes", 0) >= 1
            and hasattr(cheater, "old_secret") and any("/shards/" in r for r in dripper.requests)
            and metrics(run_dir)[-1]["version"] - start_version >= 3
            and honest.get("loaded_policy_version", 0) > start_version)


def test_a_hostile_swarm_cannot_stall_the_run(tmp_path):
    origin_port = free_port("127.0.0.1")
    dripper = HostileRelay(f"http://127.0.0.1:{origin_port}", "drip", rate=2000)
    proc = start_run(
        tmp_path, "--name", "soak", "--trainer.max_steps", "1000", "--num_workers", "1",
        "--data.reward", "soak_reward:reward", "--verifier.rewards.import_paths", json.dumps([str(HERE)]),
        "--verifier.spot_check_rate", '{"new": 0.0, "trusted": 1.0}', "--orchestrator.strikes_to_ban", "3",
        "--shardcast.origin_port", str(origin_port), "--shardcast.advertise_relay_urls", json.dumps([dripper.url]),
    )
    run_dir = tmp_path / "soak"
    stop = threading.Event()
    adversaries: list[Adversary] = []
    try:
        url = wait_for(lambda: pids(run_dir).get("url"), 240, "the orchestrator's URL", proc)
        wait_for(lambda: len(metrics(run_dir)) >= 2, 240, "two trainer steps before the attack", proc)
        cap = limits.submission_bytes_cap(2 * 4, 8)
        Flooder.cap = cap
        adversaries = [kind(name, url, run_dir, stop, ADMIN) for kind, name in
                       ((Hoarder, "hoarder"), (Flooder, "flooder"), (SlowReward, "slow"), (Cheater, "cheater"))]
        start_version = metrics(run_dir)[-1]["version"]
        for a in adversaries:
            a.start()
        # The operator keeps watching through it all: no hang, never a 5xx. The attack lasts at least 30 s and
        # until every adversary has met its end below (at most 90 s): what is asserted is then settled.
        watch = httpx.Client(base_url=url, timeout=10)
        started = time.time()
        while time.time() < started + 90:
            st = watch.get(api.STATUS.path, headers={"Authorization": f"Bearer {ADMIN}"})
            assert st.status_code == 200, st.text
            assert proc.poll() is None, "the run died under attack"
            if time.time() > started + 30 and settled(watch, run_dir, adversaries, dripper, start_version):
                break
            time.sleep(1.0)
        stop.set()
        for a in adversaries:
            a.join(timeout=30)
        end_version = metrics(run_dir)[-1]["version"]
        workers = {w["name"]: w for w in watch.get(api.WORKERS.path,
            headers={"Authorization": f"Bearer {ADMIN}"}).json()["workers"]}
    finally:
        stop.set()
        stop_run(proc)
        dripper.stop()
    hoarder, flooder, slow, cheater = adversaries
    for a in adversaries:
        assert a.error is None, f"{a.name}: {a.error!r}"
        assert not [s for s in a.statuses if s >= 500], f"{a.name} got {a.statuses}"
    # The run kept advancing, and the honest worker kept loading new versions although the relay it was
    # told of first dripped every file it served (the client's minimum rate moved it to another source).
    assert end_version - start_version >= 3, (start_version, end_version)
    assert any("/shards/" in r for r in dripper.requests), "the dripping relay was never tried"
    honest = workers["local-0"]
    assert not honest["banned"] and honest["strikes"] == 0 and honest["submissions_accepted"] > 0
    assert honest["loaded_policy_version"] > start_version, (honest, start_version)
    # The hoarder never held more than its fair share of the bound of 12 prompts: 12 / (live join tokens),
    # which grows as the other adversaries get banned but never passes half (the honest token is live too).
    assert hoarder.held_max <= 12 // 2 and hoarder.refused > 0
    # The flooder got nothing but refusals (4xx), never a 2xx for its junk.
    # its token minting and registration
    assert set(flooder.statuses) <= {200, 401, 413, 422, 429} and flooder.statuses[200] == 2
    # The slow rewards were cut off at their time limit, and their groups dropped, never trained with a made-up
    # reward. Unchecked (new workers are not spot-checked here), the text is the worker's choice: a strike, so
    # the adversary was struck until banned. (A checked text is the policy's draw: never a strike.)
    assert slow.verdicts and workers["slow"]["strikes"] >= 1
    with db(run_dir) as con:
        statuses = [json.loads(v).get("reward_status") for (v,) in con.execute(
            "SELECT verdict FROM submissions WHERE worker_id=? AND verdict IS NOT NULL", (slow.reg.worker_id,))]
        slow_groups = con.execute("SELECT COUNT(*) FROM sample_groups WHERE submission_id IN "
                                  "(SELECT submission_id FROM submissions WHERE worker_id=?)", (slow.reg.worker_id,
                                  )).fetchone()[0]
        unscored = con.execute("SELECT value FROM meta WHERE key='groups_dropped_unscored'").fetchone()
    assert any(s and "timed_out" in s for s in statuses)
    assert slow_groups == 0 and unscored is not None and float(unscored[0]) > 0
    # The cheater was banned, and came back neither with its join token nor with its old secret.
    assert workers["cheater"]["banned"], (cheater.statuses, workers["cheater"])
    # Refused as banned (403), or before that as an address over its refused-credentials budget (429): the
    # flooder's forged secrets come from the same loopback address. Never let in.
    assert len(cheater.comeback) == 3 and set(cheater.comeback) <= {403, 429}, cheater.comeback
    assert len(cheater.old_secret) == 2 and set(cheater.old_secret) <= {403, 429}, cheater.old_secret
