"""A simulated worker: the real Worker API, plan validation and sequence bookkeeping, no model.

`llmserve worker --simulate PROFILE` serves exactly what a worker serves (Describe, StreamSteps,
Reset, Resume, registration, leases, metrics) through the same servicer and ModelRunner bookkeeping:
block ids checked against the cache's size, sequences learned, updated, forked, resumed and dropped
as on a GPU. Only the forward pass is replaced: each step takes the time a roofline model of the
profile's model and GPU gives it, and every sampled token is a function of the sequence's last token,
its position and the worker's seed, so a client can predict the outputs (simulated_continuation), also
across a failover or a recompute.

A profile (worker_service/profiles/*.json, or a path) names a model (parameters, layers, heads, KV
heads, head size, bytes per element) and a GPU (memory, bandwidth, peak FLOP/s), the efficiencies
reached on it and a per-step overhead, with the sources of each number. The worker's --model still
gives the tokenizer's vocabulary and the context limit (the scheduler tokenizes with it); the profile
gives the time and the number of KV blocks its GPU would hold.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_service.cache_engine import CacheSizing
from worker_service.config import WorkerConfig
from worker_service.model_loader import load_config, model_shape
from worker_service.model_runner import KEPT_STEPS, ModelRunner, SampledTokenData, eos_token_ids
from worker_service.plan import PlanError, check_pairs
from worker_service.prompt_logprobs import PromptLogprobsData
from worker_service.sequence_cache import CachedSequence, SequenceCache

PROFILES_DIR = Path(__file__).parent / "profiles"
_GIB = 1 << 30
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SimulationProfile:
    """A model on a GPU, as a roofline: step time = overhead + max(bytes / bandwidth, FLOPs / peak)."""

    name: str
    parameters: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    bytes_per_element: int
    memory_gib: float
    memory_bandwidth_gbs: float
    peak_tflops: float
    memory_efficiency: float
    compute_efficiency: float
    step_overhead_ms: float
    gpu_memory_utilization: float

    @classmethod
    def load(cls, name_or_path: str) -> SimulationProfile:
        """A profile by name (worker_service/profiles/NAME.json) or by the path of a JSON file."""
        path = Path(name_or_path)
        if not path.is_file():
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
            raise ValueError(f"no simulation profile {name_or_path!r}: give a JSON file or one of {known}")
        data = json.loads(path.read_text())
        model, gpu = data["model"], data["gpu"]
        profile = cls(
            name=data["name"], parameters=float(model["parameters"]), num_layers=int(model["num_layers"]),
            num_heads=int(model["num_heads"]), num_kv_heads=int(model["num_kv_heads"]),
            head_size=int(model["head_size"]), bytes_per_element=int(model["bytes_per_element"]),
            memory_gib=float(gpu["memory_gib"]), memory_bandwidth_gbs=float(gpu["memory_bandwidth_gbs"]),
            peak_tflops=float(gpu["peak_tflops"]), memory_efficiency=float(data["memory_efficiency"]),
            compute_efficiency=float(data["compute_efficiency"]), step_overhead_ms=float(data["step_overhead_ms"]),
            gpu_memory_utilization=float(data["gpu_memory_utilization"]),
        )
        if not data.get("sources"):
            raise ValueError(f"simulation profile {path} states no sources for its numbers")
        return profile

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_element

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.bytes_per_element

    def num_gpu_blocks(self, block_size: int) -> int:
        """KV blocks that fit beside the weights in the usable share of the GPU's memory."""
        free = self.memory_gib * _GIB * self.gpu_memory_utilization - self.weight_bytes
        blocks = int(free // (self.kv_bytes_per_token * block_size))
        if blocks < 1:
            raise ValueError(f"profile {self.name}: the weights leave no room for a KV block")
        return blocks

    def step_seconds(self, work: list[tuple[int, int]]) -> float:
        """Modelled time of one step; work: (context after the step, tokens computed) per sequence.

        Bytes: the weights once, every sequence's context read from the KV cache, the new tokens' KV
        written. FLOPs: 2 per parameter per token, and attention's QK^T and PV (4 x heads x head size per
        context position per token and layer).
        """
        tokens = sum(new for _, new in work)
        context_tokens = sum(context for context, _ in work)
        moved = self.weight_bytes + (context_tokens + tokens) * self.kv_bytes_per_token
        attention = 4 * self.num_layers * self.num_heads * self.head_size * sum(c * n for c, n in work)
        flops = 2 * self.parameters * tokens + attention
        memory_s = moved / (self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency)
        compute_s = flops / (self.peak_tflops * 1e12 * self.compute_efficiency)
        return self.step_overhead_ms / 1e3 + max(memory_s, compute_s)


def simulated_token(previous: int, position: int, seed: int, vocab_size: int, avoid: frozenset[int]) -> int:
    """The token a simulated worker samples at ``position`` after the token ``previous``: splitmix64 of the
    three, never one of ``avoid`` (end-of-sequence ids: a simulated request runs to its max_tokens).

    A function of the sequence's own tokens, so a recomputed or taken-over sequence continues with the same
    tokens, and a client can predict them (simulated_continuation)."""
    x = (seed * 0x9E3779B97F4A7C15 + previous * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    token = (x ^ (x >> 31)) % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def simulated_continuation(prompt: list[int], num_tokens: int, seed: int, vocab_size: int,
                           avoid: frozenset[int]) -> list[int]:
    """The ``num_tokens`` tokens a simulated worker generates after ``prompt``."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(simulated_token(tokens[-1], len(tokens), seed, vocab_size, avoid))
    return tokens[len(prompt):]


class BlockLedger:
    """The KV cache's block ids without its memory: block moves are checked as CacheEngine checks them."""

    def __init__(self, sizing: CacheSizing) -> None:
        self.sizing = sizing

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        check_pairs("swap_in", pairs, self.sizing.num_cpu_blocks, self.sizing.num_gpu_blocks)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        check_pairs("swap_out", pairs, self.sizing.num_gpu_blocks, self.sizing.num_cpu_blocks)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        check_pairs("copy", pairs, self.sizing.num_gpu_blocks, self.sizing.num_gpu_blocks)


class SimulatedRunner(ModelRunner):
    """ModelRunner's bookkeeping (execute, reset, resume, kept steps) over a modelled forward pass."""

    def __init__(self, config: WorkerConfig, profile: SimulationProfile) -> None:  # noqa: D107 - no super: no model
        self.config, self.tp, self.profile = config, None, profile
        hf_config = load_config(config.model)
        self.shape = self.cache_shape = model_shape(hf_config)
        self.device = f"simulated {profile.name}"
        self.dtype = {2: torch.bfloat16, 4: torch.float32}.get(profile.bytes_per_element, torch.bfloat16)
        self.max_model_len = config.max_model_len or self.shape.max_position_embeddings
        self.eos_token_ids = eos_token_ids(hf_config, config.model)
        self._avoid = frozenset(self.eos_token_ids)
        block_bytes = profile.kv_bytes_per_token * config.block_size
        sizing = CacheSizing(config.num_gpu_blocks_override or profile.num_gpu_blocks(config.block_size),
                             int(config.swap_space_bytes // block_bytes))
        self.cache = BlockLedger(sizing)  # type: ignore[assignment] - the block-move part of CacheEngine
        self.seqs = SequenceCache(config.block_size)
        self.last_steps = deque(maxlen=KEPT_STEPS)

    def _compute(self, scheduled: list[CachedSequence], start: float
                 ) -> tuple[list[SampledTokenData], list[PromptLogprobsData], dict[int, int]]:
        for seq in scheduled:
            if seq.computes_prompt_logprobs:
                raise PlanError(f"sequence {seq.seq_id} asks for prompt logprobs, which a simulated worker "
                                "does not compute")
        modelled = self.profile.step_seconds(
            [(s.num_computed_tokens + s.num_new_tokens, s.num_new_tokens) for s in scheduled])
        sampled: list[SampledTokenData] = []
        for seq in scheduled:
            if seq.samples_this_step:
                token = simulated_token(seq.token_ids[-1], len(seq.token_ids), self.config.seed,
                                        self.shape.vocab_size, self._avoid)
                top = [(token, 0.0)] if seq.sampling.logprobs else []
                sampled.append(SampledTokenData(seq.seq_id, token, 0.0, top))
        # The step ends when the model says, counted from its start: bookkeeping is part of the time.
        time.sleep(max(0.0, start + modelled - time.perf_counter()))
        return sampled, [], {s.seq_id: s.token_id for s in sampled}
