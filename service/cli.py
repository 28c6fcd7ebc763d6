"""addnorm-serve: serve an artifact over HTTP (flags mirror the ADDNORM_* settings)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import typing

from pydantic import ValidationError

from addnorm.commands import Parser, readable
from addnorm.model import kernels
from addnorm.service import logs
from addnorm.service.backend.engine import EngineError, check_artifact, freeze_heap, resolve_providers
from addnorm.service.settings import Settings, explain


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="addnorm-serve",
        renamed={"'alone'": "'light'"},  # --intra-op-spinning's old value
        description="Serve an addnorm artifact (from addnorm-export) with onnxruntime over HTTP: /v1 JSON API, "
        "/v2 Open Inference Protocol, /health/*, /metrics, /docs. Every flag also reads from its ADDNORM_* "
        "environment variable (e.g. --artifact <- ADDNORM_ARTIFACT); flags win.",
    )
    fields = Settings.model_fields
    for name, info in fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"ADDNORM_{name.upper()}"
        kwargs: dict = {
            "dest": name,
            "default": None,
            "help": f"{info.description} [{env}, default {readable(info.default)}]",
        }
        if name in ("artifact", "model_repository"):
            kwargs["metavar"] = "DIR"
        if name in ("artifact", "load_model", "model_threads"):
            kwargs["action"] = "append"  # --artifact A --artifact B: two models
        elif info.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(info.annotation) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(info.annotation))
        p.add_argument(flag, **kwargs)
    return p


def settings_from_args(argv: list[str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return Settings(**overrides)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (the OS's words), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def ports_free(host: str, port: int, grpc_port: int) -> bool:
    """Whether the HTTP port and the gRPC port (0: none) can be bound; says which cannot, and how to choose
    another, in one line on stderr."""
    for what, name, value, off in (
        ("HTTP", "port", port, ""),
        ("gRPC", "grpc_port", grpc_port, ", or 0 to turn gRPC off"),
    ):
        if value and (why := port_taken(host, value)):
            flag, env, make = f"--{name.replace('_', '-')}", f"ADDNORM_{name.upper()}", name.upper()
            print(
                f"error: cannot serve {what} on {host}:{value}: {why}. Give {flag} ({env}; under make: "
                f"make serve {make}=N) another port{off}",
                file=sys.stderr,
            )
            return False
    return True


_SERVING: list = []  # the app being served, whose state says whether it stopped itself (ServiceState.fatal)


def _drained(signum: int, frame: object) -> None:
    """SIGTERM outside uvicorn's own handler: before serving began, or after it drained. Exit 0, or 1 when the
    app stopped itself because no model could be served."""
    if _SERVING and _SERVING[0].state.addnorm.fatal:
        raise SystemExit(1)
    logging.getLogger("addnorm.serve").info("stopped by SIGTERM")
    raise SystemExit(0)


def _run(app: typing.Any, **options: typing.Any) -> bool:
    """uvicorn.run for one process, whose shutdown (SIGTERM) first tells every model's batcher that no more
    requests will come: what waits for company (--max-queue-delay-ms) runs at once instead of after its wait, while
    uvicorn waits for the requests in flight. Whether the server started."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            known = app.state.addnorm.known
            for model in known.models if known is not None else ():
                model.batcher.drain()
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, **options))
    freeze_heap()  # the app is built; the models load once it serves
    server.run()
    return server.started


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except ValidationError as exc:
        print(f"error: invalid setting {explain(exc)}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_json)
    log = logging.getLogger("addnorm.serve")
    try:
        keys = settings.api_keys()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not keys and not is_loopback(settings.host):
        log.warning(
            "SERVING ON %s WITHOUT AN API KEY: anyone who can reach this port can run the model and read "
            "/metrics. Set ADDNORM_API_KEY or ADDNORM_API_KEY_FILE (--api-key / --api-key-file).",
            settings.host,
        )
    try:
        # Fail before binding a port: a missing or tampered artifact, two models of one name, or cuda asked for
        # but absent.
        import onnxruntime as ort

        from addnorm.service.models.registry import read_manifests

        if settings.model_control_mode != "none" and settings.workers > 1:
            raise ValueError("model control loads models in one process: use --workers 1 with it")
        if settings.model_control_mode != "none" and settings.model_repository is None:
            raise ValueError(
                f"--model-control-mode {settings.model_control_mode} loads models from a repository: give "
                "--model-repository DIR"
            )
        slots = read_manifests(settings)
        for slot in slots:  # with model control on, each load verifies its model itself
            if settings.model_control_mode == "none":
                check_artifact(slot.directory)
        resolve_providers(settings.providers, ort.get_available_providers())
        kernels.find(settings.kernels)
    except (EngineError, ValueError, kernels.KernelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # Both ports before any model loads: one line, not a bind error after the load.
    if not ports_free(settings.host, settings.port, settings.grpc_port if settings.workers == 1 else 0):
        return 1
    for slot in slots:
        log.info("model %s from %s", slot.name, slot.directory)
    grpc = f", gRPC on {settings.host}:{settings.grpc_port}" if settings.grpc_port else ""
    log.info("serving on http://%s:%d%s", settings.host, settings.port, grpc)

    import uvicorn

    # uvicorn drains the requests in flight on SIGTERM, then raises the signal again once it has restored the
    # handler it found: with this one in place, a drained server exits 0 instead of dying of the signal (-15).
    signal.signal(signal.SIGTERM, _drained)
    uv_log = "warning" if settings.log_level == "info" else settings.log_level
    # uvicorn runs the server (lifespan, signals, graceful shutdown, workers) with its documented options, and its
    # `http` option takes addnorm's own HTTP/1.1 connection (service/front/http11.py), which holds every
    # protection a connection needs (the head's deadline and size, idle and send deadlines, trailer fields that
    # never reach the app, pipelined answers before a refusal, unread answers bounded, the connection cap: JSON
    # refusals). The front proxy (deploy/nginx) adds to them; docs/reliability.md says which lives where.
    common = dict(
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=uv_log,
        access_log=False,
        http="addnorm.service.front.http11:Http11",
        ws="none",
        timeout_keep_alive=settings.keep_alive_s,
        # No X-Forwarded-For rewriting: nothing here reads the client's address, and it is one more layer per
        # request (the request path's CPU: docs/benchmarks.md).
        proxy_headers=False,
    )
    if settings.workers > 1:
        # Workers are separate processes: pass the settings down through the environment.
        os.environ.update(settings.to_env())
        uvicorn.run(
            "addnorm.service.front.app:create_app",
            factory=True,
            workers=settings.workers,
            **common,
        )
    else:
        from addnorm.service.front.app import create_app

        app = create_app(settings, exit_on_error=True)
        _SERVING.append(app)
        started = _run(app, **common)
        if not started:  # as uvicorn.run: it did not start (the log says why)
            return 3
        if app.state.addnorm.fatal:
            return 1
    return 0


if __name__ == "__main__":
    # make serve's first step: python -m addnorm.service.cli --check-ports --host H --port P --grpc-port G
    if sys.argv[1:2] == ["--check-ports"]:
        check = argparse.ArgumentParser(prog="python -m addnorm.service.cli --check-ports")
        check.add_argument("--host", default="127.0.0.1")
        check.add_argument("--port", type=int, default=8000)
        check.add_argument("--grpc-port", type=int, default=8001)
        ports = check.parse_args(sys.argv[2:])
        sys.exit(0 if ports_free(ports.host, ports.port, ports.grpc_port) else 1)
    sys.exit(main())
