#!/bin/sh
# A Python base image from Debian's packages alone, for the Dockerfile's PYTHON_IMAGE where no image registry is
# reachable (no python:3.11-slim to pull): debootstrap's minimal bookworm with python3 and a virtual environment
# at /opt/venv on PATH (Debian's own python3 refuses pip installs outside one: PEP 668), imported into podman.
#
#   deploy/docker/base-image.sh [IMAGE]      (default localhost/addnorm-python:3.11-bookworm; run as root)
#
# The mirror is the machine's own (/etc/apt/sources.list.d/debian.sources), else deb.debian.org; DEBIAN_MIRROR
# overrides it. `make images` runs this when the image is missing.
set -eu

IMAGE=${1:-localhost/addnorm-python:3.11-bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
SOURCES=/etc/apt/sources.list.d/debian.sources
if [ -z "${DEBIAN_MIRROR:-}" ] && [ -r "$SOURCES" ]; then
    DEBIAN_MIRROR=$(awk '$1 == "URIs:" { print $2; exit }' "$SOURCES")
fi
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

for tool in debootstrap podman; do
    command -v "$tool" >/dev/null || { echo "base-image.sh: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done

ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT INT TERM
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOT" "$MIRROR"
chroot "$ROOT" python3 -m venv /opt/venv
# what an image does not need: downloaded packages, package lists, documentation, translations
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/* "$ROOT"/usr/share/info/*
tar -C "$ROOT" -c . | podman import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python"]' \
    - "$IMAGE"
podman image inspect --format '{{.Id}} {{.Size}}' "$IMAGE"
