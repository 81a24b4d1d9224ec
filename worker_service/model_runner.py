"""Runs one step plan: block operations, the forward pass, sampling."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kernels import get_backend
from worker_service.attention import METADATA_KWARG
from worker_service.cache_engine import CacheEngine, gpu_cache_bytes, size_cache
from worker_service.config import WorkerConfig
from worker_service.input_builder import build_inputs
from worker_service.model_loader import load_config, load_model, model_shape, resolve_dtype
from worker_service.plan import StepPlanData
from worker_service.profiler import profile_gpu_memory
from worker_service.prompt_logprobs import PromptLogprobsData, compute_prompt_logprobs
from worker_service.sampler import sample
from worker_service.sequence_cache import CachedSequence, PlanError, SequenceCache


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


def eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The model's end-of-sequence ids (generation config first, as transformers' generate), for min_tokens."""
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


class ModelRunner:
    """Owns the model, the KV cache and the per-sequence cache of one worker."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        # Unseeded random sampling draws from the global generator; --seed makes a run repeatable.
        torch.manual_seed(config.seed)
        hf_config = load_config(config.model)
        self.shape = model_shape(hf_config)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        max_len = config.max_model_len or self.shape.max_position_embeddings
        if max_len > self.shape.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{self.shape.max_position_embeddings}"
            )
        self.max_model_len = max_len
        self.backend = get_backend(self.device)
        self.model = load_model(config.model, self.dtype, self.device)
        # Masked until min_tokens; read once, not on every step.
        self.eos_token_ids = eos_token_ids(self.model)
        self.decoder = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        # A GPU's cache gets what the largest step leaves of --gpu-memory-utilization; a CPU's is set in GiB.
        device_bytes, memory_flag = config.kv_cache_bytes, "--kv-cache-memory"
        if self.device.type == "cuda" and config.num_gpu_blocks_override is None:
            profile = profile_gpu_memory(
                self.model, self.backend, self.shape, self.dtype, self.device, config.block_size, max_len
            )
            device_bytes = gpu_cache_bytes(profile, config.gpu_memory_utilization)
            memory_flag = "--gpu-memory-utilization"
        sizing = size_cache(
            self.shape, config.block_size, self.dtype, device_bytes,
            config.swap_space_bytes, max_len, config.num_gpu_blocks_override, memory_flag,
        )
        self.cache = CacheEngine(self.shape, sizing, config.block_size, self.dtype, self.device, self.backend)
        self.seqs = SequenceCache(config.block_size)

    def reset(self) -> None:
        """Forgets every sequence (their blocks are reassigned by the new owner)."""
        self.seqs.clear()

    @torch.inference_mode()
    def execute(self, plan: StepPlanData) -> StepOutput:
        """Applies the plan to the cached state and runs it."""
        start = time.perf_counter()
        self.seqs.drop(plan.finished_seq_ids)
        scheduled: list[CachedSequence] = [self.seqs.add(s) for s in plan.new_sequences]
        scheduled += [self.seqs.update(d) for d in plan.cached_sequences]
        if len({s.seq_id for s in scheduled}) != len(scheduled):
            raise PlanError("a sequence is scheduled twice in one plan")
        # Block moves come before the forward pass: it may read swapped-in or copied blocks.
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy(plan.copy)
        if not scheduled:
            return StepOutput(plan.step_id, [], time.perf_counter() - start)

        inputs = build_inputs(
            scheduled, self.backend, self.cache.key_caches, self.cache.value_caches,
            self.config.block_size, self.device, self.cache.wait_for_layer,
        )
        hidden = self.decoder(
            input_ids=inputs.input_ids.unsqueeze(0),
            position_ids=inputs.positions.unsqueeze(0),
            use_cache=False,
            **{METADATA_KWARG: inputs.attn},
        ).last_hidden_state[0]
        sampled: list[SampledTokenData] = []
        sampled_ids: dict[int, int] = {}
        # Prompt tokens need no logits, unless their request asked for prompt logprobs.
        prompt_logprobs = compute_prompt_logprobs(hidden, self.lm_head, inputs.prompt_logprobs)
        if inputs.sampling_seqs:
            logits = self.lm_head(hidden[inputs.sample_indices]).float()
            out = sample(
                logits, [s.sampling for s in inputs.sampling_seqs], inputs.sampling_seqs, self.eos_token_ids
            )
            for seq, token, logprob, top in zip(inputs.sampling_seqs, out.token_ids, out.logprobs, out.top_logprobs):
                sampled.append(SampledTokenData(seq.seq_id, token, logprob, top))
                sampled_ids[seq.seq_id] = token
        for seq in inputs.seqs:
            self.seqs.commit_step(seq, sampled_ids.get(seq.seq_id))
        return StepOutput(plan.step_id, sampled, time.perf_counter() - start, prompt_logprobs)
