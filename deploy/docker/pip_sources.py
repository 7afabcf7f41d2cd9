"""The machine's pip configuration, made usable inside `docker build` without baking it into a layer.

    python3 deploy/docker/pip_sources.py OUT_DIR [--docker docker] [--image swarmrl-pip-sources:local]

Reads what pip itself uses here (`python3 -m pip config list`: the config files and the PIP_* environment)
and writes:

    OUT_DIR/pip.conf   one [global] section with the same settings, for `--secret id=pip.conf,src=...`.
                       Local paths are rewritten to /pip-sources/<path>; `cert` to /run/secrets/ca.crt
                       (the CA bundle is its own secret, `--secret id=ca.crt,src=<the bundle>`).
    OUT_DIR/pip-index.conf   the same without find-links folders, for the GPU images: a local wheel folder
                       may hold a CPU build of torch (`2.13.0+cpu` satisfies `torch==2.13.0` and pip prefers it),
                       so they take torch's CUDA build from the package index.

and, when the configuration names local folders or files (find-links folders such as a wheel mirror,
constraint files), imports them as the image `--image` (`docker import`, their paths kept), which the
Dockerfiles bind-mount at /pip-sources for the install step only (`--build-arg PIP_SOURCES=<image>`).

Local indexes (`file://` index URLs) are large (a mirror of PyPI); they are left out unless `--with-indexes`
is given, and the package index itself (PyPI) answers for them. The image and pip.conf are never part of a
built image: secrets and bind mounts exist only while their RUN step runs.

Prints one JSON line: the secret file, the CA bundle, the sources image (or null) and what was left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

MOUNT = "/pip-sources"
CA_TARGET = "/run/secrets/ca.crt"
# pip options whose values are local paths (files or folders), or URLs that may be file:// ones.
PATH_KEYS = {"find-links", "constraint", "requirement", "src", "build", "target", "prefix", "root"}
URL_KEYS = {"index-url", "extra-index-url"}
# Options that make no sense inside an image build (or would write outside the image's venv).
DROP_KEYS = {"target", "prefix", "root", "user", "cache-dir", "log", "log-file", "no-input", "src", "build"}


def pip_config(python: str) -> dict[str, str]:
    """`pip config list` as {option: value}; the environment (`:env:`) overrides files, as pip does."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        section, _, option = key.rpartition(".")
        value = raw.strip()
        if value[:1] in "'\"":
            value = value[1:-1]
        if section == ":env:":
            env[option] = value
        elif section in ("global", "install", "download", "wheel"):
            files.setdefault(option, value)
    return {**files, **env}


def rewrite(cfg: dict[str, str], with_indexes: bool) -> tuple[dict[str, str], list[str], list[str]]:
    """The config for the build, the local paths it needs and what was left out."""
    out: dict[str, str] = {}
    needed: list[str] = []
    left_out: list[str] = []
    for key, value in cfg.items():
        if key in DROP_KEYS:
            left_out.append(f"{key}={value} (not for an image build)")
            continue
        if key == "cert":
            out[key] = CA_TARGET
            continue
        if key in PATH_KEYS or key in URL_KEYS:
            kept = []
            for item in shlex.split(value):
                local = item[len("file://"):] if item.startswith("file://") else item
                if "://" in local or not local.startswith("/"):
                    kept.append(item)  # a real URL (or a relative path, kept as is)
                elif key in URL_KEYS and not with_indexes:
                    left_out.append(f"{key} {item} (a local index; the package index answers instead)")
                elif not os.path.exists(local):
                    left_out.append(f"{key} {item} (does not exist here)")
                else:
                    needed.append(local)
                    kept.append(("file://" if item.startswith("file://") else "") + MOUNT + local)
            if kept:
                out[key] = " ".join(kept)
            continue
        out[key] = value
    return out, needed, left_out


def sources_stamp(paths: list[str]) -> str:
    """A digest of the files' names, sizes and modification times."""
    h = hashlib.sha256()
    for top in sorted(paths):
        walk = [(top, [], [""])] if os.path.isfile(top) else os.walk(top)
        for root, dirs, names in walk:
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(root, name) if name else root
                st = os.stat(path)
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--python", default=sys.executable, help="whose pip configuration (default: this Python's)")
    ap.add_argument("--docker", default="docker")
    ap.add_argument("--image", default="swarmrl-pip-sources:local")
    ap.add_argument("--with-indexes", action="store_true", help="also pass file:// indexes (can be GBs)")
    args = ap.parse_args()

    cfg, needed, left_out = rewrite(pip_config(args.python), args.with_indexes)
    args.out.mkdir(parents=True, exist_ok=True)
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt") if c and os.path.isfile(c)), None)
    if ca:
        cfg["cert"] = CA_TARGET
    conf = args.out / "pip.conf"
    without_links = {k: v for k, v in cfg.items() if k != "find-links"}
    for path, values in ((conf, cfg), (args.out / "pip-index.conf", without_links)):
        path.touch(mode=0o600)
        os.chmod(path, 0o600)
        path.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(values.items())))
    image = None
    if needed:
        rel = sorted({p.lstrip("/") for p in needed})
        # Imported again only when the files changed: a new image would invalidate the build cache of every
        # install step that mounts it.
        stamp = sources_stamp(needed)
        res = subprocess.run([args.docker, "image", "inspect", "--format", '{{index .Config.Labels "swarmrl.sources"}}',
            args.image], capture_output=True, text=True)
        if res.returncode != 0 or res.stdout.strip() != stamp:
            tar = subprocess.Popen(["tar", "--numeric-owner", "-C", "/", "-c", *rel], stdout=subprocess.PIPE)
            subprocess.run([args.docker, "import", "--change", f"LABEL swarmrl.sources={stamp}",
                "--message", "swarmrl pip sources: " + " ".join(rel), "-", args.image],
                stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
            tar.stdout.close()
            if tar.wait() != 0:
                raise SystemExit(f"tar of {rel} failed")
        image = args.image
    print(json.dumps({"pip_conf": str(conf), "ca_bundle": ca, "sources_image": image, "sources": needed,
        "left_out": left_out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
