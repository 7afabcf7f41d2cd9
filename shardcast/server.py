"""The read-only shard HTTP server, shared by the origin and relays (paths: protocol.api.SHARDCAST_*).

Why not fastapi/uvicorn: relays run outside the cluster on volunteer-grade installs (no fastapi), and the
hot path is "copy a file to a socket". A `ThreadingHTTPServer` that hands shard bodies to the kernel with
`socket.sendfile` (zero-copy, the GIL released for the whole body) serves at nginx-like rates; a deep
listen queue keeps a burst of clients from being refused (PyPI shardcast's single-threaded server
overflowed its queue). Every error is a 4xx/503 with a protocol ErrorBody; nothing here can 500 on input.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from protocol.manifests import VersionList
from protocol.proxies import Network, is_proxy, proxy_networks
from shardcast.config import DEFAULTS
from shardcast.store import ShardUnavailable, VersionStore

if TYPE_CHECKING:
    from shardcast.origin import Origin
    from shardcast.relay import Relay

log = logging.getLogger(__name__)

SHARD_BYTES_SERVED = Counter("shardcast_server_shard_bytes_sent", "shard body bytes handed to sendfile")
REQUESTS = Counter("shardcast_server_requests", "requests by outcome", ["route", "status"])

_VERSIONS = re.compile(r"^/v1/versions/?$")
_MANIFEST = re.compile(r"^/v1/versions/(\d{1,10})/manifest$")
_SHARD = re.compile(r"^/v1/versions/(\d{1,10})/shards/(.*)$")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # protocol.manifests.ShardName
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address, store: VersionStore, shard_wait_s: float, max_connections: int, max_per_address: int,
        head_timeout_s: float, trusted_proxies: tuple[Network, ...] = ()):
        self.store = store
        self.shard_wait_s = shard_wait_s
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.trusted_proxies = trusted_proxies
        self.head_timeout_s = head_timeout_s
        self.open_connections: dict[socket.socket, str] = {}  # -> client address
        self.per_address: dict[str, int] = {}
        self.head_deadlines: dict[socket.socket, float] = {}  # connections waiting for a request head
        self._conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def get_request(self):
        conn, addr = super().get_request()
        with self._conn_lock:
            self.open_connections[conn] = addr[0]
            self.per_address[addr[0]] = self.per_address.get(addr[0], 0) + 1
        return conn, addr

    def process_request(self, request, client_address):
        # One thread per connection: cap them, in all and per client address, so a flood of idle connections
        # cannot exhaust the host, and one client cannot take every slot from the others.
        with self._conn_lock:
            over = len(self.open_connections) > self.max_connections or self.per_address.get(client_address[0],
                0) > self.max_per_address and not is_proxy(client_address[0], self.trusted_proxies)
        if over:
            REQUESTS.labels("refused", "503").inc()
            try:
                body = _error_body("rate_limited", "too many connections; retry later", 1.0)
                head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
                request.sendall(head.encode() + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._conn_lock:
            address = self.open_connections.pop(request, None)
            self.head_deadlines.pop(request, None)
            if address is not None:
                left = self.per_address.get(address, 1) - 1
                if left > 0:
                    self.per_address[address] = left
                else:
                    self.per_address.pop(address, None)
        super().shutdown_request(request)

    def waiting_for_head(self, conn: socket.socket, waiting: bool) -> None:
        with self._conn_lock:
            if waiting:
                self.head_deadlines[conn] = time.monotonic() + self.head_timeout_s
            else:
                self.head_deadlines.pop(conn, None)

    def service_actions(self) -> None:
        # Called by serve_forever every poll: a request head (line and headers) must arrive within
        # head_timeout_s, however its bytes trickle in (the socket timeout bounds only each silence), so a
        # slow-loris holds no connection for long.
        now = time.monotonic()
        with self._conn_lock:
            late = [c for c, t in self.head_deadlines.items() if t < now]
            for c in late:
                del self.head_deadlines[c]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def abort_connections(self) -> None:
        with self._conn_lock:
            conns = list(self.open_connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses one connection for many shards
    default_request_version = "HTTP/1.1"  # so even a garbled request line gets a status line back
    server_version = "shardcast/1"
    timeout = 60  # an idle or stalled connection is closed, never held forever
    server: _HTTPServer

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        log.debug("%s " + format, self.address_string(), *args)

    def handle_one_request(self):
        self.server.waiting_for_head(self.connection, True)  # cleared in parse_request, once the head is in
        try:
            super().handle_one_request()
        except ConnectionError:  # the client went away (or the head deadline shut its socket mid-write)
            self.close_connection = True
        finally:
            self.server.waiting_for_head(self.connection, False)

    def parse_request(self):
        ok = super().parse_request()
        self.server.waiting_for_head(self.connection, False)
        return ok

    def do_GET(self):
        self._handle(send_body=True)

    def do_HEAD(self):
        self._handle(send_body=False)

    def _not_allowed(self):
        self.close_connection = True  # a request body we do not read must not be taken for the next request
        self._error(405, "invalid_request", f"method {self.command[:20]!r} is not allowed; this API is read-only",
            route="other")

    def send_error(self, code, message=None, explain=None):
        """The stdlib's protocol-level errors (bad request line, URI too long...) as our JSON ErrorBody."""
        self.close_connection = True
        try:
            self._error(code, "not_found" if code == 404 else "invalid_request", message or "bad request",
                route="malformed")
        except OSError:  # the client is gone (or its head deadline passed): nobody to tell
            pass

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # any other method: 405, not the stdlib's 501
            return self._not_allowed
        raise AttributeError(name)

    # -- routing --------------------------------------------------------------------------------------

    def _handle(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if _VERSIONS.match(path):
                body = VersionList(versions=self.server.store.versions()).model_dump_json().encode()
                return self._bytes(200, body, "application/json", send_body, route="versions")
            if path == "/metrics":
                return self._bytes(200, generate_latest(), CONTENT_TYPE_LATEST, send_body, route="metrics")
            if m := _MANIFEST.match(path):
                body = self.server.store.manifest_bytes(int(m.group(1)))
                return self._bytes(200, body, "application/json", send_body, route="manifest")
            if m := _SHARD.match(path):
                name = m.group(2)
                if not _SHARD_NAME.match(name) or ".." in name:
                    return self._error(400, "invalid_request", f"invalid shard name {name[:140]!r}", route="shard")
                return self._shard(int(m.group(1)), name, send_body)
            self._error(404, "not_found", f"no such path {path[:200]!r}", route="other")
        except ShardUnavailable as e:
            self._error(e.status, e.code, e.detail, route="shard", retry_after_s=e.retry_after_s)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True

    def _shard(self, version: int, name: str, send_body: bool) -> None:
        store = self.server.store
        with store.open_shard(version, name, wait_s=self.server.shard_wait_s) as (f, entry):
            size = entry.size
            start, end = 0, size  # [start, end)
            status = 200
            header = self.headers.get("Range")
            if header is not None:
                parsed = _parse_range(header, size)
                if parsed is None:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    body = _error_body("invalid_request", f"unsatisfiable range {header[:100]!r} for {size} bytes")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if send_body:
                        self.wfile.write(body)
                    REQUESTS.labels("shard", "416").inc()
                    return
                if parsed != (0, size):
                    start, end = parsed
                    status = 206
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{entry.sha256}"')
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            REQUESTS.labels("shard", str(status)).inc()
            if send_body and end > start:
                sent = self.connection.sendfile(f, start, end - start)
                SHARD_BYTES_SERVED.inc(sent)
                if sent != end - start:
                    self.close_connection = True

    # -- responses ------------------------------------------------------------------------------------

    def _bytes(self, status: int, body: bytes, content_type: str, send_body: bool, route: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)
        REQUESTS.labels(route, str(status)).inc()

    def _error(self, status: int, code: str, detail: str, route: str, retry_after_s: float | None = None) -> None:
        body = _error_body(code, detail, retry_after_s)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        if retry_after_s is not None:
            self.send_header("Retry-After", str(max(1, int(retry_after_s))))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        REQUESTS.labels(route, str(status)).inc()


def _error_body(code: str, detail: str, retry_after_s: float | None = None) -> bytes:
    out = {"error": code, "detail": detail[:2000]}
    if retry_after_s is not None:
        out["retry_after_s"] = retry_after_s
    return json.dumps(out).encode()


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """One `bytes=a-b` range as [start, end); None if unsatisfiable. Multi-range asks get the whole body."""
    m = _RANGE.match(header.strip())
    if not m:
        return (0, size) if "," in header else None
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        return None
    if first == "":  # suffix: the last N bytes
        n = int(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else None
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or end <= start:
        return None
    return start, end


class ShardServer:
    """A running shard server on its own thread. `url` is its base URL; `stop()` shuts it and its connections."""

    def __init__(self, store: VersionStore, host: str = "127.0.0.1", port: int = 0, shard_wait_s: float = 0.0,
                 max_connections: int = 512, max_per_address: int = 64, head_timeout_s: float = 10.0,
                 trusted_proxies: Iterable[str] = ()):
        """`trusted_proxies`: addresses or networks of reverse proxies in front (protocol.proxies), whose
        connections carry many clients and are not capped per address."""
        self._httpd = _HTTPServer((host, port), store, shard_wait_s, max_connections, max_per_address, head_timeout_s,
            proxy_networks(trusted_proxies))
        self.host, self.port = self._httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"shardcast-server-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.abort_connections()  # like a dead host: transfers in flight are cut
        self._thread.join(timeout=5)

    def __enter__(self) -> "ShardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_origin(origin: "Origin", host: str = DEFAULTS.host, port: int = 0,
    trusted_proxies: Iterable[str] = ()) -> ShardServer:
    return ShardServer(origin, host, port, trusted_proxies=trusted_proxies)


def serve_relay(relay: "Relay", host: str = DEFAULTS.host, port: int = 0,
    shard_wait_s: float = DEFAULTS.relay_shard_wait_s, trusted_proxies: Iterable[str] = ()) -> ShardServer:
    """A relay's server waits up to `shard_wait_s` for a listed shard still being mirrored, then 503s."""
    return ShardServer(relay.store, host, port, shard_wait_s, trusted_proxies=trusted_proxies)
