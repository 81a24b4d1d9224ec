from protos import common_pb2 as _common_pb2
from protos import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
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

class SequenceState(_message.Message):
    __slots__ = ("seq_id", "status", "num_computed_tokens", "table", "block_table", "num_hashed_blocks", "num_inflight_tokens")
    class Table(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NO_TABLE: _ClassVar[SequenceState.Table]
        DEVICE: _ClassVar[SequenceState.Table]
        CPU: _ClassVar[SequenceState.Table]
    NO_TABLE: SequenceState.Table
    DEVICE: SequenceState.Table
    CPU: SequenceState.Table
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: str
    num_computed_tokens: int
    table: SequenceState.Table
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_hashed_blocks: int
    num_inflight_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., table: _Optional[_Union[SequenceState.Table, str]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_hashed_blocks: _Optional[int] = ..., num_inflight_tokens: _Optional[int] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_hash", "num_hashed_tokens", "last_accessed")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESSED_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    num_hashed_tokens: int
    last_accessed: int
    def __init__(self, block_hash: _Optional[bytes] = ..., num_hashed_tokens: _Optional[int] = ..., last_accessed: _Optional[int] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("seq_id", "num_new_tokens", "num_computed_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_new_tokens: int
    num_computed_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("epoch", "step_id", "scheduled", "swap_in", "swap_out", "copy")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    swap_in: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockPair]
    swap_out: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockPair]
    copy: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockPair]
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[_worker_pb2.BlockPair, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[_worker_pb2.BlockPair, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[_worker_pb2.BlockPair, _Mapping]]] = ...) -> None: ...

class StepRecords(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ...) -> None: ...
