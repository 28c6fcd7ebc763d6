#!/bin/sh
# make images: the Dockerfile's images built with podman, from a base made of Debian's packages (no image
# registry needed: deploy/docker/base-image.sh), tagged as docker-compose.yml names them.
#
#   deploy/docker/images.sh [TARGET ...]     (default: api proxy ray export; run as root)
#
# PYTHON_IMAGE: the base (default localhost/addnorm-python:3.11-bookworm, made when missing). CA_BUNDLE: the CA
# bundle pip trusts in the build container (default PIP_CERT, else SSL_CERT_FILE, else the host's own
# /etc/ssl/certs/ca-certificates.crt: behind a TLS-intercepting proxy its CA is there); its folder is mounted
# read-only for the build only; CA_BUNDLE= (empty) leaves pip its own. TORCH_WHEELS: a folder holding
# torch's CPU wheel for the export image (default: /opt/wheels where one lies there; else the image takes it from
# download.pytorch.org's CPU index). The podman flags are the ones a VM without CAP_SYS_RESOURCE and with hybrid
# cgroups needs (runc, cgroupfs, explicit ulimits); PODMAN overrides them.
set -eu

cd "$(dirname "$0")/../.."
PODMAN=${PODMAN:-podman --runtime runc --cgroup-manager cgroupfs}
PYTHON_IMAGE=${PYTHON_IMAGE:-localhost/addnorm-python:3.11-bookworm}
if [ -z "${CA_BUNDLE+set}" ]; then
    CA_BUNDLE=${PIP_CERT:-${SSL_CERT_FILE:-}}
    [ -n "$CA_BUNDLE" ] || [ ! -r /etc/ssl/certs/ca-certificates.crt ] || CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
fi
if [ -z "${TORCH_WHEELS+set}" ]; then
    TORCH_WHEELS=""
    for wheel in /opt/wheels/torch-2.13.0+cpu-*.whl; do [ -e "$wheel" ] && TORCH_WHEELS=/opt/wheels; done
fi
[ $# -gt 0 ] || set -- api proxy ray export

command -v podman >/dev/null || { echo "images.sh: podman is not installed (apt-get install podman)" >&2; exit 1; }
$PODMAN image exists "$PYTHON_IMAGE" || deploy/docker/base-image.sh "$PYTHON_IMAGE"

for target in "$@"; do
    set -- --format docker --network host --ulimit nofile=1024:4096 --ulimit nproc=1024:4096 \
        --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --target "$target" -t "localhost/addnorm-$target:latest"
    if [ -n "$CA_BUNDLE" ]; then
        set -- "$@" -v "$(dirname "$CA_BUNDLE"):/etc/ssl/build-ca:ro" --build-arg "PIP_CERT=/etc/ssl/build-ca/$(basename "$CA_BUNDLE")"
    fi
    if [ "$target" = export ] && [ -n "$TORCH_WHEELS" ]; then
        set -- "$@" -v "$TORCH_WHEELS:/wheels:ro" --build-arg TORCH_INDEX= --build-arg PIP_FIND_LINKS=/wheels
    fi
    start=$(date +%s)
    $PODMAN build "$@" .
    echo "built localhost/addnorm-$target:latest in $(($(date +%s) - start)) s:" \
         "$($PODMAN image inspect --format '{{.Size}}' "localhost/addnorm-$target:latest") bytes"
done
