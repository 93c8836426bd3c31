"""The server's logging: text or one JSON object per line, the same in the server and its workers."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a request line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: str = "text", process: str = "") -> None:
    """The root logger writes to stderr as `log_format` says ("json" or "text"); `process` tags a
    text line with where it came from (a planning worker's lines say "[worker]")."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        tag = f" [{process}]" if process else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s{tag} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
