"""What the volunteer tests share: a running run to join (`swarmrl run` on this machine's loopback: the demo's
config, real trainer and verifier, no workers of its own), the guide's commands as a stranger types them, and the
run's view of a worker (its rows in /v1/workers, and `swarmrl status` as the operator runs it)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from swarmrl.processes import free_port

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "deploy" / "VOLUNTEER.md"
GUIDE_URL, GUIDE_TOKEN = "https://api.swarmrl.example.org", "YOUR-TOKEN"


def guide_block(marker: str) -> list[str]:
    """The lines of the fenced block that follows `<!-- marker -->` in the volunteer guide."""
    text = GUIDE.read_text()
    tag = f"<!-- {marker} -->"
    assert tag in text, f"{GUIDE.name} has no {tag} block"
    block = re.search(r"```[a-z]*\n(.*?)```", text[text.index(tag):], re.S)
    assert block, f"no code block after {tag}"
    return [ln.strip() for ln in block.group(1).replace("\\\n", " ").splitlines() if ln.strip()]


class RunToJoin:
    """`swarmrl run` with no local workers, serving on loopback; stopped (SIGINT, then killed) on exit."""

    def __init__(self, out: Path, *, open_join: bool = False):
        self.out, self.port = out, free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin, self.join = secrets.token_hex(16), secrets.token_hex(12)
        args = [sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"),
                "--output_dir", str(out), "--name", "volunteers", "--num_workers", "0", "--stop_reward", "null",
                "--max_minutes", "20", "--trainer.max_steps", "100000", "--orchestrator.port", str(self.port)]
        if open_join:
            args += ["--orchestrator.open_join.enabled", "true"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMRL_")} | {
            "SWARMRL_ORCHESTRATOR__ADMIN_TOKEN": self.admin,
            "SWARMRL_ORCHESTRATOR__JOIN_TOKENS": f'["{self.join}"]', "PYTHONUNBUFFERED": "1"}
        self.log = out / "run.log"
        out.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(args, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)

    def __enter__(self) -> RunToJoin:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the run exited ({self.proc.returncode}):\n{self.tail()}"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the run did not serve within {timeout_s:.0f} s:\n{self.tail()}")

    def guide_line(self, line: str, token: str | None) -> str:
        """A guide command for this run: its URL, and the token (None: the `--join-token` option left out)."""
        assert GUIDE_URL in line and GUIDE_TOKEN in line, line
        line = line.replace(GUIDE_URL, self.url)
        return line.replace(f"--join-token {GUIDE_TOKEN}", f"--join-token {token}" if token else "")

    def workers(self, name: str) -> list[dict]:
        """The run's records of every worker called `name` (registrations, oldest first)."""
        r = httpx.get(f"{self.url}/v1/workers", headers={"Authorization": f"Bearer {self.admin}"}, timeout=10)
        r.raise_for_status()
        return [w for w in r.json()["workers"] if w["name"] == name]

    def wait_accepted(self, name: str, at_least: int, procs: list[subprocess.Popen], logs: list[Path],
                      timeout_s: float = 600) -> list[dict]:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            rows = self.workers(name)
            if sum(w["submissions_accepted"] for w in rows) >= at_least:
                return rows
            for p, log in zip(procs, logs):
                assert p.poll() is None, f"{log.name}: exit {p.returncode}\n" + log.read_text(errors="replace")[-4000:]
            assert self.proc.poll() is None, f"the run exited ({self.proc.returncode}):\n{self.tail()}"
            time.sleep(1)
        raise AssertionError(f"{name}: fewer than {at_least} accepted submissions in {timeout_s:.0f} s")

    def status_text(self) -> str:
        """`swarmrl status` as the operator's guide runs it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMRL_")} | {"COLUMNS": "200"}
        out = subprocess.run([sys.executable, "-m", "swarmrl", "status", "--orchestrator", self.url, "--admin-token",
                              self.admin], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout


def credit_row(status: str, token_id: str) -> list[str]:
    """The cells of `swarmrl status`'s credit line for one join token."""
    line = next((ln for ln in status.splitlines() if f" {token_id} " in f" {ln} "), None)
    assert line is not None, f"no credit line for {token_id}:\n{status}"
    return [cell.strip() for cell in line.strip("│| \n").split("│")]


def log_credit(log: str) -> list[tuple[int, int, int]]:
    """Every credit the worker logged, in order: (accepted, rejected, verified tokens)."""
    found = re.findall(r"credit[^:]*: ([\d,]+) accepted, ([\d,]+) rejected, ([\d,]+) verified tokens", log)
    return [tuple(int(x.replace(",", "")) for x in m) for m in found]
