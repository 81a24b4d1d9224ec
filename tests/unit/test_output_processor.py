"""The output processor: restoring requests after a change of owner, with finished sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from protos import common_pb2, state_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.store import RestoredRequest


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(default_model_dir)


def _record(n: int) -> state_pb2.AdmittedRequest:
    return state_pb2.AdmittedRequest(
        request_id="r", prompt_token_ids=[10, 11, 12, 13, 14], seq_ids=list(range(1, n + 1)), arrival_time=1.0,
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=1.0, n=n, seed=3),
    )


def test_restore_keeps_finished_sequences_finished(tokenizer: object) -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    processor = OutputProcessor(tokenizer, scheduler)
    outputs = {1: [100, 101], 2: [200, 201, 202], 3: [300]}
    processor.restore(RestoredRequest(_record(3), outputs, finished={2: "FINISHED_STOPPED"}))
    out = scheduler.schedule()
    scheduled = {item.seq.seq_id: (item.num_new_tokens, list(item.seq.output_token_ids)) for item in out.scheduled}
    # Sequences 1 and 3 are recomputed from prompt + their own outputs; 2 stays finished.
    assert scheduled == {1: (7, [100, 101]), 3: (6, [300])}
    assert scheduler.block_manager.num_free_gpu_blocks == 32 - 2 - 2


def test_restore_replays_text_so_the_stream_continues_after_what_was_sent(tokenizer: object) -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    processor = OutputProcessor(tokenizer, scheduler)
    text_ids = tokenizer("Hello world, how are you").input_ids  # type: ignore[operator]
    processor.restore(RestoredRequest(_record(1), {1: text_ids}))
    state = processor._requests["r"]  # noqa: SLF001 - checking the replayed streaming state
    seq_out = state.seqs[1]
    assert seq_out.detokenizer.output_text == tokenizer.decode(text_ids)  # type: ignore[attr-defined]
    assert seq_out.sent_chars == len(seq_out.detokenizer.output_text)
