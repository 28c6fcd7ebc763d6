"""Logging: plain or one JSON object per line, with the request id of the request being served, written by one
thread of its own (callers only enqueue)."""

from __future__ import annotations

import atexit
import contextvars
import logging
import logging.handlers
import queue
import sys
import threading
import time

import orjson

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


class _QueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread as they are: formatting and the write to stderr happen there."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class _Writer:
    """The thread that formats and writes every log line. It takes whatever is queued at once and writes it in one
    call, then waits ``INTERVAL_S`` before the next take: under load a line waits up to that long and a few
    dozen go out together, instead of one write (and one wake-up of this thread, contending for the GIL with the
    event loop) per request. Items are LogRecords, access tuples (``access``) or a ``threading.Event`` to set
    once everything queued before it is written (``flush``)."""

    INTERVAL_S = 0.05

    def __init__(self, formatter: logging.Formatter) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.formatter = formatter
        self._thread = threading.Thread(target=self._run, name="addnorm-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            items = [self.queue.get()]
            while True:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            lines, done, stop = [], [], False
            for item in items:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    done.append(item)
                else:
                    lines.append(self._line(item))
            if lines:
                _write("".join(lines))
            for event in done:
                event.set()
            if stop:
                return
            time.sleep(self.INTERVAL_S)

    def _line(self, item: logging.LogRecord | tuple) -> str:
        if isinstance(item, tuple):  # an access line: the record is built here, not on the event loop
            created, rid, msg, args = item
            item = logging.makeLogRecord(
                {
                    "name": _access.name,
                    "levelno": logging.INFO,
                    "levelname": "INFO",
                    "msg": msg,
                    "args": tuple(
                        bounded(a) if isinstance(a, str) else a for a in args
                    ),  # path, method: a client's
                    "created": created,
                    "msecs": (created - int(created)) * 1000,
                    "request_id": rid,
                }
            )
        try:
            message = item.getMessage()
            if not message.isprintable():  # a client's bytes in it (a %0a in a path) cannot forge a line
                item.msg, item.args = escaped(message), None
            return self.formatter.format(item) + "\n"
        except Exception:  # a record whose message cannot be formatted: say so, keep the thread
            return (
                f"unformattable log record from {getattr(item, 'name', '?')}: {getattr(item, 'msg', '')!r}\n"
            )

    def flush(self, timeout: float = 5.0) -> None:
        event = threading.Event()
        self.queue.put(event)
        event.wait(timeout)

    def stop(self) -> None:
        self.queue.put(None)
        self._thread.join(5.0)


def _write(text: str) -> None:
    """To whatever ``sys.stderr`` is now (a test's capture, a redirect), never to a stream closed since."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed or None: lines lost, the server goes on
        pass


_writer: _Writer | None = None
_access = logging.getLogger("addnorm.access")
_addnorm = logging.getLogger("addnorm")


def _stop_writer() -> None:
    """Write out what is queued and stop the writer thread (at exit, and before reconfiguring)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


atexit.register(_stop_writer)


FIELD_LIMIT = 512  # characters of one client-controlled field in an access line (a path, a method)


def bounded(text: str, limit: int = FIELD_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more]"


def escaped(text: str) -> str:
    """Every character a terminal or a log reader would act on (newlines, escapes, other controls) as ``\\xNN``
    (``\\uNNNN`` above 0xff): one log record stays one line."""
    return "".join(
        c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text
    )


def flush() -> None:
    """Write out every line queued so far, now (the writer thread writes them on its own time otherwise)."""
    if _writer is not None:
        _writer.flush()


def access(msg: str, *args: object) -> None:
    """One access line (INFO, logger ``addnorm.access``), with the caller's request id. Where logging is configured
    here and nothing else listens to that logger, this only puts a tuple on the writer's queue (~0.2 us against
    ~6 us for ``Logger.info`` on this machine); otherwise it is ``Logger.info``."""
    if not _access.isEnabledFor(logging.INFO):
        return
    writer = _writer
    if writer is not None and not _access.handlers and not _addnorm.propagate:
        writer.queue.put((time.time(), request_id.get(), msg, args))
    else:
        _access.info(msg, *args)


def configure(level: str = "info", json_logs: bool = False) -> None:
    """Log lines, plain or JSON, written by one writer thread; callers only enqueue (with their request id)."""
    global _writer
    _stop_writer()
    if json_logs:
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
    _writer = _Writer(formatter)
    enqueue = _QueueHandler(_writer.queue)
    enqueue.addFilter(_RequestIdFilter())  # in the caller's context, where the request id is set
    for name in ("addnorm", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [enqueue]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # addnorm.access logs each request with its id
