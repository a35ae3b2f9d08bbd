"""Structured logs: plain text or one JSON object per line, on stderr.

Every router logger lives under ``kvrouter``. Request lines carry their fields in
``record.fields`` (request id, model, replica, decision reason, status, timings); the text
format renders them as ``key=value`` pairs, the JSON format as top-level keys.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import orjson

from router.config import LoggingConfig

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        s = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            s += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return s


def _text(v: Any) -> str:
    s = str(v)
    return f'"{s}"' if (" " in s or not s) else s


def setup_logging(cfg: LoggingConfig, stream: IO[str] | None = None) -> logging.Logger:
    """Configure the ``kvrouter`` logger tree (idempotent: replaces its handler)."""
    logger = logging.getLogger("kvrouter")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if cfg.format == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[cfg.level])
    logger.propagate = False
    return logger


def request_logger() -> logging.Logger:
    return logging.getLogger("kvrouter.request")
