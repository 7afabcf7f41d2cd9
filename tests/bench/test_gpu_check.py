"""bench/gpu_check.py, the prepared GPU check, exercised on every push: its CPU run (every part ok, no
honest completion rejected) and the wheels it carries to a GPU machine (small, and all that a run imports
beyond the machine's image: torch, transformers, safetensors, numpy, peft)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
WHEELS_TXT = REPO / "bench" / "gpu_wheels.txt"
DEVICE_IMAGE = ("torch", "transformers", "safetensors", "numpy", "peft")
PARTS = ("setup", "trainer", "pretrain", "worker", "verify_cpu", "verify_gpu", "throughput")
OFFLINE = re.compile(r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|Failed to "
    r"establish|ProxyError|timed out")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    started = time.monotonic()
    # One torch thread: on 2 cores that something else also uses, OpenMP's two threads wait on each other (the
    # worker part took 33 s instead of 12 at load average 2.5); on idle cores it costs a few seconds.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ,
                          "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text()), (
        out / "gpu_check.md").read_text(), time.monotonic() - started


def test_cpu_run_passes_every_part_and_rejects_no_honest_completion(cpu_run):
    rep, md_text, _wall = cpu_run
    parts = rep["parts"]
    assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(PARTS, "ok"), {n: parts[n].get("traceback")
        for n in parts}
    tiny = parts["trainer"]["tiny_fp32_step"]
    assert max(tiny["relative_difference"].values()) <= tiny["tolerance"]
    assert parts["trainer"]["tokens_per_s"] > 0 and parts["pretrain"]["steps"] >= 1
    for part in ("verify_cpu", "verify_gpu"):
        limits = parts[part]["limits"]
        for setting in ("t1", "t07_p09"):
            got = parts[part][setting]
            assert got["completions"] == 16 and got["tokens"] > 16, got
            assert got["false_rejections"] == 0 and got["rejected_completions"] == 0, got["rejection_examples"]
            assert got["max_logprob_diff"] <= limits["logprob_max_abs_diff"]
            assert got["worst_margin_over_tolerance"] <= 1.0
            assert got["max_exponent_mismatches"] <= limits["max_exponent_mismatches"]
    assert (parts["verify_cpu"]["config"]["dtype"], parts["verify_gpu"]["config"]["dtype"]) == ("float32", "bfloat16")
    assert set(parts["throughput"]["t1"]) >= {"generate_tokens_per_s", "verify_tokens_per_s", "ratio"}
    assert md_text.count("| ok |") == len(PARTS) and "## verify_gpu" in md_text


def test_a_part_that_overruns_its_budget_is_recorded_and_the_run_goes_on(tmp_path):
    """The hard stop: setup gets 0.2 s, is stopped there, and every later part still runs (and fails: no model)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--out", str(tmp_path),
        "--budget", "setup=0.2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert list(parts) == list(PARTS)
    assert parts["setup"]["status"] == "ran out of time" and parts["setup"]["seconds"] < 5, parts["setup"]
    assert all(parts[n]["status"].startswith("failed: ") for n in PARTS[1:]), {n: parts[n]["status"] for n in PARTS}


def _download_command(dest: Path) -> list[str]:
    """The pip download command at the top of gpu_wheels.txt, into `dest`."""
    line = next(x for x in WHEELS_TXT.read_text().splitlines() if "pip download" in x)
    args = shlex.split(line.lstrip("# "))
    assert args[:4] == ["python3", "-m", "pip", "download"] and args[args.index("-d") + 1] == "bench/gpu_wheels", line
    args[0] = sys.executable
    args[args.index("-d") + 1] = str(dest)
    args[args.index("-r") + 1] = str(WHEELS_TXT)
    return args


def _requirements() -> list[str]:
    return [x.split("==")[0] for x in WHEELS_TXT.read_text().splitlines() if x.strip() and not x.startswith("#")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    dest = tmp_path_factory.mktemp("gpu-wheels")
    proc = subprocess.run(_download_command(dest), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        if OFFLINE.search(proc.stdout + proc.stderr):
            pytest.skip(f"pip download could not reach the package index: {(proc.stdout + proc.stderr)[-300:]}")
        pytest.fail(proc.stdout[-2000:] + proc.stderr[-2000:])
    return dest


def test_wheels_are_small_and_install_with_no_index(wheels, tmp_path):
    files = sorted(wheels.glob("*.whl"))
    assert sorted(_norm(f.name.split("-")[0]) for f in files) == sorted(_norm(r) for r in _requirements())
    total = sum(f.stat().st_size for f in files)
    assert total < 40 * 2**20, f"{total / 2**20:.1f} MiB"
    # The script's own install (no index, no dependency resolution), for the GPU image's Python.
    line = next(x for x in WHEELS_TXT.read_text().splitlines() if "pip download" in x)
    target = [a for a in shlex.split(line.lstrip("# ")) if a not in ("-d", "bench/gpu_wheels", "-r",
        "bench/gpu_wheels.txt")][4:]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                           "--target", str(tmp_path / "site"), *target, "-r", str(WHEELS_TXT)], capture_output=True,
                           text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "site" / "pydantic").is_dir() and (tmp_path / "site" / "pydantic_core").is_dir()


def test_the_script_installs_the_wheels_where_pydantic_is_missing(tmp_path):
    """bench/gpu_check_lib.ensure_wheels in a bare virtual environment (no pydantic, as on the GPU image): the listed
    wheels, fetched for this Python, installed with no index onto sys.path, are enough for the configs."""
    line = next(x for x in WHEELS_TXT.read_text().splitlines() if "pip download" in x)
    args = _download_command(tmp_path / "wheels")
    args[args.index("--python-version") + 1] = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and OFFLINE.search(proc.stdout + proc.stderr):
        pytest.skip(f"pip download could not reach the package index: {(proc.stdout + proc.stderr)[-300:]}")
    assert proc.returncode == 0, (line, proc.stderr[-2000:])
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=300)
    code = (f"import pathlib, sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'bench')!r}]\n"
            f"import gpu_check_lib as m; m.WHEELS = pathlib.Path({str(tmp_path / 'wheels')!r})\n"
            "print(m.ensure_wheels()); from verifier.config import VerifierConfig; from trainer.config import "
            "TrainerConfig\n"
            "print(VerifierConfig(dtype='bfloat16', device='cuda').device, TrainerConfig(bf16=True).bf16)")
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"installed into {tmp_path / 'gpu_check_site'}", "cuda True"], proc.stdout


def _image_closure() -> set[str]:
    """Distributions the GPU image holds for sure: the five packages and their requirements, recursively."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(DEVICE_IMAGE)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


def test_a_run_imports_nothing_beyond_the_image_and_the_wheels(cpu_run):
    """Every module that an import statement of the project's code (the script's included) named during the
    run is the standard library's, the project's, the GPU image's or a carried wheel's."""
    imports = set(cpu_run[0]["imports"])
    ours = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    allowed_dists = _image_closure() | {_norm(r) for r in _requirements()}
    allowed = {mod for mod, dists in md.packages_distributions().items() if any(_norm(d) in allowed_dists
        for d in dists)}
    allowed |= set(sys.stdlib_module_names) | ours
    needs = sorted(imports - allowed)
    assert not needs, f"bench/gpu_check.py needs {needs}: neither the GPU image's nor bench/gpu_wheels.txt's"
    assert {"pydantic", "torch", "transformers", "numpy", "safetensors", "tokenizers", "protocol", "trainer",
        "verifier"} <= imports
