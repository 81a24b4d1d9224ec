"""Offline inference in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    from llmserve import LLM, SamplingParams

    with LLM(model="path/to/checkpoint", max_model_len=1024) as llm:
        outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                               SamplingParams(temperature=0.0, max_tokens=16))
    for out in outputs:
        print(out.prompt, "->", out.outputs[0].text)

By default the engine runs in this process (llmserve/engine.py: the scheduler
core and a model runner, no Redis, no gRPC); with `services=True` the services
run locally as separate processes, exactly as `llmserve up` starts them (Redis,
one worker, one scheduler), and the prompts go through gRPC `Generate`. Either
way the prompts are submitted together, so the engine batches them
continuously, and the outputs come back in prompt order with a progress bar.
A prompt the engine refuses (empty, too long for the context, bad sampling
parameters) fails alone, as over gRPC: its RequestOutput has no outputs and an
`error` ("INVALID_ARGUMENT: ..."), logged as a warning; the others run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from tqdm import tqdm

from llmserve.client import chat_message, chat_options, stop_reason_of
from llmserve.engine import InProcessEngine
from llmserve.local_cluster import ClusterSpec, LocalCluster, service_flag
from protos import common_pb2, generation_pb2, generation_pb2_grpc
from scheduler_service.scheduling import SchedulingFlags
from shared.errors import status_for
from shared.tls import open_channel
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_to_proto
from worker_service.config import WorkerConfig

log = logging.getLogger(__name__)

# Engine arguments by service: each becomes the service's --flag (underscores as dashes).
_WORKER_ARGS = {"dtype", "device", "block_size", "kv_cache_memory", "gpu_memory_utilization", "swap_space",
                "num_gpu_blocks_override", "max_model_len", "seed", "num_threads"}
_SCHEDULER_ARGS = {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                   "max_model_len"}


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One entry per token when the request asked for logprobs: (token's logprob, {top token id: logprob}).
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    # The stop string, or the stop token id (an int), that ended the sequence (vLLM's).
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """A prompt and what was generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str = ""
    # When the request asked for prompt_logprobs: one entry per prompt token, as CompletionOutput.logprobs, None
    # for the tokens not computed (the first one, which nothing predicts; prefix-cached ones).
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


class _Collector:
    """A request's output, built from the GenerateResponse messages of its stream."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outputs: dict[int, CompletionOutput] = {}
        self.error = ""
        self.done = False
        # The prompt as the model read it (the stream's first message), its logprobs (the first with outputs).
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None

    def add(self, msg: generation_pb2.GenerateResponse) -> None:
        self.prompt_token_ids = self.prompt_token_ids or list(msg.prompt_token_ids)
        if msg.prompt_logprobs or msg.prompt_logprobs_start:
            self.prompt_logprobs = [None] * msg.prompt_logprobs_start + _logprobs(msg.prompt_logprobs)
        for delta in msg.outputs:
            out = self.outputs.setdefault(delta.index, CompletionOutput(delta.index))
            out.text += delta.text
            out.token_ids.extend(delta.token_ids)
            out.logprobs.extend(_logprobs(delta.logprobs))
            if delta.finish_reason:
                out.finish_reason = _FINISH.get(delta.finish_reason)
                out.stop_reason = stop_reason_of(delta)
        self.error = msg.error or self.error
        # The last message of a stream carries the usage (and an error ends it too).
        self.done |= msg.HasField("usage") or bool(msg.error)

    def result(self, prompt: str | None) -> RequestOutput:
        """The request's output; a refused prompt has an error, no outputs and no tokens."""
        return RequestOutput(self.request_id, prompt, self.prompt_token_ids,
                             [self.outputs[i] for i in sorted(self.outputs)], self.error, self.prompt_logprobs)


def _logprobs(entries: Iterable[common_pb2.TokenLogprobs]) -> list[tuple[float, dict[int, float]]]:
    return [(e.logprob, {t.token_id: t.logprob for t in e.top}) for e in entries]


def _warn_failed(outputs: list[RequestOutput]) -> list[RequestOutput]:
    for i, out in enumerate(outputs):
        if out.error:
            log.warning("prompt %d failed: %s", i, out.error)
    return outputs


# Worker flags whose WorkerConfig field says its unit.
_WORKER_FIELDS = {"kv_cache_memory": "kv_cache_memory_gib", "swap_space": "swap_space_gib"}


def _engine_configs(model: str, args: dict[str, object]) -> tuple[WorkerConfig, SchedulingFlags]:
    """The in-process engine's worker and scheduling configurations from the engine arguments."""
    worker = {_WORKER_FIELDS.get(k, k): v for k, v in args.items() if k in _WORKER_ARGS}
    flags = {k: v for k, v in args.items() if k in {f.name for f in dataclasses.fields(SchedulingFlags)}}
    return WorkerConfig(model=model, **worker), SchedulingFlags(**flags)  # type: ignore[arg-type]


def _flags(args: dict[str, object], names: set[str]) -> list[str]:
    return [flag for name, value in args.items() if name in names for flag in service_flag(name, value)]


Prompt = str | list[int] | dict[str, object]


def _prompt_of(prompt: object) -> str | list[int]:
    """A prompt of `generate` as text or token ids; TypeError, naming what is accepted, for anything else."""
    if isinstance(prompt, dict):
        if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & set(prompt):
            raise TypeError(f"a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids', got keys "
                            f"{sorted(prompt)}")
        (prompt,) = prompt.values()
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError(f"a prompt is a str, a list of token ids, {{'prompt': str}} or {{'prompt_token_ids': [int]}}, "
                    f"got {type(prompt).__name__}: {str(prompt)[:80]}")


class LLM:
    """A local llmserve for batch inference: in this process, or as local services (`services=True`).

    model: a checkpoint directory or .gguf file (default: the bundled SmolLM2-135M-Instruct).
    engine_args: the worker's and scheduler's flags by their Python names, e.g. dtype="bfloat16",
    max_model_len=2048, enable_prefix_caching=True, max_num_seqs=64.
    """

    def __init__(self, model: str | None = None, services: bool = False, **engine_args: object) -> None:
        unknown = set(engine_args) - _WORKER_ARGS - _SCHEDULER_ARGS
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(_WORKER_ARGS | _SCHEDULER_ARGS))}")
        if model is None:
            from shared.default_model import prepare_default_model  # noqa: PLC0415 - converts once, slow

            model = str(prepare_default_model())
        self.model = model
        self._cluster: LocalCluster | None = None
        self._engine: InProcessEngine | None = None
        if services:
            spec = ClusterSpec(model=model, worker_args=_flags(engine_args, _WORKER_ARGS),
                               scheduler_args=_flags(engine_args, _SCHEDULER_ARGS))
            self._cluster = LocalCluster(spec).start()
        else:
            self._engine = InProcessEngine(*_engine_configs(model, engine_args))
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt at once; outputs in prompt order. A prompt is a text, a list of token ids,
        or vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt)."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item] - one prompt
        requests = [self._request(_prompt_of(p), None) for p in prompts]  # type: ignore[union-attr]
        return self._run(requests, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One answer per conversation (OpenAI-shaped messages with text content, an assistant's `tool_calls` and a
        tool's `tool_call_id` included, rendered with the model's chat template).

        add_generation_prompt / continue_final_message: as vLLM's, how the template ends the rendering (a new
        assistant turn; or the final message left open for the model to continue). tools: OpenAI's function
        tools, given to the template (as vLLM's `LLM.chat(tools=...)`). chat_template_kwargs: more template
        variables, as vLLM's (e.g. `{"enable_thinking": False}` for a template that reads it)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        requests = [self._request(None, conv) for conv in conversations]  # type: ignore[arg-type]
        options = chat_options(add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
        for req in requests:
            req.chat_options.CopyFrom(options)
        return self._run(requests, sampling_params, use_tqdm)

    def _request(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None
                 ) -> generation_pb2.GenerateRequest:
        self._next_id += 1
        req = generation_pb2.GenerateRequest(request_id=f"offline-{id(self):x}-{self._next_id}")
        if isinstance(prompt, str):
            req.prompt = prompt
        elif prompt is not None:
            req.prompt_token_ids.extend(prompt)
        req.messages.extend(chat_message(m) for m in messages or [])
        return req

    def _run(self, requests: list[generation_pb2.GenerateRequest],
             sampling_params: SamplingParams | list[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(
            requests)
        if len(params) != len(requests):
            raise ValueError(f"got {len(params)} sampling params for {len(requests)} prompts")
        for req, p in zip(requests, params):
            req.sampling.CopyFrom(sampling_to_proto(p))
        if self._engine is not None:
            return self._run_in_process(self._engine, requests, use_tqdm)
        return asyncio.run(self._gather(requests, use_tqdm))

    @staticmethod
    def _run_in_process(engine: InProcessEngine, requests: list[generation_pb2.GenerateRequest],
                        use_tqdm: bool) -> list[RequestOutput]:
        collectors = [_Collector(req.request_id) for req in requests]
        by_id = {c.request_id: c for c in collectors}
        with tqdm(total=len(requests), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            for req, collector in zip(requests, collectors):
                try:
                    engine.add_request(req)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone, as over gRPC
                    collector.error, collector.done = f"{status_for(exc).name}: {exc}", True
                    bar.update(1)
            while engine.has_unfinished_requests():
                for request_id, msg in engine.step():
                    collector = by_id[request_id]
                    collector.add(msg)
                    if collector.done:
                        bar.update(1)
        return _warn_failed([c.result(req.prompt or None) for req, c in zip(requests, collectors)])

    async def _gather(self, requests: list[generation_pb2.GenerateRequest], use_tqdm: bool) -> list[RequestOutput]:
        assert self._cluster is not None  # the services' path
        async with open_channel(self._cluster.address, aio=True) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with tqdm(total=len(requests), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
                outputs = await asyncio.gather(*(self._one(stub, req, bar) for req in requests))
            return _warn_failed(list(outputs))

    @staticmethod
    async def _one(stub: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest,
                   bar: tqdm) -> RequestOutput:
        collector = _Collector(req.request_id)
        try:
            async for msg in stub.Generate(req):
                collector.add(msg)
        except grpc.aio.AioRpcError as exc:
            collector.error = f"{exc.code().name}: {exc.details()}"
        bar.update(1)
        return collector.result(req.prompt or None)

    def shutdown(self) -> None:
        """Stops the local services (nothing to stop in process)."""
        if self._cluster is not None:
            self._cluster.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()
