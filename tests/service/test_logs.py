"""The log writer thread: lines written in order, and a stderr that fails does not stop it."""

import io
import logging
import sys

from addnorm.service import logs


def test_the_writer_survives_a_closed_stderr_and_keeps_order(monkeypatch, capsys):
    logs.configure("info")  # stops the previous writer: what earlier tests queued is written out by now
    capsys.readouterr()  # ... and dropped here (CI once caught an earlier test's access line in this capture)
    monkeypatch.setattr(logging.getLogger("addnorm"), "propagate", False)
    log = logging.getLogger("addnorm.test")
    try:
        closed = io.StringIO()
        closed.close()
        monkeypatch.setattr(sys, "stderr", closed)
        log.info("lost")
        logs.access("%s %d", "lost too", 1)
        logs.flush()  # returns: the failed write did not stop the thread
        monkeypatch.undo()
        monkeypatch.setattr(logging.getLogger("addnorm"), "propagate", False)
        for i in range(50):
            log.info("line %d", i)
            logs.access("access %d", i)
        logs.flush()
        err = capsys.readouterr().err
    finally:
        logs.configure("warning")
    ours = [line.rsplit(" ", 2)[-2:] for line in err.splitlines() if " addnorm." in line]
    # not a line from a server thread another test left behind
    ours = [pair for pair in ours if pair[0] in ("line", "access")]
    assert ours == [pair for i in range(50) for pair in (["line", str(i)], ["access", str(i)])]
    assert "lost" not in err


def test_a_client_cannot_forge_log_lines_or_flood_them(tiny_artifact, monkeypatch, capsys):
    """A CR LF (or an escape sequence) in a URL reaches the log escaped, on the request's one line; a long path is
    cut. Found by the hardening review (issue 24): the access line wrote the decoded path as it was."""
    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from addnorm.service.settings import Settings

    logs.configure("info")
    capsys.readouterr()
    monkeypatch.setattr(logging.getLogger("addnorm"), "propagate", False)
    try:
        with TestClient(
            create_app(Settings(artifact=tiny_artifact)), raise_server_exceptions=False
        ) as client:
            client.get("/nowhere%0d%0a2026-01-01 00:00:00,000 INFO addnorm.access [x] GET /admin 200%1b[31m")
            client.get("/" + "a" * 5000)
        logs.flush()
        err = capsys.readouterr().err
    finally:
        logs.configure("warning")
    lines = [line for line in err.splitlines() if "addnorm.access" in line]
    forged = [line for line in lines if "/nowhere" in line]
    assert len(forged) == 1 and "\\x0d\\x0a" in forged[0] and "\\x1b" in forged[0], lines
    assert not any(line.startswith("2026-01-01") for line in err.splitlines())  # no line of the client's own
    long = next(line for line in lines if "/aaaa" in line)
    assert "...[4489 more]" in long and len(long) < 800
