"""What every benchmark result records about its run: when, and on what machine."""

from __future__ import annotations

import platform
from datetime import datetime, timezone

from shared.omp import usable_cpus


def run_info(*details: str) -> dict[str, str]:
    """{"date", "machine"}: the UTC time now, the architecture, the usable cores, then details (versions...)."""
    machine = ", ".join([platform.machine(), f"{usable_cpus()} CPU cores", *details])
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine}
