"""addnorm-serve: serve an artifact over HTTP (flags mirror the ADDNORM_* settings)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from service import logs
from service.engine import EngineError, check_artifact, default_threads, resolve_providers
from service.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="addnorm-serve",
        description="Serve an addnorm artifact (from addnorm-export) with onnxruntime over HTTP: /v1 JSON API, "
        "/v2 Open Inference Protocol, /health/*, /metrics, /docs. Every flag also reads from its ADDNORM_* "
        "environment variable (e.g. --model-dir <- ADDNORM_MODEL_DIR); flags win.",
    )
    fields = Settings.model_fields
    for name, info in fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"ADDNORM_{name.upper()}"
        kwargs: dict = {
            "dest": name,
            "default": None,
            "help": f"{info.description} [{env}, default {info.default}]",
        }
        if info.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name in ("providers", "log_level"):
            kwargs["choices"] = list(info.annotation.__args__)  # Literal[...] values
        p.add_argument(flag, **kwargs)
    return p


def settings_from_args(argv: list[str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return Settings(**overrides)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except ValueError as exc:  # pydantic ValidationError is a ValueError
        print(f"error: invalid setting: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_json)
    log = logging.getLogger("addnorm.serve")
    try:
        # Fail before binding a port: a missing or tampered artifact, or cuda asked for but absent.
        import onnxruntime as ort

        manifest = check_artifact(settings.model_dir)
        resolve_providers(settings.providers, ort.get_available_providers())
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if settings.workers > 1 and settings.intra_op_threads == 0:
        # Several processes each with all-core thread pools oversubscribe the CPU: split the cores.
        settings = settings.model_copy(update={"intra_op_threads": default_threads(settings.workers)})
    log.info(
        "serving %s from %s on http://%s:%d", manifest.name, settings.model_dir, settings.host, settings.port
    )

    import uvicorn

    uv_log = "warning" if settings.log_level == "info" else settings.log_level
    if settings.workers > 1:
        # Workers are separate processes: pass the settings down through the environment.
        for name, value in settings.model_dump().items():
            os.environ[f"ADDNORM_{name.upper()}"] = str(value)
        uvicorn.run(
            "service.app:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_config=None,
            log_level=uv_log,
            access_log=False,
        )
    else:
        from service.app import create_app

        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_config=None,
            log_level=uv_log,
            access_log=False,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
