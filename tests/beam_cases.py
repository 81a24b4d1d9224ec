"""Beam-search cases shared by the core and end-to-end comparisons with transformers."""

from __future__ import annotations

from dataclasses import dataclass

from tests.hf_reference import HFReference

MAX_NEW = 16


@dataclass(frozen=True)
class BeamCase:
    prompt: list[int]
    width: int
    n: int
    length_penalty: float
    early_stopping: bool | str


def beam_case(i: int) -> BeamCase:
    """Widths 2-4 and a mix of length penalties (positive, negative) and every early_stopping rule."""
    width = (2, 3, 4)[i % 3]
    length_penalty, early_stopping = [(1.0, False), (0.5, True), (1.5, "never"), (1.0, False), (-0.5, False),
                                      (1.0, True)][i % 6]
    prompt = [(37 * i + 11 * j) % 40000 + 100 for j in range(20 + 7 * i)]
    return BeamCase(prompt, width, max(1, width - 1), length_penalty, early_stopping)


def hf_beams(reference: HFReference, case: BeamCase, stop: int, num_return: int | None = None) -> list[list[int]]:
    return reference.beam_search(case.prompt, MAX_NEW, case.width, num_return or case.n, eos_token_ids=[stop],
                                 length_penalty=case.length_penalty, early_stopping=case.early_stopping)


def stop_token_for(reference: HFReference, case: BeamCase) -> int:
    """A token the best beam produces early when nothing stops it: as a stop token it ends beams mid-search."""
    return hf_beams(reference, case, stop=0, num_return=1)[0][3]
