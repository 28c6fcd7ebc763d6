"""``python /app/healthcheck.py [PORT]`` in the images: exit 0 when the server on this host answers /health/ready
with 200.

The containers' healthcheck (Dockerfile, docker-compose.yml), copied into each serving image beside the package,
not part of it: the port is the argument, else ``ADDNORM_PORT``, else 8000, so moving the server's port moves its
healthcheck with it. Standard library only (it runs every 10 s); 3 s at most.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    port = args[0] if args else os.environ.get("ADDNORM_PORT", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=3) as answer:
            return 0 if answer.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"not ready on port {port}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
