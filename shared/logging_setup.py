"""One logging format for every llmserve process."""

from __future__ import annotations

import logging


def setup_logging(level: str = "INFO", name: str = "llmserve") -> None:
    """Configures the root logger: timestamp, process role, level, logger, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # transformers and gRPC are chatty at INFO; their warnings still show.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
