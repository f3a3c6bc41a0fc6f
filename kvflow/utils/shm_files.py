"""Files in /dev/shm named after the process that made them (`kvflow-<kind>-<pid>-...`), so that
a later start can remove those whose maker was killed before it could unlink them."""
from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"


def sweep_dead_owners(name: re.Pattern[str]) -> None:
    """Unlink every file in SHM_DIR whose name `name` matches with a process id (group 1) that
    no longer runs."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for entry in names:
        mt = name.match(entry)
        if mt and not os.path.exists(f"/proc/{mt.group(1)}"):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
            except OSError:
                pass
