"""Keep-alive HTTP/1.1 GETs to untrusted shard servers, on plain sockets, with a deadline on every wait.

Why not http.client: a server decides how its bytes arrive, and http.client has only a per-read timeout. A
relay that drips a byte a second kept a `readinto` (which fills the whole buffer before it returns) going
for minutes, and would do the same to a header line. Here every wait (connect, the response head, each
body read) is bounded by the stall timeout and by the request's deadline; the head is capped in size;
a body needs a Content-Length (no chunked encoding), and body bytes are received straight into the
caller's buffer, one `recv_into` per call, so the caller sees progress (and its rate) as it happens.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import ssl
import sys
import termios
import threading
import time
import urllib.parse

MAX_HEAD_BYTES = 32 << 10  # status line + headers of one response
# A spliced body is moved in batches of at least this many bytes (SO_RCVLOWAT): every splice into a file
# costs a file write (page-cache and inode-time updates) whatever its size, and a reader woken for every
# segment moves a few tens of KiB per call when the box has cores to spare. 4 clients x 512 MiB at 64 KiB
# per call took 3.1 CPU-s, at ~900 KiB per call 2.1 (bench/results/shardcast_notes.md).
SPLICE_BATCH_BYTES = 512 << 10
# ...but a batch is never waited for longer than this once some bytes are there: a slow source stays slow
# (and is judged by its rate), never looks stalled.
BATCH_WAIT_S = 0.1


class TransferFailed(Exception):
    """The transfer broke, was refused or was too slow: try elsewhere, maybe later."""

    def __init__(self, msg: str, missing: bool = False, not_yet: bool = False, slow: bool = False):
        super().__init__(msg)
        self.missing = missing  # the server does not have this version/file (404)
        self.not_yet = not_yet  # a relay lists the version but is still verifying this file (503)
        self.slow = slow  # stalled, dripped, or missed its deadline


class _Conn:
    def __init__(self, sock: socket.socket, host_header: str):
        self.sock = sock
        self.host_header = host_header
        self.used = False  # served a response before: it may have been closed by the server while idle
        self.lowat = 1  # SO_RCVLOWAT now set on the socket

    def set_lowat(self, n: int) -> None:
        if n != self.lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self.lowat = n


class Response:
    """A response whose head was read; the body is read with `readinto` or `read`."""

    def __init__(self, http: "Http", url: str, conn: _Conn, status: int, headers: dict[str, str], pending: bytes):
        self._http, self._url, self._conn = http, url, conn
        self.status = status
        self.headers = headers
        self._pending = memoryview(pending)
        length = headers.get("content-length", "")
        self.length = int(length) if length.isdigit() and len(length) < 16 else None
        self._left = self.length
        self._reusable = headers.get("connection", "").lower() != "close"

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def readinto(self, view: memoryview, deadline: float) -> int:
        """Receive up to len(view) body bytes (what has arrived, at least one); raises TransferFailed."""
        if self._left is None:
            raise TransferFailed(f"{self._url}: response without a Content-Length")
        want = min(len(view), self._left)
        if want <= 0:
            return 0
        if self._pending:
            n = min(want, len(self._pending))
            view[:n] = self._pending[:n]
            self._pending = self._pending[n:]
        else:
            n = self._http._recv_into(self._conn, self._url, view[:want], deadline)
        self._left -= n
        if self._left == 0:
            self._done()
        return n

    @property
    def can_splice(self) -> bool:
        """Whether the body can go socket -> pipe -> file in the kernel (plain TCP on Linux)."""
        return self._conn is not None and not isinstance(self._conn.sock, ssl.SSLSocket) and hasattr(os, "splice")

    def splice_into(self, fd: int, offset: int, count: int, pipe: tuple[int, int], deadline: float) -> int:
        """Move up to `count` body bytes (what has arrived, at least one) into file `fd` at `offset`, without
        copying them through Python (one copy fewer than recv + write); returns how many."""
        want = min(count, self._left or 0)
        if want <= 0:
            return 0
        if self._pending:  # bytes that came with the head
            n = os.pwrite(fd, self._pending[:want], offset)
            self._pending = self._pending[n:]
        else:
            self._http._wait_readable(self._conn, self._url, deadline, batch=min(want, SPLICE_BATCH_BYTES))
            try:
                n = os.splice(self._conn.sock.fileno(), pipe[1], want, flags=os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE)
            except BlockingIOError:
                return 0  # woken without data (it happens): the caller checks its clocks and comes back
            except OSError as e:
                raise TransferFailed(f"{self._url}: {e!r}") from None
            if n == 0:
                raise TransferFailed(f"{self._url}: the server closed the connection")
            moved = 0
            while moved < n:
                moved += os.splice(pipe[0], fd, n - moved, offset_dst=offset + moved)
        self._left -= n
        if self._left == 0:
            self._done()
        return n

    def read(self, limit: int, deadline: float) -> bytes:
        """The whole body, refused if over `limit` bytes (checked before reading it)."""
        if self.length is None or self.length > limit:
            self.discard()
            raise TransferFailed(f"{self._url}: response without a length or larger than {limit} bytes")
        out = bytearray(self.length)
        view, got = memoryview(out), 0
        while got < self.length:
            got += self.readinto(view[got:], deadline)
        return bytes(out)

    def discard(self) -> None:
        """Give up on the rest of the body: the connection cannot be reused."""
        if self._conn is not None:
            self._http._drop(self._url, self._conn)
            self._conn = None

    def _done(self) -> None:
        if self._conn is None:
            return
        if self._reusable and not self._pending:
            self._conn.set_lowat(1)  # the next response's head is read with plain recv
            self._conn.used = True
            self._http._idle(self._url, self._conn)
        else:
            self._http._drop(self._url, self._conn)
        self._conn = None


def _queued_bytes(sock: socket.socket) -> int:
    """Bytes received and not yet read (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)), sys.byteorder, signed=True)


class _Local(threading.local):
    def __init__(self):
        self.by_url: dict[str, _Conn] = {}


class Http:
    """One keep-alive connection per (thread, server)."""

    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = stall_timeout_s
        self._local = _Local()
        self._ssl: ssl.SSLContext | None = None

    def close(self, url: str) -> None:
        conn = self._local.by_url.pop(url, None)
        if conn is not None:
            conn.sock.close()

    def request(self, url: str, path: str, deadline: float, headers: dict[str, str] | None = None) -> Response:
        """GET `path` under `url`; returns once the response head is in (retried once on a stale connection)."""
        u = urllib.parse.urlsplit(url)
        target = u.path.rstrip("/") + path
        for attempt in (0, 1):
            conn = self._local.by_url.pop(url, None) or self._connect(u, deadline)
            try:
                extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
                request = (f"GET {target} HTTP/1.1\r\nHost: {conn.host_header}\r\nUser-Agent: swarmrl-shardcast\r\n"
                           f"Accept-Encoding: identity\r\n{extra}\r\n")
                # The head comes promptly or not at all (a relay holds a request at most relay_shard_wait_s):
                # a server that drips its head is left after twice the stall timeout, whatever the deadline.
                head_deadline = min(deadline, time.monotonic() + 2 * self.stall_timeout_s)
                self._settimeout(conn, url, head_deadline)
                conn.sock.sendall(request.encode("latin-1"))
                return self._read_head(url, conn, head_deadline)
            except TransferFailed as e:
                conn.sock.close()
                if attempt == 0 and conn.used and "closed the connection" in str(e):
                    continue  # the server closed an idle keep-alive connection: once more, fresh
                raise
            except (OSError, ValueError, UnicodeError) as e:
                conn.sock.close()
                if attempt == 0 and conn.used and isinstance(e, (BrokenPipeError, ConnectionResetError)):
                    continue
                raise TransferFailed(f"{url}: {e!r}", slow=isinstance(e, socket.timeout)) from None
        raise AssertionError("unreachable")

    def get_small(self, url: str, path: str, limit: int, deadline: float) -> bytes:
        resp = self.request(url, path, deadline)
        if resp.status != 200:
            detail = resp.read(4096, deadline).decode(errors="replace") if (resp.length or 0) <= 4096 else ""
            resp.discard()
            raise TransferFailed(f"{url}{path}: HTTP {resp.status} {detail[:200]}", missing=resp.status == 404)
        return resp.read(limit, deadline)

    # -- sockets -----------------------------------------------------------------------------------

    def _connect(self, u: urllib.parse.SplitResult, deadline: float) -> _Conn:
        if u.scheme not in ("http", "https") or not u.hostname:
            raise TransferFailed(f"unsupported server URL {u.geturl()[:200]!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        timeout = self._wait_s(u.geturl(), deadline)
        try:
            sock = socket.create_connection((u.hostname, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if u.scheme == "https":
                self._ssl = self._ssl or ssl.create_default_context()
                sock = self._ssl.wrap_socket(sock, server_hostname=u.hostname)
        except OSError as e:
            raise TransferFailed(f"{u.geturl()}: cannot connect: {e!r}", slow=isinstance(e, socket.timeout)) from None
        default = (u.scheme == "http" and port == 80) or (u.scheme == "https" and port == 443)
        return _Conn(sock, u.hostname if default else f"{u.hostname}:{port}")

    def _wait_s(self, url: str, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferFailed(f"{url}: deadline passed", slow=True)
        return min(self.stall_timeout_s, left)

    def _settimeout(self, conn: _Conn, url: str, deadline: float) -> None:
        conn.sock.settimeout(self._wait_s(url, deadline))

    def _wait_readable(self, conn: _Conn, url: str, deadline: float, batch: int = 1) -> None:
        """Until `batch` bytes are queued, or fewer once BATCH_WAIT_S passed with some there, or the peer
        closed; raises if no byte at all came within the stall timeout."""
        conn.set_lowat(batch)
        poller = select.poll()
        poller.register(conn.sock.fileno(), select.POLLIN | select.POLLPRI)
        stall_at = time.monotonic() + self._wait_s(url, deadline)
        while True:
            left = stall_at - time.monotonic()
            if left <= 0:
                raise TransferFailed(f"{url}: no byte for {self.stall_timeout_s:.1f}s (or past the deadline)",
                    slow=True)
            if poller.poll(max(1, int(1000 * (min(left, BATCH_WAIT_S) if batch > 1 else left)))):
                return
            if batch > 1 and _queued_bytes(conn.sock) > 0:
                return

    def _recv_into(self, conn: _Conn, url: str, view: memoryview, deadline: float) -> int:
        self._settimeout(conn, url, deadline)
        try:
            n = conn.sock.recv_into(view)
        except socket.timeout:
            raise TransferFailed(f"{url}: no byte for {self.stall_timeout_s:.1f}s (or past the deadline)",
                slow=True) from None
        except OSError as e:
            raise TransferFailed(f"{url}: {e!r}") from None
        if n == 0:
            raise TransferFailed(f"{url}: the server closed the connection")
        return n

    def _read_head(self, url: str, conn: _Conn, deadline: float) -> Response:
        buf = bytearray(MAX_HEAD_BYTES)
        view, got = memoryview(buf), 0
        while True:
            if got == len(buf):
                raise TransferFailed(f"{url}: response head over {MAX_HEAD_BYTES} bytes")
            start = max(0, got - 3)
            got += self._recv_into(conn, url, view[got : min(len(buf), got + 4096)], deadline)
            end = buf.find(b"\r\n\r\n", start, got)
            if end >= 0:
                break
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise TransferFailed(f"{url}: not an HTTP/1.x response: {lines[0][:100]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise TransferFailed(f"{url}: malformed header line {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            raise TransferFailed(f"{url}: Transfer-Encoding {headers['transfer-encoding'][:40]!r} is not accepted; a "
                f"Content-Length is")
        return Response(self, url, conn, int(parts[1]), headers, bytes(buf[end + 4 : got]))

    def _idle(self, url: str, conn: _Conn) -> None:
        old = self._local.by_url.pop(url, None)
        if old is not None and old is not conn:
            old.sock.close()
        self._local.by_url[url] = conn

    def _drop(self, url: str, conn: _Conn) -> None:
        if self._local.by_url.get(url) is conn:
            del self._local.by_url[url]
        conn.sock.close()
