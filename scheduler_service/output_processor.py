"""Turns sampled tokens into client-visible outputs: detokenize, stop, finish.

Runs in the engine loop right after a step; everything it produces goes into the step's StepCommit, so
clients see it only once Redis has it.
"""

from __future__ import annotations

import time

from protos import common_pb2, generation_pb2, state_pb2, worker_pb2
from scheduler_service.beam_processor import BeamProcessor, PendingFork, restore_beam_ids
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.core.stop_checker import check_stop, held_back_stop_strings, streamable_text_length
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.request_state import FINISH_REASONS, REASON_LABELS, RequestState, SeqOutput, stop_fields
from scheduler_service.store import RestoredRequest, StepCommit
from shared.metrics import RequestTimings
from shared.sampling_proto import sampling_from_proto

# A request that keeps failing its worker is likely the cause: stop retrying it.
MAX_WORKER_FAILURES = 2


class OutputProcessor:
    """Owns the detokenizers of one engine loop's requests."""

    def __init__(self, tokenizer: object, scheduler: Scheduler) -> None:
        self._tokenizer = tokenizer
        self._scheduler = scheduler
        self._eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self._requests: dict[str, RequestState] = {}
        self._beams = BeamProcessor(scheduler, self._eos_token_id)
        # Per-request timings for metrics and traces, kept only when `record_timings` is set:
        # request id -> [first scheduled, first token, last token] (unix seconds; 0 = not yet).
        self.record_timings = False
        self._times: dict[str, list[float]] = {}
        # Requests finished, and the time between requests' consecutive tokens, since the engine loop last took
        # them (take_finished).
        self._finished: list[tuple[str, RequestTimings]] = []
        self._inter_token: list[float] = []

    def __len__(self) -> int:
        return len(self._requests)

    # -- timings (metrics and traces) -----------------------------------------------------------

    def mark_scheduled(self, out: SchedulerOutput, now: float) -> None:
        """Notes the first step each request was scheduled in (its time in queue ends there)."""
        for item in out.scheduled:
            self._times.setdefault(item.group.request_id, [now, 0.0, 0.0])

    def take_finished(self) -> tuple[list[tuple[str, RequestTimings]], list[float]]:
        """(request id, timings) of the requests finished since the last call, and the inter-token latencies."""
        finished, self._finished = self._finished, []
        inter_token, self._inter_token = self._inter_token, []
        return finished, inter_token

    # -- requests entering and leaving ---------------------------------------------------------

    def add(self, record: state_pb2.AdmittedRequest) -> None:
        """Queues an admitted request in the scheduler."""
        self.restore(RestoredRequest(record, {}))

    def restore(self, restored: RestoredRequest) -> None:
        """Queues a request with the outputs already committed for it (after a change of owner), to be
        recomputed from prompt + those outputs; the stream continues exactly after the text clients were sent."""
        record = restored.record
        prompt = list(record.prompt_token_ids)
        params = sampling_from_proto(record.sampling)
        seq_ids = list(record.seq_ids)
        if params.use_beam_search:
            seq_ids = restore_beam_ids(seq_ids, restored.outputs, restored.finished)
        seqs = [
            Sequence(seq_id=seq_id, prompt_token_ids=prompt, output_token_ids=restored.outputs.get(seq_id, []))
            for seq_id in seq_ids
        ]
        group = SequenceGroup(
            request_id=record.request_id, seqs=seqs, sampling_params=params, arrival_time=record.arrival_time,
        )
        self._scheduler.add_request(group)
        for seq in seqs:
            if seq.seq_id in restored.finished:
                self._scheduler.finish_sequence(group, seq, SequenceStatus[restored.finished[seq.seq_id]])
        self.adopt(restored, group)

    def adopt(self, restored: RestoredRequest, group: SequenceGroup) -> None:
        """Takes on a request the scheduler holds (as restore() queued it, or as the last owner of the worker
        left it: takeover.py); its detokenizers replay the committed outputs, so the stream goes on right after."""
        record, params = restored.record, group.sampling_params
        cumulative = {s.seq_id: restored.cumulative_logprobs.get(s.seq_id, 0.0) for s in group.seqs}
        # Outputs were committed only after the response that carried the prompt logprobs. A streaming request
        # commits a message with every output token; the others (best_of > n, beam search) only their last one.
        committed = any(restored.outputs.values())
        state = RequestState(record, group, cumulative, prompt_logprobs_sent=committed,
                             first_sent=committed and params.streams_outputs)
        if not params.use_beam_search:
            prompt = list(record.prompt_token_ids)
            for index, seq in enumerate(group.seqs):
                detokenizer = IncrementalDetokenizer(self._tokenizer, prompt, params.skip_special_tokens,
                                                     params.spaces_between_special_tokens)
                detokenizer.step(seq.output_token_ids)
                sent = streamable_text_length(detokenizer.output_text, held_back_stop_strings(params), finished=False)
                state.seqs[seq.seq_id] = SeqOutput(index, detokenizer, sent)
        self._requests[group.request_id] = state

    def abort(self, request_id: str, commit: StepCommit) -> bool:
        """Client-requested abort: frees blocks, ends the stream with FINISH_REASON_ABORT; False for a request
        this loop does not hold."""
        group = self._scheduler.abort_request(request_id)
        if group is not None:
            self._finish_request(group, commit, error="")
            commit.aborted_requests.append(request_id)
        return group is not None

    def requeue(self, group: SequenceGroup, commit: StepCommit, message: str) -> None:
        """The worker lost the group's KV (it failed or restarted): recompute it from prompt + outputs.

        A request that was running at every one of several worker failures ends with `message`
        instead, so one poisonous request cannot stall the rest.
        """
        state = self._requests.get(group.request_id)
        if state is None:
            return
        state.worker_failures += 1
        if state.worker_failures > MAX_WORKER_FAILURES:
            self.fail(group, commit, message)
            return
        self.recompute(group)

    def recompute(self, group: SequenceGroup) -> None:
        """Recomputes the group from prompt + outputs (its KV cannot be trusted); its client sees nothing of this."""
        state = self._requests.get(group.request_id)
        if state is None:
            return
        outputs = {seq.seq_id: list(seq.output_token_ids) for seq in group.seqs}
        finished = {seq.seq_id: seq.status.name for seq in group.seqs if seq.is_finished}
        self._scheduler.abort_request(group.request_id)
        del self._requests[group.request_id]
        self.restore(RestoredRequest(state.record, outputs, finished, dict(state.cumulative)))
        self._requests[group.request_id].worker_failures = state.worker_failures

    def hand_over(self, group: SequenceGroup) -> state_pb2.AdmittedRequest | None:
        """Lets go of a request that continues on another worker; returns its record (None if unknown).

        Its client sees nothing of this: the outputs committed so far stay in Redis (the step's ones in the
        commit that moves it), and the new loop recomputes from prompt + outputs.
        """
        state = self._requests.pop(group.request_id, None)
        if state is None:
            return None
        self._times.pop(group.request_id, None)  # the new loop measures the request from its own start
        self._scheduler.abort_request(group.request_id)
        return state.record

    def fail(self, group: SequenceGroup, commit: StepCommit, message: str) -> None:
        """Ends a request with an error its client sees (FINISH_REASON_ERROR)."""
        if not group.is_finished():
            self._scheduler.abort_request(group.request_id)
        self._finish_request(group, commit, error=message)

    def _finish_request(self, group: SequenceGroup, commit: StepCommit, error: str) -> None:
        msg = generation_pb2.GenerateResponse(error=error)
        # Clients know indices 0..n-1 only (with best_of > n the extra sequences are never shown).
        for index, seq in enumerate(group.seqs[: group.sampling_params.n]):
            reason = common_pb2.FINISH_REASON_ERROR if error else FINISH_REASONS[seq.status]
            msg.outputs.add(index=index, finish_reason=reason)
        self._add_final(group, msg, commit, group.seqs[: group.sampling_params.n])

    def _add_final(
        self, group: SequenceGroup, msg: generation_pb2.GenerateResponse, commit: StepCommit, returned: list[Sequence]
    ) -> None:
        """Ends the request with `msg`, its final message (the one with usage)."""
        state = self._requests.pop(group.request_id, None)
        if state is not None:
            state.mark_first(msg)
        msg.usage.prompt_tokens = len(group.seqs[0].prompt_token_ids)
        msg.usage.completion_tokens = sum(len(s.output_token_ids) for s in returned)
        if self.record_timings:
            self._record_finish(group, msg, returned)
        commit.outputs.append((group.request_id, msg))
        commit.finished_requests.append(group.request_id)
        commit.dropped_seqs.extend(s.seq_id for s in group.seqs)

    def _record_finish(self, group: SequenceGroup, msg: generation_pb2.GenerateResponse, returned: list[Sequence]) -> None:
        now = time.time()
        scheduled, first_token, _ = self._times.pop(group.request_id, (0.0, 0.0, 0.0))
        status = returned[0].status if returned else SequenceStatus.FINISHED_ABORTED
        reason = "error" if msg.error else REASON_LABELS.get(status, "abort")
        self._finished.append((group.request_id, RequestTimings(
            arrival_time=group.arrival_time, first_scheduled_time=scheduled or now,
            # Beam search streams nothing before the end: its first token is its last.
            first_token_time=first_token or now, finished_time=now,
            prompt_tokens=msg.usage.prompt_tokens, generation_tokens=msg.usage.completion_tokens,
            finished_reason=reason,
        )))

    # -- step results --------------------------------------------------------------------------

    def process(self, out: SchedulerOutput, result: worker_pb2.StepResult, commit: StepCommit,
                advanced: bool = False) -> None:
        """Applies a step's sampled tokens and emits deltas for every request that advanced.

        advanced: the scheduler already advanced the step (Scheduler.advance, async scheduling): only its
        in-flight tokens are resolved here.
        """
        if result.prompt_logprobs:
            groups = {item.seq.seq_id: item.group for item in out.scheduled}
            for piece in result.prompt_logprobs:
                group = groups.get(piece.seq_id)
                state = self._requests.get(group.request_id) if group is not None else None
                if state is not None:
                    state.gather_prompt_logprobs(piece)
        sampled = {s.seq_id: s.token_id for s in result.sampled}
        by_seq = {s.seq_id: s for s in result.sampled}
        forks = self._beam_steps(out, by_seq, sampled, commit)
        if advanced:
            self._scheduler.resolve(out, sampled)
        else:
            self._scheduler.update_after_step(out, sampled)
        for fork in forks:
            self._scheduler.fork_seq(fork.group, fork.parent, fork.child)
        deltas: dict[str, list[generation_pb2.CompletionDelta]] = {}
        for item in out.scheduled:
            seq, group = item.seq, item.group
            token = sampled.get(seq.seq_id)
            state = self._requests.get(group.request_id)
            if token is None or state is None or seq.is_finished or group.sampling_params.use_beam_search:
                continue
            # A commit may carry several steps (a new owner lands the last owner's steps into one).
            commit.new_tokens.setdefault(seq.seq_id, []).append(token)
            state.cumulative[seq.seq_id] += by_seq[seq.seq_id].logprob
            delta = self._on_token(state, group, seq, token)
            if group.sampling_params.logprobs is not None:
                delta.logprobs.add(logprob=by_seq[seq.seq_id].logprob, top=by_seq[seq.seq_id].top_logprobs)
            deltas.setdefault(group.request_id, []).append(delta)
        if self.record_timings:
            now = time.time()
            for request_id in deltas:
                times = self._times.get(request_id)
                if times is not None:
                    if times[2]:
                        self._inter_token.append(now - times[2])
                    times[1], times[2] = times[1] or now, now
        for request_id, new in deltas.items():
            state = self._requests[request_id]
            group = state.group
            streams = group.sampling_params.streams_outputs
            msg = generation_pb2.GenerateResponse(outputs=new if streams else [])
            if streams or group.is_finished():
                state.attach_prompt_logprobs(msg)
            if group.is_finished():
                self._add_final(group, msg, commit, group.seqs if streams else state.best(msg))
                continue
            if streams:
                state.mark_first(msg)
                commit.outputs.append((request_id, msg))
            else:
                # Kept in Redis so that a new owner ranks the sequences on their whole history.
                cumulative = {s.seq_id: state.cumulative[s.seq_id] for s in group.seqs if s.seq_id in sampled}
                commit.cumulative_logprobs.setdefault(request_id, {}).update(cumulative)
            # n > 1: a sequence that ended while its siblings go on must stay ended after a restart.
            ended_now = {s.seq_id: s.status.name for s in group.seqs if s.is_finished and s.seq_id in sampled}
            if ended_now:
                commit.finished_seqs.setdefault(request_id, {}).update(ended_now)

    def _beam_steps(
        self, out: SchedulerOutput, by_seq: dict[int, worker_pb2.SampledToken], sampled: dict[int, int],
        commit: StepCommit,
    ) -> list[PendingFork]:
        """Beam-search groups whose beams sampled: pick the next beams, finish the searches that are done."""
        items_by_request: dict[str, list] = {}
        candidates: dict[int, list[tuple[int, float]]] = {}
        for item in out.scheduled:
            searching = item.group.sampling_params.use_beam_search and item.samples and not item.seq.is_finished
            if searching and item.group.request_id in self._requests:
                items_by_request.setdefault(item.group.request_id, []).append(item)
                candidates[item.seq.seq_id] = [(t.token_id, t.logprob) for t in by_seq[item.seq.seq_id].top_logprobs]
        forks: list[PendingFork] = []
        for request_id, items in items_by_request.items():
            state = self._requests[request_id]
            forks += self._beams.step(state, items, candidates, sampled, commit)
            if state.group.is_finished():
                msg = generation_pb2.GenerateResponse()
                state.attach_prompt_logprobs(msg)
                best = self._beams.final_outputs(state, self._tokenizer, msg)
                self._add_final(state.group, msg, commit, best)
        return forks

    def _on_token(self, state: RequestState, group: SequenceGroup, seq: Sequence, token: int) -> generation_pb2.CompletionDelta:
        out = state.seqs[seq.seq_id]
        params = group.sampling_params
        new_text = out.detokenizer.step([token])
        decision = check_stop(
            seq, params, output_text=out.detokenizer.output_text, num_new_chars=len(new_text),
            eos_token_id=self._eos_token_id, max_model_len=self._scheduler.max_seq_len,
        )
        if decision.truncate_text_to is not None:
            out.detokenizer.truncate(decision.truncate_text_to)
        text = out.detokenizer.output_text
        end = streamable_text_length(text, held_back_stop_strings(params), decision.finished)
        stop = stop_fields(decision.reason) if decision.finished else {}
        delta = generation_pb2.CompletionDelta(index=out.index, text=text[out.sent_chars:end], token_ids=[token],
                                               **stop)
        out.sent_chars = max(out.sent_chars, end)
        if decision.finished:
            assert decision.status is not None  # guaranteed by StopDecision's invariant
            self._scheduler.finish_sequence(group, seq, decision.status)
            delta.finish_reason = FINISH_REASONS[decision.status]
            out.stop_reason = decision.reason
        return delta
