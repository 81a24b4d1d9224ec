"""The structured-outputs benchmark runs its steps and its report section renders from the result."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import structured_section
from benchmarks.structured_outputs import run


def test_a_short_run_measures_every_phase_and_renders(default_model_dir: Path) -> None:
    result = run(num_seqs=4, steps=3)
    assert result["seqs"] == 4 and result["steps"] == 3 and result["vocab_size"] > 0
    for key in ("masks_ms", "apply_ms", "added_ms", "sample_without_masks_ms", "first_step_masks_ms"):
        assert result[key] > 0, key
    section = structured_section(result)
    assert "| **added by structured outputs** |" in section and "4 sequences" in section
