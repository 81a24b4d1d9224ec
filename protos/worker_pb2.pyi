from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_gpu_blocks", "num_cpu_blocks", "max_model_len", "instance_id", "device", "num_cached_sequences", "epoch", "vocab_size", "num_used_blocks", "sliding_window", "num_recomputed_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    instance_id: str
    device: str
    num_cached_sequences: int
    epoch: int
    vocab_size: int
    num_used_blocks: int
    sliding_window: int
    num_recomputed_tokens: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., instance_id: _Optional[str] = ..., device: _Optional[str] = ..., num_cached_sequences: _Optional[int] = ..., epoch: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., sliding_window: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "output_token_ids", "sampling", "block_table", "num_computed_tokens", "num_new_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_new_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("seq_id", "new_block_ids", "num_new_tokens", "replaced_blocks", "last_token_id", "num_tokens")
    class ReplacedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: int
    replaced_blocks: _containers.ScalarMap[int, int]
    last_token_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[int] = ..., replaced_blocks: _Optional[_Mapping[int, int]] = ..., last_token_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("epoch", "step_id", "swap_in", "swap_out", "copy", "new_sequences", "cached_sequences", "finished_seq_ids")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CACHED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    cached_sequences: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., cached_sequences: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_seconds", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("steps", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepPlan]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepPlan, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepBatchResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "start", "positions")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    positions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("epoch", "keep_cache")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    keep_cache: bool
    def __init__(self, epoch: _Optional[int] = ..., keep_cache: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("instance_id", "last_steps")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEPS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    last_steps: _containers.RepeatedCompositeFieldContainer[ExecutedStep]
    def __init__(self, instance_id: _Optional[str] = ..., last_steps: _Optional[_Iterable[_Union[ExecutedStep, _Mapping]]] = ...) -> None: ...

class ExecutedStep(_message.Message):
    __slots__ = ("epoch", "step_id", "result", "sequences", "swap_in", "swap_out", "copy")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    result: StepResult
    sequences: _containers.RepeatedCompositeFieldContainer[ExecutedSequence]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[ExecutedSequence, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ...) -> None: ...

class ExecutedSequence(_message.Message):
    __slots__ = ("seq_id", "num_computed_tokens", "num_new_tokens", "block_table")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ...) -> None: ...

class ResumeSequencesRequest(_message.Message):
    __slots__ = ("epoch", "swap_in", "swap_out", "copy", "sequences")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    def __init__(self, epoch: _Optional[int] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ...) -> None: ...

class RefusedSequence(_message.Message):
    __slots__ = ("seq_id", "reason", "not_cached")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NOT_CACHED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: str
    not_cached: bool
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[str] = ..., not_cached: _Optional[bool] = ...) -> None: ...

class ResumeSequencesResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: _containers.RepeatedCompositeFieldContainer[RefusedSequence]
    def __init__(self, refused: _Optional[_Iterable[_Union[RefusedSequence, _Mapping]]] = ...) -> None: ...
