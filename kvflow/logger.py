"""kvflow's logger: INFO lines to stderr unless the application configured logging itself."""
from __future__ import annotations

import logging
import os


def init_logger(name: str = "kvflow") -> logging.Logger:
    logger = logging.getLogger(name)
    root = logging.getLogger("kvflow")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("KVFLOW_LOG_LEVEL", "INFO"))
        root.propagate = False
    return logger
