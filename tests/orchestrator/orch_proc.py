"""An orchestrator process for the restart test: real uvicorn on 127.0.0.1, real SQLite file, the test
verifier (slowed down, so some submissions are still unverified when the test kills us) and a
simulated trainer that takes and commits batches. Prints its URL on stdout when serving."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from orch_fakes import HASH0, FakeVerifier, make_orchestrator, run_config

from orchestrator.server import OrchestratorServer


class SlowVerifier(FakeVerifier):
    def verify_many(self, jobs):
        time.sleep(0.3)
        return super().verify_many(jobs)


def trainer_loop(orch, stop: threading.Event) -> None:
    # This trainer keeps nothing durable of its own (it commits each batch as soon as it has "trained"
    # it): after a restart, whatever was in flight goes back.
    orch.reconcile_trainer([], {}, {})
    while not stop.is_set():
        batch = orch.take_batch(4, wait_s=0.5)
        if not batch.groups:
            orch.give_back_batch(batch.batch_id)
            continue
        time.sleep(0.2)  # "training"
        version = orch.status().policy_version
        orch.commit_batches({batch.batch_id: version}, {version + 1: HASH0})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    cfg = run_config(Path(args.dir), port=args.port, admin_token="admin", join_tokens=["join"], async_level=1000,
                     max_open_leases_per_worker=100)
    cfg.trainer.max_staleness = 1000  # like async_level: this trainer trains every sample, however old
    orch = make_orchestrator(cfg, SlowVerifier())
    orch.verify_batch = 2
    server = OrchestratorServer(orch).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t = threading.Thread(target=trainer_loop, args=(orch, stop), daemon=True)
    t.start()
    print(server.url, flush=True)
    while not stop.wait(0.2):
        pass
    t.join(timeout=5)
    server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
