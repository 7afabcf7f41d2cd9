"""A stranger joins with one `docker run` of the CPU image (deploy/VOLUNTEER.md's `run:docker-cpu` line): by open
join, with no token and no model of its own, against a running run (`swarmrl run` on loopback, real trainer and
verifier). It keeps its identity across a container restart through the volume, shows its credit in its own log
and in the operator's `swarmrl status`, and leaves cleanly on `docker stop` (SIGTERM) with every submitted task
verified. Skipped, with its reason, where no Docker daemon answers or the image is not built (`make images`).

One change to the guide's line: `--network host`, the test's stand-in for the internet (the run serves on this
machine's loopback). The volume and container get names of their own, removed afterwards.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time

import pytest
from docker_available import docker_with_image
from volunteer_run import RunToJoin, credit_row, guide_block, log_credit

from orchestrator.tokens import OPEN_JOIN_PREFIX

IMAGE = "swarmrl-cpu:dev"

pytestmark = pytest.mark.timeout(1500)


def start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(docker: str, container: str, proc: subprocess.Popen, log) -> tuple[int, str]:
    """`docker stop` (SIGTERM, then the run line's --stop-timeout), and the foreground `docker run`'s exit code."""
    subprocess.run([docker, "stop", container], capture_output=True, timeout=300)
    code = proc.wait(60)
    return code, log.read_text(errors="replace")


def test_a_stranger_joins_with_one_docker_run_keeps_its_identity_and_leaves_cleanly(tmp_path):
    docker = docker_with_image(IMAGE)
    (line,) = guide_block("run:docker-cpu")
    assert IMAGE in line and "-v swarmrl-work:/work" in line, line
    volume, container = f"swarmrl-test-{secrets.token_hex(4)}", f"swarmrl-volunteer-{secrets.token_hex(4)}"
    with RunToJoin(tmp_path / "run", open_join=True) as run:
        run.wait_ready()
        cmd = run.guide_line(line, token=None).replace("-v swarmrl-work:/work", f"-v {volume}:/work")
        argv = cmd.split()
        assert argv[:2] == ["docker", "run"]
        argv = [docker, "run", "--network", "host", "--name", container, *argv[2:]]
        logs = [tmp_path / "first.log", tmp_path / "second.log"]
        try:
            # 1. The first start: it claims a token, fetches the run's config and tokenizer, works, is stopped.
            began = time.perf_counter()
            first = start(argv, logs[0])
            run.wait_accepted("my-cpu", 2, [first], [logs[0]])
            first_accepted_s = time.perf_counter() - began
            code, log = stop(docker, container, first, logs[0])
            assert code == 0, log[-4000:]
            assert "claimed a join token by open join" in log and "base model config and tokenizer from the run" in log
            (row,) = run.workers("my-cpu")
            token = row["token_id"]
            assert token.startswith(OPEN_JOIN_PREFIX), token
            submitted = int(re.search(r"worker stopped: (\d+) tasks submitted", log).group(1))
            assert row["submissions_accepted"] + row["submissions_rejected"] == submitted >= 2, (row, log[-3000:])
            credit = (row["submissions_accepted"], row["submissions_rejected"], row["verified_tokens"])
            assert log_credit(log)[-1] == credit, log[-3000:]
            assert row["state"] == "stopped" and not row["online"], row

            # 2. The same command again: the volume gives it its identity back, and its credit with it.
            began = time.perf_counter()
            second = start(argv, logs[1])
            rows = run.wait_accepted("my-cpu", credit[0] + 1, [second], [logs[1]])
            restart_accepted_s = time.perf_counter() - began
            assert [r["token_id"] for r in rows] == [token, token], rows
            status = run.status_text()
            code, log = stop(docker, container, second, logs[1])
            assert code == 0, log[-4000:]
            assert "joining with the open-join token kept in /work/open-join-token.json" in log, log[-3000:]
            assert "claimed a join token" not in log
            assert log_credit(log)[0] == credit, log[-3000:]  # its registration: the credit so far
            rows = run.workers("my-cpu")
            total = tuple(sum(r[k] for r in rows) for k in ("submissions_accepted", "submissions_rejected",
                                                            "verified_tokens"))
            assert log_credit(log)[-1] == total and total[0] > credit[0], (total, log[-3000:])
            # The operator's view while it worked: one identity, two registrations, the credit of both.
            cells = credit_row(status, token)
            assert cells[2].startswith("2 ("), cells
            print(f"first accepted work {first_accepted_s:.0f} s after `docker run` (claim, base model, vLLM start); "
                  f"after the restart {restart_accepted_s:.0f} s; credit {total}")
        finally:
            subprocess.run([docker, "rm", "-f", container], capture_output=True, timeout=120)
            subprocess.run([docker, "volume", "rm", "-f", volume], capture_output=True, timeout=120)
