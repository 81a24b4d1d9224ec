from protos import common_pb2 as _common_pb2
from protos import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmittedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "arrival_time", "seq_ids", "worker_id", "traceparent", "handed_over")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    arrival_time: float
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    worker_id: str
    traceparent: str
    handed_over: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., arrival_time: _Optional[float] = ..., seq_ids: _Optional[_Iterable[int]] = ..., worker_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., handed_over: _Optional[bool] = ...) -> None: ...

class WorkerRegistration(_message.Message):
    __slots__ = ("worker_id", "description", "draining", "registered_at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    description: _worker_pb2.WorkerDescription
    draining: bool
    registered_at: float
    def __init__(self, worker_id: _Optional[str] = ..., description: _Optional[_Union[_worker_pb2.WorkerDescription, _Mapping]] = ..., draining: _Optional[bool] = ..., registered_at: _Optional[float] = ...) -> None: ...
