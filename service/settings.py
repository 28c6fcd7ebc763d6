"""Service settings: ADDNORM_* environment variables (pydantic-settings), mirrored by addnorm-serve's flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from addnorm.commands import DEFAULT_ARTIFACT, providers_help
from addnorm.model.runtime import SETTINGS as PROVIDER_SETTINGS

# Variables a deployment may still set under an old name: refused with the new one, never silently ignored.
RENAMED_VARIABLES = {"ADDNORM_MODEL_DIR": "ADDNORM_ARTIFACT"}


class Settings(BaseSettings):
    """Every field reads from ``ADDNORM_<FIELD>`` (e.g. ``ADDNORM_ARTIFACT``); flags of addnorm-serve win."""

    model_config = SettingsConfigDict(env_prefix="ADDNORM_", extra="ignore", protected_namespaces=())

    artifact: Annotated[tuple[Path, ...], NoDecode] = Field(
        (),
        description="artifact directory (manifest.json, model.onnx); give it more than once (the variable: "
        f"comma-separated) to serve several models, the first being the default [{DEFAULT_ARTIFACT} when "
        "neither this nor --model-repository is given]",
    )
    model_repository: Path | None = Field(
        None, description="serve every artifact directory in this directory (after any --artifact)"
    )
    follow_symlinks: bool = Field(
        False,
        description="serve a repository entry that is a symbolic link to a directory outside the repository "
        "(skipped, with a warning, by default)",
    )
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none",
        description="model control (Triton's): none = the models given are loaded at start and fixed (a server "
        "with none loadable exits); explicit = POST /v2/repository/models/NAME/load and /unload (gRPC "
        "RepositoryModelLoad/Unload) load and unload the repository's models, --load-model ones at start; poll = "
        "the repository is watched and new, changed and removed models follow. A new version is verified beside "
        "the old one and takes traffic only once it passes",
    )
    load_model: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="in explicit mode, a model of the repository to load at start; give it more than once (the "
        "variable: comma-separated), or * for all [none: the server starts with no model loaded]",
    )
    repository_poll_secs: float = Field(
        5.0, gt=0, description="in poll mode, how often the repository is read for changes, in seconds"
    )
    live_parity_rate: float = Field(
        0.01,
        ge=0,
        le=1,
        description="live parity: the fraction of answered requests recomputed in float64 (numpy, off the request "
        "path) and judged by the parity rule; 0 = off",
    )
    live_parity_budget: float = Field(
        0.02,
        gt=0,
        le=1,
        description="live parity: the most CPU share (of one core) its checker thread may take",
    )
    live_parity_action: Literal["warn", "unready"] = Field(
        "warn",
        description="live parity: on failures, warn (log, metrics) or mark the model unready after "
        "--live-parity-failures failures within --live-parity-window-s",
    )
    live_parity_failures: int = Field(3, ge=1, description="live parity: failures that make a model unready")
    live_parity_window_s: float = Field(
        60.0, gt=0, description="live parity: the window those failures count in"
    )
    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="gRPC port (the Open Inference Protocol's GRPCInferenceService, for tritonclient.grpc); "
        "0 = no gRPC",
    )
    providers: Literal[PROVIDER_SETTINGS] = Field("auto", description=providers_help())
    kernels: str = Field(
        "auto",
        description="int8's operators on the CPU provider: auto (the kernel library python -m addnorm.model.kernels built, "
        "when there and the CPU has AVX2 and FMA; else onnxruntime's standard operators), off, or the library's path",
    )
    intra_op_threads: int = Field(
        0,
        ge=0,
        description="onnxruntime intra-op threads of each model; 0 = an equal share of the thread budget",
    )
    intra_op_spinning: Literal["light", "off", "in-run"] = Field(
        "light",
        description="what onnxruntime's intra-op threads do between a run's parallel sections: light, spin only in "
        "a run at light load (light from 8 requests waiting on the model down, the run's own included, heavy again "
        "only above 16: a lone client's sentence ~1 ms sooner on 2 cores, 2 to 16 clients' 1.03-1.16x a second), on a "
        "second session of the same graph (its own copy of the weights, CPU only), and sleep in the others; off, "
        "always sleep (with --parallel-runs off, one session: the least memory); in-run, spin within every run and stop when it ends (small "
        "requests up to a tenth fewer a second at 32 clients on some 2-core CPUs: docs/benchmarks.md)",
    )
    parallel_runs: Literal["on", "off"] = Field(
        "on",
        description="on: a model runs one batch per intra-op thread at once, each on one thread (a session of one "
        "thread: its own copy of the weights), so that no run waits at a parallel section's barrier for a thread the "
        "HTTP front took; a light run (light load, --intra-op-spinning's bounds, and no other request queued: a lone "
        "client's) has every thread, alone (2 cores, all-MiniLM-L6-v2: 1.16-1.37x a second at 32 clients, 1.12x at "
        "8: docs/benchmarks.md); CPU only, with 2 threads or more; off, one run at a time on all the model's threads",
    )
    thread_budget: int = Field(
        0,
        ge=0,
        description="CPU threads the models share: each gets an equal share (or its --model-threads), and a run "
        "holds its model's threads while it runs, so models never oversubscribe the cores; 0 = physical cores / "
        "workers",
    )
    model_threads: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="a model's own intra-op threads, NAME=N (repeatable; the variable: comma-separated), e.g. "
        "a=1,b=1 to run two models side by side on one core each",
    )
    workers: int = Field(1, ge=1, description="uvicorn worker processes (each loads its own session)")
    max_elements: int = Field(8 * 512 * 768, gt=0, description="largest accepted request, in tensor elements")
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0, description="largest accepted request body, in bytes")
    max_batch_size: int = Field(
        32, ge=1, description="dynamic batching: most requests merged into one run; 1 = off"
    )
    max_batch_tokens: int = Field(
        8192, ge=1, description="dynamic batching: most batch x seq positions per run"
    )
    express_tokens: int = Field(
        256,
        ge=0,
        description="the express lane: small requests (at most this many batch x seq positions a run) run beside "
        "a bigger request's run once its lane has held it 50 ms (its wait for the cores included), so that one long "
        "run never holds them up; 0 = off",
    )
    max_client_batch_size: int = Field(
        512,
        ge=1,
        description="text and token-id inputs (/v1/embeddings, /embed, V2 text): most inputs in one request (TEI's "
        "name); more get 413. A request's inputs run in length-sorted parts of at most ADDNORM_MAX_BATCH_TOKENS",
    )
    auto_truncate: bool = Field(
        True,
        description="text inputs longer than the model's max_length are cut to it where the request does not say "
        "(TEI's --auto-truncate, on by default as in TEI); --no-auto-truncate refuses them with 413 instead. A "
        "request's own truncate field wins either way",
    )
    default_prompt_name: str | None = Field(
        None,
        description="the model's prompt (config_sentence_transformers.json's prompts, by name) put before every text "
        "whose request names none (TEI's --default-prompt-name); a model without that prompt keeps its own default",
    )
    default_prompt: str | None = Field(
        None,
        description="a text put before every text whose request names no prompt (TEI's --default-prompt); not with "
        "--default-prompt-name",
    )
    max_batch_attention: int = Field(
        3 * 12 * 4096 * 4096,
        ge=1,
        description="most elements of seq x seq tensors one run may hold (batch x heads x seq^2 x the copies the "
        "artifact's attention form holds: 3 decomposed, 1 onnx, 1 mha with padding, 0 mha without); a request "
        "needing more gets 413 (by default one 4096-long sequence of a decomposed graph at 12 heads)",
    )
    merge_lengths: Literal["cost", "pad"] = Field(
        "cost",
        description="dynamic batching of requests of different lengths: cost = the queue in the runs that cost "
        "least in all, a run's fixed cost (measured at load) plus its padded positions; pad = merge whatever "
        "fits, padding every request to the longest",
    )
    max_queue_delay_ms: float = Field(
        0.0,
        ge=0,
        description="dynamic batching: extra wait for more requests; 0 = merge what queued while busy",
    )
    max_queue_size: int = Field(
        256, ge=1, description="requests waiting beyond this get 429 with Retry-After"
    )
    max_queue_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="bytes of queued request tensors beyond which requests get 429"
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="HTTP connections (or requests in flight) beyond this get 503, per worker; gRPC calls beyond it "
        "wait",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="an HTTP request's head must be complete within this time of its first byte, else 408 and the "
        "connection closes (a gRPC connection's handshake likewise)",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request's body must arrive within this time of its start, else 408 and the connection closes "
        "(a gRPC message: else DEADLINE_EXCEEDED)",
    )
    keep_alive_s: float = Field(
        5.0,
        gt=0,
        description="a new or kept-alive HTTP connection that sends nothing for this long is closed",
    )
    send_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a client that reads nothing of its answer for this long is disconnected (a connection holds "
        "one unread answer at most: its next pipelined request waits)",
    )
    max_unread_bytes: int = Field(
        256 * 1024 * 1024,
        ge=65536,
        description="answer bytes held for clients that do not read them, all connections together; past it, the "
        "connection holding the most is closed",
    )
    max_answer_buffer_bytes: int = Field(
        8 * 1024 * 1024,
        ge=65536,
        description="answer bytes the front proxy (deploy/nginx) holds for one slow client, in memory; beyond them "
        "it reads the server only as fast as the client reads (at most this x ADDNORM_MAX_CONNECTIONS in all)",
    )
    request_timeout_s: float = Field(30.0, gt=0, description="a request not answered in this time gets 504")
    verify_on_load: Literal["strict", "warn", "off"] = Field(
        "strict",
        description="run the artifact's golden inputs at load on this server's provider: strict refuses to become "
        "ready when they fail, warn serves and reports, off skips",
    )
    api_key: SecretStr | None = Field(
        None,
        description="API key(s), comma-separated: every route but the health probes then needs "
        "'Authorization: Bearer <key>'",
    )
    api_key_file: Path | None = Field(
        None, description="file with one API key a line (Docker/Kubernetes secrets); adds to --api-key"
    )
    metrics_public: bool = Field(False, description="serve /metrics without an API key")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_json: bool = Field(False, description="one JSON object per log line")
    access_log: bool = Field(
        True, description="one log line per HTTP request and gRPC call (written off the event loop)"
    )

    @field_validator("intra_op_spinning", mode="before")
    @classmethod
    def _spinning_renamed(cls, value: object) -> object:
        if value == "alone":  # its name while only a lone request's run spun
            raise ValueError(
                "'alone' is now 'light': spinning within the runs at light load, a lone one's too"
            )
        return value

    @field_validator("model_threads", mode="before")
    @classmethod
    def _model_threads(cls, value: object) -> object:
        """NAME=N items: one, a comma-separated string (the variable), or a list of either; N a positive int."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            return value
        items = tuple(n.strip() for v in value for n in str(v).split(",") if n.strip())
        for item in items:
            name, _, n = item.partition("=")
            if not name.strip() or not n.strip().isdigit() or int(n) < 1:
                raise ValueError(f"{item!r} is not NAME=N with N a positive whole number of threads")
        return items

    @field_validator("load_model", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        """One name, a comma-separated string (the environment variable), or a list of either."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            return tuple(n.strip() for v in value for n in str(v).split(",") if n.strip())
        return value

    @field_validator("artifact", mode="before")
    @classmethod
    def _paths(cls, value: object) -> object:
        """One path, a comma-separated string (the environment variable), or a list of either."""
        if isinstance(value, (str, Path)):
            value = [value]
        if isinstance(value, (list, tuple)):
            return tuple(Path(p.strip()) for v in value for p in str(v).split(",") if p.strip())
        return value

    @model_validator(mode="after")
    def _one_default_prompt(self) -> Settings:
        if self.default_prompt is not None and self.default_prompt_name is not None:
            raise ValueError("give default_prompt or default_prompt_name, not both (TEI's rule)")
        return self

    @model_validator(mode="after")
    def _no_renamed_variables(self) -> Settings:
        old = [f"{o}: renamed, set {n} instead" for o, n in RENAMED_VARIABLES.items() if o in os.environ]
        if old:
            raise ValueError("; ".join(old))
        return self

    def api_keys(self) -> tuple[str, ...]:
        """Every configured key: --api-key's comma-separated list, then the key file's lines (blank lines and
        '#' comments skipped). Raises ValueError when the file cannot be read or holds no key."""
        keys = [k.strip() for k in (self.api_key.get_secret_value() if self.api_key else "").split(",")]
        if self.api_key_file is not None:
            try:
                lines = self.api_key_file.read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"api_key_file {self.api_key_file} cannot be read: {exc.strerror}") from None
            from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not from_file:
                raise ValueError(f"api_key_file {self.api_key_file} holds no key")
            keys += from_file
        return tuple(k for k in keys if k)

    def to_env(self) -> dict[str, str]:
        """Every setting as its ADDNORM_* variable, secrets revealed (for worker processes only)."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, tuple):
                value = ",".join(str(v) for v in value)
            env[f"ADDNORM_{name.upper()}"] = str(value)
        return env


def explain(exc: ValidationError, by_field: bool = False) -> str:
    """A settings error in one line: each bad setting by its flag (``by_field``: its field name, as Ray's builder
    takes it) and variable, what is wrong, the value given (pydantic's own text is four lines a setting with a
    URL)."""
    from addnorm.service.errors import quote

    parts = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        what = error["msg"].removeprefix("Value error, ")
        key = name if by_field else f"--{name.replace('_', '-')}"
        if not name:  # a check of the settings together: no one value to show
            parts.append(what)
            continue
        what = f"{what[:1].lower()}{what[1:]}"
        parts.append(f"{key} (ADDNORM_{name.upper()}): {what}, got {quote(error.get('input'))}")
    return "; ".join(parts)
