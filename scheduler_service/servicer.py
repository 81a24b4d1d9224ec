"""The public Generation servicer: admit, queue in Redis, stream committed outputs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from protos import generation_pb2, generation_pb2_grpc
from scheduler_service.admission import Admission, to_record
from scheduler_service.router import Router
from scheduler_service.store import RedisStore
from shared.errors import NotFoundError, UnavailableError, abort_with

log = logging.getLogger(__name__)

# How long one blocking read of the output stream waits before checking the call is alive.
READ_BLOCK_MS = 5000


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Thin: protobuf in, domain calls, protobuf out; errors mapped in one place."""

    def __init__(self, admission: Admission, store: RedisStore, router: Router) -> None:
        self._admission = admission
        self._store = store
        self._router = router

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            # Tokenizing can take milliseconds for long prompts: keep it off the event loop.
            admitted = await asyncio.to_thread(self._admission.admit, request)
            seq_ids = await self._store.reserve_seq_ids(admitted.sampling.num_sequences)
            worker_id = self._router.pick(admitted.request_id)
            await self._store.admit(to_record(admitted, seq_ids, worker_id, time.time()))
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never kills the server
            await abort_with(context, exc)
            return

        request_id = admitted.request_id
        finished = False
        last_id = "0"
        try:
            while not finished:
                for entry_id, msg in await self._store.read_outputs(request_id, last_id, READ_BLOCK_MS):
                    last_id = entry_id
                    yield msg
                    if msg.HasField("usage"):
                        finished = True
                        break
        except UnavailableError as exc:
            await abort_with(context, exc)
        finally:
            if not finished:
                # The client went away (or the stream broke): free the request's blocks.
                await asyncio.shield(self._abort_quietly(worker_id, request_id))

    async def Abort(self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        try:
            worker_id = await self._store.worker_of(request.request_id)
            if worker_id is None:
                raise NotFoundError(f"no live request has id {request.request_id!r}")
            await self._store.request_abort(worker_id, request.request_id)
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, exc)
        return generation_pb2.AbortResponse()

    async def _abort_quietly(self, worker_id: str, request_id: str) -> None:
        try:
            await self._store.request_abort(worker_id, request_id)
        except UnavailableError:
            log.warning("could not queue the abort of %s", request_id)
