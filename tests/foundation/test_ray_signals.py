"""`swarmrl run` stops after the current step on SIGTERM (what Kubernetes and `docker stop` send): its handler
must survive starting Ray, whose `ray.init()` installs its own (found by the compose run, issue #34)."""

from __future__ import annotations

import signal


def test_init_ray_keeps_the_drivers_sigterm_and_sigint_handlers():
    import ray

    from swarmrl.actors import init_ray

    def mine(signum, frame):  # pragma: no cover - never delivered
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        init_ray("", num_cpus=1)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        ray.shutdown()
        for sig, handler in before.items():
            signal.signal(sig, handler)
