"""The output processor: restoring requests after a change of owner, prompt logprobs and token ids, special
tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmserve.client import collect_completions
from protos import common_pb2, state_pb2, worker_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.store import RestoredRequest, StepCommit


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


def _prompt_piece(seq_id: int, start: int, values: list[float]) -> worker_pb2.PromptLogprobs:
    return worker_pb2.PromptLogprobs(
        seq_id=seq_id, start=start,
        positions=[common_pb2.TokenLogprobs(logprob=v, top=[common_pb2.TokenLogprob(token_id=9, logprob=v)])
                   for v in values],
    )


def test_prompt_logprobs_of_every_chunk_arrive_with_the_first_output_only(tokenizer: object) -> None:
    # A 10-token budget prefills the 13-token prompt in two chunks; prompt logprobs come with each.
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64, enable_chunked_prefill=True),
        CacheConfig(block_size=4, num_gpu_blocks=32),
    )
    processor = OutputProcessor(tokenizer, scheduler)
    record = state_pb2.AdmittedRequest(
        request_id="r", prompt_token_ids=list(range(20, 33)), seq_ids=[1], arrival_time=1.0,
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1),
    )
    processor.add(record)
    messages = []
    pieces = [[_prompt_piece(1, 1, [-1.0] * 10)], [_prompt_piece(1, 11, [-2.0, -3.0])], [], []]
    for step_pieces in pieces:
        out = scheduler.schedule()
        sampled = [worker_pb2.SampledToken(seq_id=1, token_id=100, logprob=-0.5)] if out.scheduled[0].samples else []
        commit = StepCommit(worker_id="w")
        processor.process(out, worker_pb2.StepResult(sampled=sampled, prompt_logprobs=step_pieces), commit)
        messages += [msg for _, msg in commit.outputs]
    assert len(messages) == 3  # three tokens, one message each; the first chunk sampled nothing
    first = messages[0]
    assert first.prompt_logprobs_start == 1
    assert [e.logprob for e in first.prompt_logprobs] == [-1.0] * 10 + [-2.0, -3.0]
    assert all(not m.prompt_logprobs and not m.prompt_logprobs_start for m in messages[1:])


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(tokenizer: object) -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    processor = OutputProcessor(tokenizer, scheduler)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")  # type: ignore[attr-defined]
    texts = {}
    for skip in (True, False):
        record = state_pb2.AdmittedRequest(
            request_id=f"r{skip}", prompt_token_ids=[10, 11, 12], seq_ids=[1 if skip else 2], arrival_time=1.0,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, skip_special_tokens=skip),
        )
        processor.add(record)
        out = scheduler.schedule()
        commit = StepCommit(worker_id="w")
        result = worker_pb2.StepResult(sampled=[worker_pb2.SampledToken(seq_id=record.seq_ids[0], token_id=im_start)])
        processor.process(out, result, commit)
        texts[skip] = commit.outputs[0][1].outputs[0].text
    assert texts == {True: "", False: "<|im_start|>"}


def _run_steps(processor: OutputProcessor, scheduler: Scheduler, steps: int, token_id: int = 100) -> list:
    """Runs `steps` steps whose every scheduled sequence samples `token_id`; returns the committed messages."""
    messages = []
    for _ in range(steps):
        out = scheduler.schedule()
        sampled = [worker_pb2.SampledToken(seq_id=item.seq.seq_id, token_id=token_id, logprob=-0.5)
                   for item in out.scheduled if item.samples]
        commit = StepCommit(worker_id="w")
        processor.process(out, worker_pb2.StepResult(sampled=sampled), commit)
        messages += [msg for _, msg in commit.outputs]
    return messages


def _processor(tokenizer: object) -> tuple[OutputProcessor, Scheduler]:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    return OutputProcessor(tokenizer, scheduler), scheduler


def test_the_first_message_of_a_stream_carries_the_prompt_token_ids(tokenizer: object) -> None:
    processor, scheduler = _processor(tokenizer)
    processor.add(_record(2))
    # n = 2: the prompt is prefilled up to its last token, then each sequence decodes it (group_fork.py).
    messages = _run_steps(processor, scheduler, 4)
    assert len(messages) == 3 and list(messages[0].prompt_token_ids) == [10, 11, 12, 13, 14]
    assert all(not m.prompt_token_ids for m in messages[1:])
    # No message repeats the request id: its output stream's key names it (the readers set it), and in every entry
    # it would be ~40 % of what a generated token keeps in Redis.
    assert all(m.request_id == "" for m in messages)
    # The client keeps them for every sequence.
    assert [c.prompt_token_ids for c in collect_completions(messages)] == [[10, 11, 12, 13, 14]] * 2


def test_a_restored_stream_sends_the_prompt_token_ids_only_if_no_message_was_sent(tokenizer: object) -> None:
    processor, scheduler = _processor(tokenizer)
    processor.restore(RestoredRequest(_record(1), {1: [100, 101]}))  # its first message is in the stream
    assert all(not m.prompt_token_ids for m in _run_steps(processor, scheduler, 2))
    processor, scheduler = _processor(tokenizer)
    processor.restore(RestoredRequest(_record(1), {}))
    assert list(_run_steps(processor, scheduler, 2)[0].prompt_token_ids) == [10, 11, 12, 13, 14]


def test_best_of_and_aborted_requests_carry_them_in_their_only_message(tokenizer: object) -> None:
    processor, scheduler = _processor(tokenizer)
    record = _record(1)
    record.sampling.best_of, record.seq_ids[:] = 2, [1, 2]
    # Outputs committed by an earlier owner: best_of > n sent no message before its final one.
    processor.restore(RestoredRequest(record, {1: [100], 2: [100]}))
    (final,) = _run_steps(processor, scheduler, 8)
    assert final.HasField("usage") and list(final.prompt_token_ids) == [10, 11, 12, 13, 14]
    processor.add(_record(1))
    commit = StepCommit(worker_id="w")
    assert processor.abort("r", commit)
    ((_, aborted),) = commit.outputs
    assert aborted.HasField("usage") and list(aborted.prompt_token_ids) == [10, 11, 12, 13, 14]
