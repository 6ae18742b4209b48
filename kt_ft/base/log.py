"""kt-ft's logger: INFO lines prefixed `[kt-ft]`, printed by the main process only."""

from __future__ import annotations

import logging
import os

_CONFIGURED = False


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def get_logger(name: str = "kt_ft") -> logging.Logger:
    global _CONFIGURED
    root = logging.getLogger("kt_ft")
    if not _CONFIGURED:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[kt-ft|%(levelname)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO if is_main_process() else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name)


def fmt_bytes(n: float) -> str:
    """Bytes for log lines and reports: GiB from a tenth of one up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"
