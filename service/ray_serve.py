"""Ray Serve: the same FastAPI app as addnorm-serve, in N replicas that each own one onnxruntime session.

    RAY_SERVE_ENABLE_HA_PROXY=1 serve run addnorm.service.ray_serve:build artifact=artifacts/default replicas=2
    RAY_SERVE_ENABLE_HA_PROXY=1 serve run deploy/ray/serve.yaml

With the variable (the ``ray`` image sets it), HAProxy takes the port and balances over replicas that serve HTTP
themselves: 0.65-0.77x plain addnorm-serve on small requests, where Ray's Python proxy gives 0.2-0.3x
(docs/deployment.md).

Needs the ``ray`` extra (``pip install '.[ray]'``). Each replica builds the app with ``create_app`` and
loads its model (sha256 check, golden check, batcher) before its start-up ends, so Ray routes no request to a
replica whose model is not loaded, and a replica that cannot read the artifact fails to start, saying why. Ray's
health check asks the app's readiness. Settings reach replicas as the usual ``ADDNORM_*`` variables (the Serve
config's ``runtime_env``) and as the builder's arguments, which win.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from addnorm.model.artifact import MANIFEST_FILE
from addnorm.service import logs
from addnorm.service.front.app import create_app
from addnorm.service.models.registry import artifact_dirs
from addnorm.service.settings import Settings, explain

log = logging.getLogger("addnorm.ray")

DEPLOYMENT = "addnorm"
# Requests one replica takes at once: enough to fill a batch (Ray's default of 5 would starve the batcher).
MAX_ONGOING_REQUESTS = 64
PROXY_PORT = (
    8000  # what `serve run IMPORT_PATH` binds (Ray 2.60 has no flag or variable for it; a config does)
)
BUILD_ARGS = {
    "replicas": "replica count, or 'auto' to autoscale (1..4 replicas, 16 ongoing requests each)",
    "num_cpus": "CPUs each replica reserves; its onnxruntime threads follow it (default 1)",
    "max_ongoing_requests": f"requests one replica takes at once (default {MAX_ONGOING_REQUESTS})",
}


class ArtifactUnreadable(RuntimeError):
    """This replica's node cannot read the artifact directory."""


def check_readable(model_dir: Path) -> None:
    """Refuse to start a replica that cannot read the artifact, naming the node and the two usual fixes."""
    manifest = Path(model_dir) / MANIFEST_FILE
    try:
        with manifest.open("rb"):
            pass
    except OSError as exc:
        raise ArtifactUnreadable(
            f"addnorm replica on node {socket.gethostname()} cannot read the artifact {manifest}: "
            f"{exc.strerror or exc}. Every node that runs a replica needs the artifact at the same path: bake it "
            "into the image, or mount a shared volume there (README 'Scaling out')."
        ) from None


def replica_settings(overrides: dict[str, Any], cpus: float | None) -> Settings:
    """The replica's settings: ADDNORM_* from its environment, then the builder's arguments. The thread budget
    (service/backend/cores.py) is the CPUs Ray gave the replica, unless set explicitly. No gRPC port: replicas share
    nodes, and Ray's proxy is the one front door (HTTP)."""
    settings = Settings(**{**overrides, "grpc_port": 0})
    if cpus and settings.thread_budget == 0:  # the replica's share of the node; its models split it
        settings = settings.model_copy(update={"thread_budget": max(1, int(cpus))})
    return settings


@serve.deployment(
    name=DEPLOYMENT,
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    health_check_period_s=10,
    health_check_timeout_s=30,
)
@serve.ingress()
class AddNormReplica:
    """One replica: the addnorm FastAPI app (built in ``__serve_build_asgi_app__``) over its own session."""

    def __init__(self, overrides: dict[str, Any] | None = None) -> None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        self.settings = replica_settings(overrides or {}, cpus)
        logs.configure(self.settings.log_level, self.settings.log_json)
        for directory in artifact_dirs(self.settings):
            check_readable(directory)
        # Ray's proxy gives each request an x-request-id (the app logs it) and adds it to the answer itself: the
        # app's copy is left out, so clients see it once
        self.fastapi_app = create_app(self.settings, load_before_serving=True, answer_request_id=False)
        log.info(
            "replica starting: %s, %s onnxruntime threads",
            ", ".join(map(str, artifact_dirs(self.settings))),
            cpus,
        )

    def __serve_build_asgi_app__(self):
        return self.fastapi_app

    def check_health(self) -> None:
        """Ray's health check: the app's own readiness."""
        reason = self.fastapi_app.state.addnorm.not_ready_reason()
        if reason is not None:
            raise RuntimeError(reason)


def build(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run addnorm.service.ray_serve:build key=value ...`` and Serve config files.

    Keys: ``replicas``, ``num_cpus``, ``max_ongoing_requests``, and any addnorm setting by its field name
    (``artifact`` (comma-separated for several), ``providers``, ``max_batch_size``, ...). Relative artifact paths
    are made absolute here. A bad argument raises ValueError; under ``serve run`` it is one line on stderr and
    exit status 2 instead of Ray's traceback, and so is a proxy port another process holds.
    """
    try:
        return _build(dict(args))
    except ValueError as exc:  # pydantic's ValidationError is one
        message = (
            f"invalid setting {explain(exc, by_field=True)}" if isinstance(exc, ValidationError) else str(exc)
        )
        if _from_serve_cli():
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(2) from None
        raise ValueError(message) from None


def _from_serve_cli() -> bool:
    """Whether Ray's ``serve run`` called the builder (its process, before any cluster is started)."""
    return Path(sys.argv[0]).name == "serve" and sys.argv[1:2] == ["run"]


def _check_proxy_port() -> None:
    """``serve run`` starts a local Ray whose HTTP proxy takes 127.0.0.1:8000; when another process holds that
    port, Ray fails later with a long traceback. Checked only where ``serve run`` starts its own cluster."""
    if os.environ.get("RAY_ADDRESS") or Path("/tmp/ray/ray_current_cluster").exists():
        return  # an existing cluster: its own Serve proxy may be the one on the port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", PROXY_PORT))
        except OSError as exc:
            raise ValueError(
                f"Ray Serve's HTTP proxy needs 127.0.0.1:{PROXY_PORT}, which is taken ({exc.strerror}); serve "
                "another port from a Serve config (deploy/ray/serve.yaml: http_options.port) with serve run "
                "CONFIG, or stop what holds it"
            ) from None


def _build(args: dict[str, Any]) -> Application:
    replicas = str(args.pop("replicas", 1))
    num_cpus = float(args.pop("num_cpus", 1))
    max_ongoing = int(args.pop("max_ongoing_requests", MAX_ONGOING_REQUESTS))
    unknown = sorted(set(args) - set(Settings.model_fields))
    if unknown:
        guesses = {u: difflib.get_close_matches(u, [*BUILD_ARGS, *Settings.model_fields], 1) for u in unknown}
        named = ", ".join(f"{u!r}" + (f" (did you mean {g[0]!r}?)" if g else "") for u, g in guesses.items())
        raise ValueError(
            f"unknown argument {named} for addnorm.service.ray_serve:build; it takes {', '.join(BUILD_ARGS)} and any "
            "addnorm setting by its field name (addnorm-serve --help lists them: --max-batch-size is max_batch_size)"
        )
    for key in ("artifact", "model_repository"):
        if key in args:
            paths = str(args[key]).split(",") if key == "artifact" else [str(args[key])]
            args[key] = ",".join(str(Path(p.strip()).expanduser().resolve()) for p in paths if p.strip())
    Settings(**args)  # a bad value fails here, on the driver, not in every replica
    if _from_serve_cli() and not sys.argv[2:3][0].endswith((".yaml", ".yml")):  # a config sets its own port
        _check_proxy_port()
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus},
        "max_ongoing_requests": max_ongoing,
    }
    if replicas == "auto":
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    else:
        options["num_replicas"] = int(replicas)
    return AddNormReplica.options(**options).bind(args)
