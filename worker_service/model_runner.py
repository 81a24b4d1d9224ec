"""Runs one step plan: block operations, the forward pass, sampling."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PretrainedConfig

from llmserve.kernels import get_backend
from protos import worker_pb2
from shared import defaults
from shared.checkpoint import pretrained_source
from shared.host_memory import available_bytes
from worker_service.cache_engine import (
    CacheEngine,
    CacheSizing,
    block_bytes,
    check_host_memory,
    gpu_cache_bytes,
    size_cache,
)
from worker_service.config import WorkerConfig
from worker_service.grammar_masks import GrammarMasks
from worker_service.input_builder import ModelInputs, build_inputs
from worker_service.model_loader import load_config, model_shape, resolve_dtype
from worker_service.models import build_model
from worker_service.models.linear import slow_dtype_warning
from worker_service.plan import PlanError, StepPlanData, check_block_ids, new_sequence_from_proto, pairs_from_proto
from worker_service.profiler import profile_gpu_memory
from worker_service.prompt_logprobs import PromptLogprobsData, compute_prompt_logprobs
from worker_service.sampler import sample
from worker_service.sequence_cache import CachedSequence, SequenceCache
from worker_service.sharding import local_shape
from worker_service.tensor_parallel import Command, TensorParallelGroup

log = logging.getLogger(__name__)


@dataclass
class SampledTokenData:
    """One sampled token."""

    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What a step produced."""

    step_id: int
    sampled: list[SampledTokenData]
    execute_seconds: float
    prompt_logprobs: list[PromptLogprobsData] = field(default_factory=list)


@dataclass
class ExecutedStepData:
    """A step the worker ran, kept for a new owner that lands it instead of computing it again."""

    plan: StepPlanData
    output: StepOutput
    # (seq id, tokens computed before the step, tokens it computed), in the step's order.
    scheduled: list[tuple[int, int, int]]


# Steps kept: those of the call whose plans the last owner committed, those of the call after it (sent before
# that commit returned, the owner may have died meanwhile) and, under async scheduling, the step before them
# (counted as run in that commit, its result not landed). A call holds one step, or up to
# MAX_NUM_SCHEDULER_STEPS under multi-step scheduling.
KEPT_STEPS = 2 * defaults.MAX_NUM_SCHEDULER_STEPS + 1


def eos_token_ids(config: PretrainedConfig, path: str) -> list[int]:
    """The model's end-of-sequence ids (generation config first, as transformers' generate), for min_tokens."""
    generation = None
    source, kwargs = pretrained_source(path)
    if not kwargs:  # a directory; a GGUF file's ids are in its config
        with contextlib.suppress(OSError):  # no generation_config.json
            generation = GenerationConfig.from_pretrained(source)
    for cfg in (generation, config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


class ModelRunner:
    """Owns the model, the KV cache and the per-sequence cache of one worker.

    With a tensor-parallel group (``tp``) it owns one rank's shard: its share of the heads
    and MLP (sharding.py) and a KV cache of its KV heads; rank 0 forwards each plan and the
    sampled tokens to the other ranks (tensor_parallel.py).
    """

    def __init__(self, config: WorkerConfig, tp: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        # Unseeded random sampling draws from the global generator; --seed makes a run repeatable.
        torch.manual_seed(config.seed)
        hf_config = load_config(config.model)
        self.shape = model_shape(hf_config)
        # A size that does not divide the heads is refused by start_runner, before any rank starts.
        tp_size = tp.world_size if tp is not None else 1
        # What this rank's attention and KV cache hold; self.shape stays the whole model's.
        self.cache_shape = local_shape(self.shape, tp_size)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        if (slow := slow_dtype_warning(self.dtype, self.device)) is not None and (tp is None or tp.rank == 0):
            log.warning("%s", slow)
        max_len = config.max_model_len or self.shape.max_position_embeddings
        if max_len > self.shape.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{self.shape.max_position_embeddings}"
            )
        self.max_model_len = max_len
        self.backend = get_backend(self.device)
        self.backend.prepare(self.dtype)  # the kernels for this dtype's caches, before any step (its first start compiles)
        if config.num_threads:
            # Loading the CPU kernels starts Numba's OpenMP runtime, which resets the calling thread's
            # OpenMP thread count (torch's too) to Numba's default: --num-threads is applied again.
            torch.set_num_threads(config.num_threads)
        rank = tp.rank if tp is not None else 0
        self.model = build_model(hf_config, config.model, self.dtype, self.device, max_len, rank, tp_size,
                                 config.decode_gemv_rows, config.cpu_matmul)
        # Masked until min_tokens; read once, not on every step.
        self.eos_token_ids = eos_token_ids(hf_config, config.model)
        self.grammars = GrammarMasks(config.model, self.shape.vocab_size, self.eos_token_ids)
        # A GPU's cache gets what the largest step leaves of --gpu-memory-utilization; a CPU's is set in GiB.
        device_bytes, memory_flag = config.kv_cache_bytes, "--kv-cache-memory"
        if self.device.type == "cuda" and config.num_gpu_blocks_override is None:
            profile = profile_gpu_memory(
                self.model, self.backend, self.cache_shape, self.dtype, self.device, config.block_size, max_len
            )
            device_bytes = gpu_cache_bytes(profile, config.gpu_memory_utilization)
            memory_flag = "--gpu-memory-utilization"
        sizing = size_cache(
            self.cache_shape, config.block_size, self.dtype, device_bytes,
            config.swap_space_bytes, max_len, config.num_gpu_blocks_override, memory_flag,
        )
        check_host_memory(sizing, block_bytes(self.cache_shape, config.block_size, self.dtype),
                          cache_on_host=self.device.type == "cpu", available=available_bytes(), ranks=tp_size)
        if tp is not None:
            # Block tables are shared by all shards: each holds the fewest blocks any GPU has room for.
            sizing = CacheSizing(tp.min_over_ranks(sizing.num_gpu_blocks), tp.min_over_ranks(sizing.num_cpu_blocks))
        self.cache = CacheEngine(self.cache_shape, sizing, config.block_size, self.dtype, self.device, self.backend)
        self.seqs = SequenceCache(config.block_size)
        self.last_steps: deque[ExecutedStepData] = deque(maxlen=KEPT_STEPS)

    def reset(self) -> None:
        """Forgets every sequence (their blocks are reassigned by the new owner)."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(Command.RESET)
        self.seqs.clear()
        self.last_steps.clear()

    def resume(self, request: worker_pb2.ResumeSequencesRequest) -> list[tuple[int, str]]:
        """A new owner's Resume: replays a planned step's block operations, keeps the sequences whose view
        matches the cache (SequenceCache.resume). Returns (seq id, reason) of the sequences refused."""
        views = [new_sequence_from_proto(s) for s in request.sequences]
        replay = StepPlanData(request.epoch, 0, pairs_from_proto(request.swap_in), pairs_from_proto(request.swap_out),
                              pairs_from_proto(request.copy), views, [], [])
        check_block_ids(replay, self.cache.sizing.num_gpu_blocks, self.cache.sizing.num_cpu_blocks)
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(Command.RESUME, request.SerializeToString())
        self._move_blocks(replay)
        self.last_steps.clear()
        return self.seqs.resume(views, dict(replay.copy))

    @torch.inference_mode()
    def execute(self, plan: StepPlanData, wire: worker_pb2.StepPlan | None = None) -> StepOutput:
        """Applies the plan to the cached state and runs it.

        wire: the plan as received; with tensor parallelism rank 0 forwards it to the other
        ranks, which run the same step (a plan that fails validation fails it on every rank alike).
        """
        start = time.perf_counter()
        check_block_ids(plan, self.cache.sizing.num_gpu_blocks, self.cache.sizing.num_cpu_blocks)
        if self.tp is not None and self.tp.is_driver:
            if wire is None:
                raise RuntimeError("a tensor-parallel rank 0 needs the wire plan to forward to the other ranks")
            self.tp.send(Command.STEP, wire.SerializeToString())
        self.seqs.drop(plan.finished_seq_ids)
        scheduled: list[CachedSequence] = [self.seqs.add(s) for s in plan.new_sequences]
        scheduled += [self.seqs.update(d) for d in plan.cached_sequences]
        if len({s.seq_id for s in scheduled}) != len(scheduled):
            raise PlanError("a sequence is scheduled twice in one plan")
        summary = [(s.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in scheduled]
        self._move_blocks(plan)
        if not scheduled:
            return self._ran(plan, StepOutput(plan.step_id, [], time.perf_counter() - start), summary)

        sampled, prompt_logprobs, sampled_ids = self._compute(scheduled, start)
        for seq in scheduled:
            self.seqs.commit_step(seq, sampled_ids.get(seq.seq_id))
        return self._ran(plan, StepOutput(plan.step_id, sampled, time.perf_counter() - start, prompt_logprobs), summary)

    def _compute(self, scheduled: list[CachedSequence], start: float
                 ) -> tuple[list[SampledTokenData], list[PromptLogprobsData], dict[int, int]]:
        """The forward pass and sampling of a step (its bookkeeping is execute's): what it returns, the
        prompt logprobs, and each sampled token by sequence id. `start`: when the step began."""
        inputs = build_inputs(scheduled, self.cache, self.device)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attn)
        sampled: list[SampledTokenData] = []
        prompt_logprobs: list[PromptLogprobsData] = []
        if self.tp is not None and not self.tp.is_driver:
            # Only rank 0 samples; the others learn its tokens, so their sequence caches stay in step.
            token_ids = self.tp.receive_tokens(len(inputs.sampling_seqs))
        else:
            sampled, prompt_logprobs = self._sample(hidden, inputs)
            token_ids = [s.token_id for s in sampled]
            if self.tp is not None:
                self.tp.send_tokens(token_ids)
        return sampled, prompt_logprobs, {seq.seq_id: token for seq, token in zip(inputs.sampling_seqs, token_ids)}

    def _move_blocks(self, plan: StepPlanData) -> None:
        """A plan's block operations, in the worker's order; before the forward pass, which may read the blocks."""
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy(plan.copy)

    def _ran(self, plan: StepPlanData, out: StepOutput, summary: list[tuple[int, int, int]]) -> StepOutput:
        self.last_steps.append(ExecutedStepData(plan, out, summary))
        return out

    def _sample(self, hidden: torch.Tensor, inputs: ModelInputs) -> tuple[list[SampledTokenData], list[PromptLogprobsData]]:
        """The LM head and the sampler (rank 0 only); a failure tells the other ranks to drop the step."""
        try:
            # Prompt tokens need no logits, unless their request asked for prompt logprobs.
            prompt_logprobs = compute_prompt_logprobs(hidden, self.model.compute_logits, inputs.prompt_logprobs)
            sampled: list[SampledTokenData] = []
            if inputs.sampling_seqs:
                logits = self.model.compute_logits(hidden[inputs.sample_indices])
                seqs = inputs.sampling_seqs
                masks = self.grammars.masks(seqs)
                out = sample(logits, [s.sampling for s in seqs], seqs, self.eos_token_ids, masks)
                for seq, token, logprob, top in zip(seqs, out.token_ids, out.logprobs, out.top_logprobs):
                    sampled.append(SampledTokenData(seq.seq_id, token, logprob, top))
        except Exception:
            if self.tp is not None:
                self.tp.send_tokens(None)  # the other ranks drop the step as well and wait for the next
            raise
        return sampled, prompt_logprobs
