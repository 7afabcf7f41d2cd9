"""`swarmrl shardcast origin|relay|pull|keygen`: the shardcast library's servers and client as commands.

A started server prints one JSON line on stdout, `{"url": ..., "public_key": ...}`, so scripts can read
where it listens (port 0 picks a free port). It serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from shardcast.config import DEFAULTS

app = typer.Typer(name="shardcast", help="Signed, sharded, relayed broadcast of policy weights.", no_args_is_help=True,
    add_completion=False)


def _announce(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _serve_until_signal(stop) -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop()


def _logging(level: str) -> None:
    from swarmrl.logs import configure_logging

    configure_logging(level)


@app.command()
def keygen(out: Path = typer.Option(..., "--out",
    help="where to write the new ed25519 private key (PEM, 0600)")) -> None:
    """Make a run signing key and print its public key."""
    from shardcast.keys import generate_signing_key, public_key_b64

    if out.exists():
        raise typer.BadParameter(f"{out} exists; refusing to overwrite a key")
    _announce(public_key=public_key_b64(generate_signing_key(out)), key_path=str(out))


RUN_ID_HELP = "the run id signed into (and required of) every manifest"
# A relay told to stop frees its port first and exits within seconds; its successor on the same folder
# (the supervisor starts it once the port is free) waits this long for it to be gone.
RELAY_LOCK_WAIT_S = 60.0


def _networks(entries: list[str]) -> list[str]:
    from protocol.proxies import proxy_networks

    try:
        proxy_networks(entries)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--trusted-proxy") from None
    return entries


@app.command()
def origin(
    root: Path = typer.Option(..., help="folder holding the published versions"),
    key: Path = typer.Option(..., help="ed25519 signing key (PEM); created if missing"),
    run_id: str = typer.Option(..., help=RUN_ID_HELP),
    host: str = typer.Option(DEFAULTS.host),
    port: int = typer.Option(0, help="0 picks a free port"),
    keep_versions: int = typer.Option(DEFAULTS.keep_versions, min=1),
    shard_bytes: int = typer.Option(DEFAULTS.shard_bytes, min=1 << 10),
    publish: Optional[Path] = typer.Option(None,
    help="publish this folder's *.safetensors (e.g. an HF model dir) before serving"),
    version: int = typer.Option(0, min=0, help="version number for --publish"),
    grace_s: float = typer.Option(DEFAULTS.delete_grace_s, min=0,
    help="keep a superseded version until nobody touched it this long"),
    trusted_proxy: list[str] = typer.Option([], callback=_networks, help="address or network (CIDR) of a reverse "
    "proxy in front of this server, whose connections are not capped per address; repeat for several"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Serve the origin (and optionally publish a model folder first)."""
    _logging(log_level)
    from shardcast.keys import load_or_generate_signing_key
    from shardcast.origin import Origin
    from shardcast.server import serve_origin

    store = Origin(root, load_or_generate_signing_key(key), run_id=run_id, keep_versions=keep_versions,
        shard_bytes=shard_bytes, grace_s=grace_s)
    if publish is not None:
        from shardcast.weights import load_version_dir

        store.publish(version, load_version_dir(publish))
    server = serve_origin(store, host, port, trusted_proxies=trusted_proxy)
    _announce(url=server.url, public_key=store.public_key_b64, versions=store.versions())
    _serve_until_signal(server.stop)


@app.command()
def relay(
    upstream: list[str] = typer.Option(..., help="upstream server URL (origin or relay); repeat for several"),
    root: Path = typer.Option(..., help="folder for mirrored versions"),
    public_key: str = typer.Option(..., help="the run's public key (base64 raw ed25519)"),
    run_id: Optional[str] = typer.Option(None,
    help=RUN_ID_HELP + "; default: follow the run of the newest version upstream signs"),
    host: str = typer.Option(DEFAULTS.host),
    port: int = typer.Option(0),
    keep_versions: int = typer.Option(DEFAULTS.keep_versions, min=1),
    poll_interval_s: float = typer.Option(DEFAULTS.relay_poll_interval_s, min=0.01),
    parallelism: int = typer.Option(DEFAULTS.relay_parallelism, min=1, max=64,
    help="shards fetched at once from upstream"),
    shard_wait_s: float = typer.Option(DEFAULTS.relay_shard_wait_s, min=0,
    help="hold a request for a listed shard still on its way this long, then 503"),
    grace_s: float = typer.Option(DEFAULTS.delete_grace_s, min=0,
    help="keep a superseded version until nobody touched it this long"),
    trusted_proxy: list[str] = typer.Option([], callback=_networks, help="address or network (CIDR) of a reverse "
    "proxy in front of this server, whose connections are not capped per address; repeat for several"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Mirror upstream versions (verifying every manifest and shard) and serve them."""
    _logging(log_level)
    from shardcast.relay import Relay
    from shardcast.server import serve_relay
    from shardcast.store import FolderInUse, lock_folder

    try:
        lock_folder(root, RELAY_LOCK_WAIT_S, "relay")
    except FolderInUse as e:
        raise typer.BadParameter(str(e), param_hint="--root") from None
    try:
        r = Relay(upstream, root, public_key, run_id=run_id, keep_versions=keep_versions,
            poll_interval_s=poll_interval_s, parallelism=parallelism, grace_s=grace_s)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--public-key") from None
    server = serve_relay(r, host, port, shard_wait_s=shard_wait_s, trusted_proxies=trusted_proxy)
    r.start()
    _announce(url=server.url, public_key=public_key)

    def stop() -> None:
        server.stop()
        # Not a long wait: a download in flight is resumed from its `.part` by the next relay on this folder,
        # which waits for this process (and its lock) to be gone.
        r.stop(timeout_s=2.0)

    _serve_until_signal(stop)


@app.command()
def pull(
    server: list[str] = typer.Option(..., help="shard server URL (relays); repeat for several"),
    public_key: str = typer.Option(..., help="the run's public key (base64 raw ed25519)"),
    run_id: str = typer.Option(..., help=RUN_ID_HELP),
    fallback: list[str] = typer.Option([],
    help="server used only when the others fail or are too slow (the origin); repeat for several"),
    dest: Path = typer.Option(..., help="folder that receives v<version>/"),
    version: Optional[int] = typer.Option(None, min=0, help="default: the newest"),
    parallelism: int = typer.Option(DEFAULTS.client_parallelism, min=1, max=64),
    retries: int = typer.Option(DEFAULTS.client_retries, min=0),
    keep_versions: Optional[int] = typer.Option(None, min=1, help="delete older pulled versions beyond this many"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Download and verify a version; prints {"version", "path", "model_hash"}."""
    _logging(log_level)
    from shardcast.client import ShardcastClient, ShardcastError
    from shardcast.keys import ManifestError
    from shardcast.store import DiskFullError

    try:
        client = ShardcastClient(
            server, public_key, dest, run_id=run_id, fallback_urls=fallback, parallelism=parallelism, retries=retries,
            keep_versions=keep_versions, keep_state=False,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--public-key") from None
    try:
        pulled = client.pull(version)
    except (ShardcastError, ManifestError, DiskFullError) as e:
        sys.stderr.write(f"shardcast pull failed: {e}\n")
        raise typer.Exit(1) from None
    _announce(version=pulled.version, path=str(pulled.path), model_hash=pulled.manifest.model_hash,
        wire_bytes=pulled.wire_bytes, steps=pulled.steps)
