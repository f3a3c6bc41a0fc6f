"""kvflow's logger: INFO lines to stderr unless the application configured logging itself."""
from __future__ import annotations

import logging
from kvflow import envs


def init_logger(name: str = "kvflow") -> logging.Logger:
    logger = logging.getLogger(name)
    root = logging.getLogger("kvflow")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.KVFLOW_LOG_LEVEL)
        root.propagate = False
    return logger
