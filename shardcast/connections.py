"""Keep-alive HTTP GETs to shard servers: one connection per (thread, server), over `http.client`, whose
`HTTPResponse.readinto` fills a reused buffer with no per-chunk allocation (faster than httpx on the
shard hot path, measured)."""

from __future__ import annotations

import http.client
import threading
import urllib.parse


class TransferFailed(Exception):
    """The transfer broke or was refused: try elsewhere, maybe later."""

    def __init__(self, msg: str, missing: bool = False, not_yet: bool = False):
        super().__init__(msg)
        self.missing = missing  # the server does not have this version/shard (404)
        self.not_yet = not_yet  # a relay lists the version but is still verifying this shard (503)


class _Connections(threading.local):
    def __init__(self):
        self.by_url: dict[str, http.client.HTTPConnection] = {}


class Http:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._local = _Connections()

    def _conn(self, url: str) -> http.client.HTTPConnection:
        conn = self._local.by_url.get(url)
        if conn is None:
            u = urllib.parse.urlsplit(url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, u.port, timeout=self.timeout_s)
            self._local.by_url[url] = conn
        return conn

    def close(self, url: str) -> None:
        conn = self._local.by_url.pop(url, None)
        if conn is not None:
            conn.close()

    def request(self, url: str, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """GET; retried once on a stale keep-alive connection. The caller reads or closes the response."""
        base = urllib.parse.urlsplit(url).path.rstrip("/")
        for attempt in (0, 1):
            conn = self._conn(url)
            try:
                conn.request("GET", base + path, headers=headers or {})
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self.close(url)
                if attempt == 1:
                    raise TransferFailed(f"{url}: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                self.close(url)
                raise TransferFailed(f"{url}: {e}") from None
        raise AssertionError("unreachable")

    def get_small(self, url: str, path: str, limit: int) -> bytes:
        resp = self.request(url, path)
        try:
            if resp.status != 200:
                detail = resp.read(4096).decode(errors="replace")
                raise TransferFailed(f"{url}{path}: HTTP {resp.status} {detail[:200]}", missing=resp.status == 404)
            length = resp.getheader("Content-Length")
            if length is None or not length.isdigit() or int(length) > limit:
                self.close(url)
                raise TransferFailed(f"{url}{path}: response without a length or larger than {limit} bytes")
            return resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close(url)
            raise TransferFailed(f"{url}{path}: {e}") from None
