#!/usr/bin/env bash
# Make a local base image from Debian packages, for machines that reach no image registry (so that
# `python:3.11-slim` cannot be pulled): debootstrap a minimal Debian root file system with Python, then
# `docker import` it. The Dockerfiles take it as `--build-arg BASE_IMAGE=swarmrl-base:bookworm`.
#
#   deploy/docker/make-base-image.sh [IMAGE] [SUITE] [MIRROR]
#   defaults: swarmrl-base:bookworm  bookworm  http://deb.debian.org/debian
#
# Needs root, debootstrap and a running Docker daemon (DOCKER=... picks the client). Like the official
# python image it has python3, venv and pip, and apt works inside it (the Dockerfiles install libnuma1 etc.).
# Debian bookworm's python3 is 3.11, the version of python:3.11-slim. Takes ~2 minutes.
set -euo pipefail

IMAGE=${1:-swarmrl-base:bookworm}
SUITE=${2:-bookworm}
MIRROR=${3:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}

[ "$(id -u)" = 0 ] || { echo "make-base-image.sh: needs root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make-base-image.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

ROOT=$(mktemp -d /var/tmp/swarmrl-base.XXXXXX)
trap 'rm -rf --one-file-system "$ROOT"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates "$SUITE" "$ROOT" "$MIRROR"

# As in Debian's own docker images: no apt caches, no package lists, no docs in the image; `python` is python3
# (the Dockerfiles run `python -c ...`, as python:3.11-slim allows).
cat > "$ROOT/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOF
printf 'Acquire::Languages "none";\n' > "$ROOT/etc/apt/apt.conf.d/docker-no-languages"
ln -sf python3 "$ROOT/usr/bin/python"
# python:3.11-slim's pip installs into the system; Debian's marks its Python "externally managed" (PEP 668).
# Images install into that Python as the official image does, so drop the marker.
rm -f "$ROOT"/usr/lib/python3*/EXTERNALLY-MANAGED
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* \
    "$ROOT"/usr/share/locale/* "$ROOT"/tmp/* "$ROOT"/var/log/*.log
# The host's name resolution, if debootstrap copied it, must not stay in the image (Docker mounts its own).
: > "$ROOT/etc/resolv.conf"
: > "$ROOT/etc/hostname"

tar --numeric-owner -C "$ROOT" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $SUITE from $MIRROR" \
    - "$IMAGE"
"$DOCKER" run --rm "$IMAGE" python -c 'import sys, venv, pip; print("base image:", sys.version.split()[0])'
