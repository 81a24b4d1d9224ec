"""What every benchmark result records about its run (when, and on what machine), and where it goes."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

from shared.omp import usable_cpus


def run_info(*details: str) -> dict[str, str]:
    """{"date", "machine"}: the UTC time now, the architecture, the usable cores, then details (versions...)."""
    machine = ", ".join([platform.machine(), f"{usable_cpus()} CPU cores", *details])
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine}


def write_results(path: Path, result: dict[str, object]) -> None:
    """Writes a benchmark's result as indented JSON (its folder made if needed) and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
