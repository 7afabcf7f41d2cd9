"""The live view of `swarmrl run` shows the verifier pool: live and pending actors, the queue and the
throughput in and out."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from protocol.operator_models import RunStatus
from swarmrl.config import RunConfig
from swarmrl.live_view import render
from swarmrl.run_record import Progress


def test_live_view_shows_the_verifier_pool():
    st = RunStatus(
        run_name="demo", step=3, policy_version=3, async_level=1, buffer_depth=0, workers_online=2, acceptance_rate=1.0,
        submissions_accepted=10, submissions_rejected=0, groups_dropped_zero_signal=0, samples_dropped_stale=0,
        rollout_tokens_per_s=100.0, trained_samples_per_s=1.0, verify_queue=37, verify_in_per_s=4.5,
        verify_out_per_s=2.25, verify_tokens_per_s=1234.0, verifier_actors=2, verifier_actors_pending=1,
    )
    run = SimpleNamespace(progress=Progress(status=st), cfg=RunConfig(), url="http://127.0.0.1:1")
    console = Console(record=True, width=160)
    console.print(render(run))
    text = console.export_text()
    assert "2 live, 1 pending; queue 37 (4.50/s in, 2.25/s verified, 1,234 tok/s)" in text
