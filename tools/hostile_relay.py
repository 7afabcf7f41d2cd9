"""A hostile relay (tests, the soak test): a real HTTP server in front of an honest upstream that stalls, drips, lies
about sizes, or alters bytes, as a relay with our source code might.

Listings and manifests are passed through unchanged (so the relay looks worth using) unless the mode
targets them; files are fetched whole from the upstream, then served in the chosen way.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_FILE = re.compile(r"^/v1/versions/(\d+)/shards/(.+)$")
_MANIFEST = re.compile(r"^/v1/versions/(\d+)/manifest$")


class HostileRelay:
    """modes (file requests unless said): 'drip' (the right bytes at `rate` bytes/s), 'stall' (the head and
    `stall_after` bytes, then nothing), 'silent' (reads the request, never answers), 'drip_head' (every
    response, head included, a byte every `head_interval_s`), 'huge' (claims a terabyte), 'flip' (one byte
    altered, in files whose name contains `flip_match`), 'huge_manifest' (a manifest claiming 1 GB), 'not_yet'
    (503 "still on its way" for every file, forever), 'listing' (lists `listing` instead of what it has)."""

    def __init__(self, upstream: str, mode: str, rate: int = 1000, stall_after: int = 100_000,
                 head_interval_s: float = 0.5, flip_match: str = "", listing: list[int] | None = None):
        self.upstream, self.mode, self.rate, self.stall_after = upstream.rstrip("/"), mode, rate, stall_after
        self.head_interval_s, self.flip_match, self.listing = head_interval_s, flip_match, listing or []
        self.requests: list[str] = []
        self.bytes_sent = 0  # file body bytes
        self.manifest_bytes_sent = 0
        self._stop = threading.Event()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                relay.requests.append(self.path)
                try:
                    relay._serve(self)
                except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
                    self.close_connection = True

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    # ----------------------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        is_file = bool(_FILE.match(h.path))
        if self.mode == "silent" and is_file:
            self._stop.wait(600)
            return
        if self.mode == "not_yet" and is_file:
            body = b'{"error":"timeout","detail":"still on its way"}'
            return self._write(h, 503, {"Content-Length": str(len(body)), "Content-Type": "application/json",
                "Retry-After": "1"}, body)
        if self.mode == "listing" and h.path == "/v1/versions":
            body = json.dumps({"versions": self.listing}).encode()
            return self._write(h, 200, {"Content-Length": str(len(body)), "Content-Type": "application/json"}, body)
        headers = {"Range": h.headers["Range"]} if h.headers.get("Range") else {}
        up = httpx.get(self.upstream + h.path, headers=headers, timeout=30)
        body = up.content
        if self.mode == "huge_manifest" and _MANIFEST.match(h.path):
            head = f"HTTP/1.1 200 X\r\nContent-Length: {1 << 30}\r\nContent-Type: application/json\r\n\r\n"
            h.wfile.write(head.encode())
            while not self._stop.is_set():  # as much as the client will take
                h.wfile.write(b" " * 65536)
                self.manifest_bytes_sent += 65536
            return
        if not is_file or up.status_code not in (200, 206):
            return self._write(h, up.status_code, self._pass_headers(up, len(body)), body,
                drip=self.mode == "drip_head")
        out = self._pass_headers(up, len(body))
        if self.mode == "huge":
            out["Content-Length"] = str(1 << 40)
        if self.mode == "flip" and self.flip_match in h.path and body:
            body = bytearray(body)
            body[len(body) // 2] ^= 0x01
            body = bytes(body)
        self._write(h, up.status_code, out, body, drip=self.mode in ("drip", "drip_head"), stall=self.mode == "stall")

    @staticmethod
    def _pass_headers(up: httpx.Response, length: int) -> dict[str, str]:
        out = {"Content-Length": str(length), "Content-Type": up.headers.get("content-type",
            "application/octet-stream")}
        if "content-range" in up.headers:
            out["Content-Range"] = up.headers["content-range"]
        return out

    def _write(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, drip: bool = False,
        stall: bool = False) -> None:
        head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        if self.mode == "drip_head":
            for b in head.encode():
                if self._stop.is_set():
                    return
                h.wfile.write(bytes([b]))
                h.wfile.flush()
                time.sleep(self.head_interval_s)
        else:
            h.wfile.write(head.encode())
        if stall:
            h.wfile.write(body[: self.stall_after])
            h.wfile.flush()
            self.bytes_sent += min(len(body), self.stall_after)
            self._stop.wait(600)
            return
        if drip:
            step = max(1, self.rate // 10)
            for i in range(0, len(body), step):
                if self._stop.is_set():
                    return
                h.wfile.write(body[i : i + step])
                h.wfile.flush()
                self.bytes_sent += len(body[i : i + step])
                time.sleep(0.1)
            return
        h.wfile.write(body)
        self.bytes_sent += len(body)
