"""`swarmrl status`: fetch a running run's `/v1/status` with the admin token and render it with rich."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from protocol import api
from protocol.operator_models import RunStatus, WorkerList

# Identities shown in the credit table; the rest are summed in one line.
CREDIT_ROWS = 20


def _get(url: str, endpoint: api.Endpoint, admin_token: str, timeout_s: float) -> bytes:
    r = httpx.get(endpoint.url(url), headers={api.AUTH_HEADER: f"Bearer {admin_token}"}, timeout=timeout_s)
    if r.status_code != 200:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise RuntimeError(f"GET {endpoint.path}: HTTP {r.status_code}: {detail}")
    return r.content


def fetch_status(url: str, admin_token: str, timeout_s: float = 10.0) -> RunStatus:
    return RunStatus.model_validate_json(_get(url, api.STATUS, admin_token, timeout_s))


def fetch_workers(url: str, admin_token: str, timeout_s: float = 10.0) -> WorkerList:
    return WorkerList.model_validate_json(_get(url, api.WORKERS, admin_token, timeout_s))


@dataclass
class IdentityCredit:
    """One join token's credit: what its workers (every registration, online or not) had accepted."""

    token_id: str
    names: set[str] = field(default_factory=set)
    workers: int = 0
    online: int = 0
    banned: int = 0
    accepted: int = 0
    rejected: int = 0
    verified_tokens: int = 0


def credit_by_identity(workers: WorkerList) -> list[IdentityCredit]:
    """Workers summed by join token (an identity: a restarted worker registers again under the same token),
    most verified tokens first."""
    by_token: dict[str, IdentityCredit] = {}
    for w in workers.workers:
        key = w.token_id or "-"
        c = by_token.setdefault(key, IdentityCredit(key))
        c.names.add(w.name)
        c.workers += 1
        c.online += w.online
        c.banned += w.banned
        c.accepted += w.submissions_accepted
        c.rejected += w.submissions_rejected
        c.verified_tokens += w.verified_tokens
    return sorted(by_token.values(), key=lambda c: (-c.verified_tokens, -c.accepted, c.token_id))


def render_credit(workers: WorkerList, console: Any = None, rows: int = CREDIT_ROWS) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    credits = credit_by_identity(workers)
    t = Table(title="credit by identity (join token)")
    for col in ("join token", "names", "workers (online)", "accepted", "rejected", "verified tokens"):
        t.add_column(col, justify="left" if col in ("join token", "names") else "right")
    for c in credits[:rows]:
        names = ", ".join(sorted(c.names)[:3]) + (f" +{len(c.names) - 3}" if len(c.names) > 3 else "")
        banned = f", {c.banned} banned" if c.banned else ""
        t.add_row(c.token_id, names, f"{c.workers} ({c.online}{banned})", f"{c.accepted:,}", f"{c.rejected:,}",
                  f"{c.verified_tokens:,}")
    rest = credits[rows:]
    if rest:
        t.add_row(f"{len(rest)} more", "", str(sum(c.workers for c in rest)), f"{sum(c.accepted for c in rest):,}",
                  f"{sum(c.rejected for c in rest):,}", f"{sum(c.verified_tokens for c in rest):,}")
    console.print(t)


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
    """Fetch and print the run status and the credit by identity (what `swarmrl status` shows)."""
    st = fetch_status(url, admin_token)
    render_status(st, console)
    render_credit(fetch_workers(url, admin_token), console)
    return st
