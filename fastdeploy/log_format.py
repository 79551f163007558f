"""One log format for every line the server writes: its own, uvicorn's and the engine process's.

Paddle's import gives the root logger a handler of its own format (`[time] [ INFO] file.py:41 - ...`)
when the root logger has none; `restyle_paddle_handlers()` gives that handler this format instead,
leaving any handler the application configured alone.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PADDLE_FORMAT_MARK = "[%(levelname)8s]"


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


def restyle_paddle_handlers() -> None:
    for handler in logging.getLogger().handlers:
        fmt = getattr(handler.formatter, "_fmt", None) or ""
        if _PADDLE_FORMAT_MARK in fmt:
            handler.setFormatter(logging.Formatter(LOG_FORMAT))


def uvicorn_log_config(level: str = "info") -> dict:
    """uvicorn's loggers in LOG_FORMAT (its default prints `INFO:     ...`)."""
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    logger = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"format": LOG_FORMAT}},
        "handlers": {"default": handler},
        "loggers": {"uvicorn": logger, "uvicorn.access": logger},
    }
