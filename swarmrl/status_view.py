"""`swarmrl status`: fetch a running run's `/v1/status` with the admin token and render it with rich."""

from __future__ import annotations

from typing import Any

import httpx

from protocol import api
from protocol.operator_models import RunStatus


def fetch_status(url: str, admin_token: str, timeout_s: float = 10.0) -> RunStatus:
    r = httpx.get(api.STATUS.url(url), headers={api.AUTH_HEADER: f"Bearer {admin_token}"}, timeout=timeout_s)
    if r.status_code != 200:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise RuntimeError(f"GET {api.STATUS.path}: HTTP {r.status_code}: {detail}")
    return RunStatus.model_validate_json(r.content)


def render_status(st: RunStatus, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from swarmrl.live_view import reward_failures_line

    console = console or Console()
    t = Table(title=f"swarmrl run '{st.run_name}'", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [
        ("step", st.step),
        ("policy version", st.policy_version),
        ("async level", st.async_level),
        ("workers online", st.workers_online),
        ("buffer depth", st.buffer_depth),
        ("acceptance rate",
        f"{st.acceptance_rate:.1%} ({st.submissions_accepted} accepted, {st.submissions_rejected} rejected)"),
        ("mean reward", "–" if st.mean_reward is None else f"{st.mean_reward:.3f}"),
        ("rollout tokens/s", f"{st.rollout_tokens_per_s:.1f}"),
        ("trained samples/s", f"{st.trained_samples_per_s:.2f}"),
        ("zero-signal groups dropped", st.groups_dropped_zero_signal),
        ("rewards not computed", reward_failures_line(st)),
        ("stale samples dropped", st.samples_dropped_stale),
        ("verification queue",
        f"{st.verify_queue} ({st.verify_in_per_s:.2f}/s in, {st.verify_out_per_s:.2f}/s verified)"),
        ("verified tokens/s", f"{st.verify_tokens_per_s:.1f}"),
        ("verifier actors", f"{st.verifier_actors} live, {st.verifier_actors_pending} pending"),
        ("near-tie tokens", f"{st.near_tie_tokens} of {st.verified_tokens} verified"),
        ("staleness (gap: samples)", ", ".join(f"{k}: {v}" for k, v in st.staleness_histogram.items()) or "–"),
    ]
    if st.eval_latest is not None:
        from swarmrl.live_view import eval_line

        rows.append(("eval (held out)", eval_line(st.eval_latest)))
    if st.restarts:
        rows.append(("restarts (time lost)", ", ".join(f"{n} {r.count} ({r.seconds_lost:.0f} s)" for n,
            r in st.restarts.items())))
    if st.finished:
        rows.append(("finished", "yes"))
    if st.error:
        rows.append(("error", f"[red]{st.error}[/]"))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


def status(url: str, admin_token: str, console: Any = None) -> RunStatus:
    """Fetch and print the run status (what `swarmrl status` shows)."""
    st = fetch_status(url, admin_token)
    render_status(st, console)
    return st
