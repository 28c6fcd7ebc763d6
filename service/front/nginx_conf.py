"""The front proxy's configuration: nginx in front of addnorm-serve, for deployments facing the internet.

addnorm-serve is safe on its own (its connection, ``front/http11.py``, holds the head, idle and send deadlines, the
head's size, trailer fields, pipelining and the connection cap; the app's front, ``front/middleware.py``, each body's
time and size). nginx in front adds defence in depth: TLS termination where a deployment wants it, only the header
fields the app reads passed on, an answer buffered for a slow client so the server's memory is free at once, and
limits a proxy tier enforces before a request costs the server anything. This module writes its configuration from
the same ``ADDNORM_*`` settings the server reads, so the two agree on every limit. ``deploy/nginx/nginx.conf`` is its
output for an upstream named ``api`` (``tests/test_front_proxy.py`` keeps it current); docs/reliability.md says
which protection lives where.

``python -m addnorm.service.front.nginx_conf --listen 0.0.0.0:8080 --upstream 127.0.0.1:8000 > nginx.conf``
"""

from __future__ import annotations

import math
import sys

import orjson

from addnorm.commands import Parser
from addnorm.service.front.http11 import MAX_HEAD_BYTES, MAX_TARGET_BYTES, REFUSALS
from addnorm.service.settings import Settings

# nginx's own refusals answer with the messages addnorm-serve's connection uses (front/http11.py: one table), and
# its head limits are the same: large_client_header_buffers 4 x 16 KiB after the 8 KiB first buffer.
HEAD_BUFFERS = (4, MAX_TARGET_BYTES // 1024)
assert (8 + HEAD_BUFFERS[0] * HEAD_BUFFERS[1]) * 1024 == MAX_HEAD_BYTES


def _seconds(value: float) -> str:
    """nginx's time unit for a setting in seconds (milliseconds, rounded up: nginx takes whole units)."""
    return f"{max(1, math.ceil(value * 1000))}ms"


# The header fields the app reads: those every request may carry, and each protocol's (its schema's, which the
# OpenAPI document lists and tests/service/test_schemas.py holds the codecs to). Only these are passed on, each
# checked for control characters first: nginx passes a field as it came, and uvicorn's parser refuses a control
# character in plain text.
COMMON_HEADERS = (
    "accept",
    "authorization",
    "content-encoding",
    "content-type",
    "x-request-id",
    "traceparent",
    "tracestate",
)


def passed_headers() -> tuple[str, ...]:
    from addnorm.service.protocols.v1 import schema as v1
    from addnorm.service.protocols.v2 import schema as v2

    return tuple(dict.fromkeys([*COMMON_HEADERS, *sorted(v1.HEADERS | v2.HEADERS)]))


def _variable(header: str) -> str:
    return "$http_" + header.replace("-", "_")


def _status(code: int) -> int:
    """What a client is answered for one of nginx's refusals: 494 is 431, an unknown transfer coding's 501 and an
    HTTP version's 505 are 400s (every bad request is a 4xx here)."""
    return {494: 431, 501: 400, 505: 400}.get(code, code)


def _quoted(message: str) -> str:
    """The JSON error body as the inside of an nginx single-quoted string."""
    return orjson.dumps({"error": message}).decode().replace("\\", "\\\\").replace("'", "\\'")


def render(settings: Settings, listen: str, upstream: str, prefix: str | None = None) -> str:
    """A whole nginx.conf: listen on ``listen`` (``host:port`` or a port), proxy to ``upstream`` (``host:port``).
    ``prefix``: a directory for the pid file and nginx's temporary files (a process run by an unprivileged user
    or a test); None keeps nginx's own."""
    # Each page by its URI, not a named location: nginx cannot redirect a request line it could not parse to one.
    pages = "\n".join(f"        error_page {code} ={_status(code)} /.addnorm/{code};" for code in REFUSALS)
    locations = "\n".join(
        f"        location = /.addnorm/{code} {{\n"
        f"            internal;\n"
        f"            default_type application/json;\n"
        f"            return {_status(code)} '{_quoted(text)}';\n"
        f"        }}"
        for code, text in REFUSALS.items()
    )
    paths = ""
    if prefix is not None:
        paths = "\n".join(
            f"    {key}_temp_path {prefix}/{key};"
            for key in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
    pid = f"pid {prefix}/nginx.pid;" if prefix is not None else ""
    headers = passed_headers()
    forwarded = "\n".join(f"            proxy_set_header {h} {_variable(h)};" for h in headers)
    every_value = "".join(_variable(h) for h in headers)
    # nginx's connections to the app: kept alive (a pool of idle ones) and together never over the app's own cap
    # (ADDNORM_MAX_CONNECTIONS, uvicorn's limit_concurrency), so every refusal at the limit is nginx's JSON one.
    pool = max(1, min(32, settings.max_connections // 2))
    active = max(1, settings.max_connections - pool - 1)  # uvicorn refuses at its cap, not past it
    return f"""# addnorm's front proxy (service/front/nginx_conf.py wrote this from the ADDNORM_* settings; docs/reliability.md).
worker_processes 1;
{pid}
error_log stderr warn;

events {{
    worker_connections {settings.max_connections + 64};
}}

http {{
    access_log off;
    server_tokens off;
{paths}
    # A request's head within ADDNORM_HEADER_TIMEOUT_S (else the connection closes), at most
    # {MAX_HEAD_BYTES // 1024} KiB in all and {HEAD_BUFFERS[1]} KiB a line (else 431).
    client_header_timeout {_seconds(settings.header_timeout_s)};
    client_header_buffer_size 8k;
    large_client_header_buffers {HEAD_BUFFERS[0]} {HEAD_BUFFERS[1]}k;
    # A body read whole before the app sees it (trailer fields are not passed on), at most ADDNORM_MAX_BODY_BYTES
    # (else 413), with at most ADDNORM_BODY_TIMEOUT_S between two of its reads (else 408).
    client_max_body_size {settings.max_body_bytes};
    client_body_timeout {_seconds(settings.body_timeout_s)};
    client_body_buffer_size 1m;
    # A client that reads nothing of its answer for ADDNORM_SEND_TIMEOUT_S is disconnected. An answer waits for
    # its client in memory, up to ADDNORM_MAX_ANSWER_BUFFER_BYTES a connection (never on disk); beyond them nginx
    # reads the server only as fast as the client reads.
    send_timeout {_seconds(settings.send_timeout_s)};
    proxy_buffer_size 64k;
    proxy_buffers {max(2, settings.max_answer_buffer_bytes // 65536)} 64k;
    proxy_busy_buffers_size 128k;
    proxy_max_temp_file_size 0;
    keepalive_timeout {_seconds(settings.keep_alive_s)};
    # Requests being answered at once, beyond which 503 (the server behind allows ADDNORM_MAX_CONNECTIONS).
    limit_conn_zone $server_port zone=addnorm_connections:1m;
    limit_conn_status 503;
    ignore_invalid_headers on;
    underscores_in_headers off;
    # A method HTTP does not define (a JSON 405), a request target of anything but visible ASCII (RFC 9112 3.2), or
    # a control character other than a tab in a passed header field (a JSON 400): refused here, as uvicorn's parser
    # would refuse each in plain text.
    map $request_method $addnorm_bad_method {{
        "~^(GET|HEAD|POST|PUT|DELETE|OPTIONS|PATCH)$" 0;
        default 1;
    }}
    map $request_uri $addnorm_bad_target {{
        "~[^\\x21-\\x7e]" 1;
        default 0;
    }}
    map "{every_value}" $addnorm_bad_field {{
        "~[\\x00-\\x08\\x0a-\\x1f\\x7f]" 1;
        default 0;
    }}

    # An idle connection to the app is kept for half the app's own idle time (ADDNORM_KEEP_ALIVE_S; nginx's default
    # is 60 s): a request sent on one the app is closing as idle fails with a 502, which nginx never resends for a POST.
    upstream addnorm {{
        server {upstream};
        keepalive {pool};
        keepalive_timeout {_seconds(settings.keep_alive_s / 2)};
    }}

    server {{
        listen {listen};
        limit_conn addnorm_connections {active};
{pages}

        location / {{
            if ($addnorm_bad_method) {{
                return 405;
            }}
            if ($addnorm_bad_target) {{
                return 400;
            }}
            if ($addnorm_bad_field) {{
                return 400;
            }}
            proxy_pass http://addnorm;
            proxy_http_version 1.1;
            proxy_pass_request_headers off;  # only the fields the app reads (passed_headers)
            proxy_set_header Host $host;
            proxy_set_header Connection "";  # keep-alive to the app; never an Upgrade
{forwarded}
            proxy_request_buffering on;
            proxy_buffering on;
            proxy_read_timeout {_seconds(settings.request_timeout_s + 30)};
            proxy_send_timeout {_seconds(settings.body_timeout_s)};
        }}
{locations}
    }}
}}
"""


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m addnorm.service.front.nginx_conf",
        description="Print an nginx.conf for the front proxy, from the ADDNORM_* settings (docs/reliability.md).",
    )
    parser.add_argument(
        "--listen", default="8080", help="where nginx listens: PORT or HOST:PORT (default: 8080)"
    )
    parser.add_argument(
        "--upstream", default="127.0.0.1:8000", help="addnorm-serve's HOST:PORT (default: 127.0.0.1:8000)"
    )
    parser.add_argument("--prefix", default=None, help="directory for the pid file and temporary files")
    args = parser.parse_args(argv)
    sys.stdout.write(render(Settings(), args.listen, args.upstream, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
