"""The digest that makes Generate idempotent: the same request is the same digest, another is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmserve.client import make_request
from scheduler_service.admission import Admission, ModelLimits


@pytest.fixture(scope="module")
def admission(default_model_dir: Path) -> Admission:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return Admission(tokenizer, ModelLimits(max_model_len=64, vocab_size=len(tokenizer)))


def digest(admission: Admission, **kwargs: object) -> str:
    return admission.admit(make_request(request_id="id-1", **kwargs)).digest  # type: ignore[arg-type]


def test_the_digest_names_what_decides_the_output(admission: Admission) -> None:
    base = digest(admission, prompt="Hello there", max_tokens=8, temperature=0.5)
    assert len(base) == 64 and base == digest(admission, prompt="Hello there", max_tokens=8, temperature=0.5)
    # The same tokens sent as ids, or a default spelled out, are the same request.
    ids = admission.admit(make_request(prompt="Hello there")).prompt_token_ids
    assert digest(admission, prompt_token_ids=ids, max_tokens=8, temperature=0.5) == base
    assert digest(admission, prompt="Hello there", max_tokens=8, temperature=0.5, top_p=1.0) == base
    # Anything that changes the output is another request.
    assert digest(admission, prompt="Hello there!", max_tokens=8, temperature=0.5) != base
    assert digest(admission, prompt="Hello there", max_tokens=9, temperature=0.5) != base
    assert digest(admission, prompt="Hello there", max_tokens=8, temperature=0.5, seed=1) != base
    # How the caller wants its stream handled is not part of the request.
    resumable = make_request(request_id="id-1", prompt="Hello there", max_tokens=8, temperature=0.5)
    resumable.resumable = True
    assert admission.admit(resumable).digest == base


def test_a_server_chosen_id_has_no_digest(admission: Admission) -> None:
    admitted = admission.admit(make_request(prompt="Hello there"))
    assert admitted.request_id and admitted.digest == ""
