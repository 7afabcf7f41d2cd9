"""Spliced bodies move in batches (SO_RCVLOWAT) without turning a slow source into a stalled one, and the
connection goes back to plain reads for the next response. Real loopback sockets, a hand-paced server."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time

import pytest

from shardcast import connections
from shardcast.connections import Http, TransferFailed


class PacedServer:
    """Answers each GET on one keep-alive connection with the next body, written in `piece`-byte writes
    `gap_s` apart (a source that sends at its own pace)."""

    def __init__(self, bodies: list[bytes], piece: int, gap_s: float):
        self.bodies, self.piece, self.gap_s = bodies, piece, gap_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            for body in self.bodies:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
                for i in range(0, len(body), self.piece):
                    conn.sendall(body[i : i + self.piece])
                    time.sleep(self.gap_s)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def splice_body(resp, path, deadline) -> list[int]:
    """The body into `path` by splice_into; returns the bytes each call moved."""
    pipe = os.pipe()
    fcntl.fcntl(pipe[1], 1031, 1 << 20)  # F_SETPIPE_SZ, as file_fetch.py's pipes
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    moved, got = [], 0
    try:
        while got < resp.length:
            n = resp.splice_into(fd, got, 1 << 20, pipe, deadline)
            if n:
                moved.append(n)
            got += n
    finally:
        os.close(fd)
        for end in pipe:
            os.close(end)
    return moved


@pytest.fixture
def body():
    return os.urandom(4 << 20)


def test_a_steady_source_is_spliced_in_batches(tmp_path, body):
    # 32 KiB every 2 ms: a reader woken for every write would move ~32 KiB per call.
    server = PacedServer([body], piece=32 << 10, gap_s=0.002)
    try:
        http = Http(stall_timeout_s=5.0)
        resp = http.request(server.url, "/f", time.monotonic() + 60)
        assert resp.can_splice
        moved = splice_body(resp, tmp_path / "f", time.monotonic() + 60)
    finally:
        server.close()
    assert (tmp_path / "f").read_bytes() == body
    assert sum(moved) / len(moved) >= 128 << 10, f"{len(moved)} calls for {len(body)} bytes"


def test_a_slow_source_is_slow_not_stalled_and_the_connection_reads_plainly_after(tmp_path, monkeypatch):
    # 1 KiB every 20 ms never fills a batch; every wait must still end with what came, long before the stall
    # timeout, and the next response's head (smaller than any batch) must be read on the same connection.
    monkeypatch.setattr(connections, "BATCH_WAIT_S", 0.05)
    slow = os.urandom(48 << 10)
    server = PacedServer([slow, b'{"versions": [1]}'], piece=1 << 10, gap_s=0.02)
    try:
        http = Http(stall_timeout_s=0.5)
        resp = http.request(server.url, "/f", time.monotonic() + 60)
        moved = splice_body(resp, tmp_path / "f", time.monotonic() + 60)
        assert (tmp_path / "f").read_bytes() == slow
        assert max(moved) < connections.SPLICE_BATCH_BYTES  # no batch ever filled: each wait ended on its own
        assert http.get_small(server.url, "/v1/versions", 1 << 10, time.monotonic() + 10) == b'{"versions": [1]}'
    finally:
        server.close()


def test_a_source_that_stops_is_still_left_after_the_stall_timeout(tmp_path):
    server = PacedServer([os.urandom(1 << 20)], piece=256 << 10, gap_s=30.0)  # one piece, then silence
    try:
        http = Http(stall_timeout_s=0.5)
        resp = http.request(server.url, "/f", time.monotonic() + 60)
        with pytest.raises(TransferFailed) as e:
            splice_body(resp, tmp_path / "f", time.monotonic() + 60)
        assert e.value.slow
    finally:
        server.sock.close()  # the server thread sleeps on; it is a daemon
