"""Megatron-style tensor-parallel sharding of a loaded transformers model (as vLLM shards its layers).

Every rank loads the whole checkpoint, then keeps only its share of each
decoder layer and drops the rest before the model moves to the device:

    attention   q/k/v projections  column-parallel, by heads:   rank r keeps heads
                                   [r*H/N, (r+1)*H/N) of the queries and
                                   [r*KV/N, (r+1)*KV/N) of the keys/values
                                   (GQA groups stay whole: query head h uses
                                   KV head h // (H/KV), which lands on the same rank)
                output projection  row-parallel: partial sums, all_reduce, + bias
    MLP         up (and gate)      column-parallel, by intermediate features
                down               row-parallel: partial sums, all_reduce, + bias

So each rank's attention runs over its own heads only and its paged KV cache
holds only its KV heads. Embeddings, norms and the LM head stay replicated:
the simplest layout, and the LM head runs on rank 0 only (it alone samples);
sharding the vocabulary would save memory on large models, not time here.

Head counts that a size does not divide are refused (no KV-head replication).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.pytorch_utils import Conv1D

from worker_service.model_loader import ModelShape, model_shape


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def _mlp_width(config: PretrainedConfig) -> int:
    """Intermediate features of the MLP (split column-wise by the up/gate projections)."""
    if config.model_type == "opt":
        return int(config.ffn_dim)
    if config.model_type == "gpt2":
        return int(config.n_inner or 4 * config.hidden_size)
    return int(config.intermediate_size)


def check_tensor_parallel(config: PretrainedConfig, size: int) -> None:
    """Raises TensorParallelError unless heads, KV heads and MLP width all divide by ``size``."""
    if size == 1:
        return
    shape = model_shape(config)
    counts = {
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate size": _mlp_width(config),
    }
    for name, count in counts.items():
        if count % size:
            raise TensorParallelError(
                f"tensor_parallel_size={size} must divide the model's {name}={count}: each rank holds an equal "
                f"share (KV heads are not replicated); pick a size that divides "
                f"{shape.num_heads} attention heads and {shape.num_kv_heads} KV heads"
            )


def local_shape(shape: ModelShape, size: int) -> ModelShape:
    """The shape one rank's attention and KV cache see: its share of the heads."""
    return dataclasses.replace(shape, num_heads=shape.num_heads // size, num_kv_heads=shape.num_kv_heads // size)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input features are split over the ranks.

    The bias is added once, after the sum (adding it on every rank would count it N times).
    The all_reduce runs over the default process group: the tensor-parallel group.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [out, in / N]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def rank_share(total: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s equal, contiguous share of ``total`` features (heads * head size, MLP width), of ``size``."""
    step = total // size
    return slice(rank * step, (rank + 1) * step)


def _keep_outputs(module: nn.Module, index: torch.Tensor | slice) -> None:
    """Column-parallel in place: keep the output features ``index`` of an nn.Linear or a GPT-2 Conv1D."""
    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(module.weight.data[index].contiguous(), requires_grad=False)
        module.out_features = module.weight.shape[0]
    elif isinstance(module, Conv1D):  # weight [in, out]
        module.weight = nn.Parameter(module.weight.data[:, index].contiguous(), requires_grad=False)
        module.nf = module.weight.shape[1]
    else:
        raise TypeError(f"cannot shard {type(module).__name__} column-wise")
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[index].contiguous(), requires_grad=False)


def _row_parallel(module: nn.Module, rank: int, size: int) -> RowParallelLinear:
    """Row-parallel replacement of an nn.Linear or Conv1D: this rank's slice of the input features."""
    if isinstance(module, nn.Linear):
        weight = module.weight.data[:, rank_share(module.in_features, rank, size)]
    elif isinstance(module, Conv1D):  # weight [in, out]: a row slice, transposed to nn.Linear's [out, in]
        weight = module.weight.data[rank_share(module.weight.shape[0], rank, size)].t()
    else:
        raise TypeError(f"cannot shard {type(module).__name__} row-wise")
    bias = module.bias.data if module.bias is not None else None
    return RowParallelLinear(weight, bias)


def _shard_llama_like(model: nn.Module, shape: ModelShape, rank: int, size: int) -> None:
    """Llama, Mistral, Qwen2: q/k/v/o_proj and gate/up/down_proj (Qwen2's q/k/v biases follow their rows)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_outputs(proj, rank_share(proj.out_features, rank, size))
        attn.o_proj = _row_parallel(attn.o_proj, rank, size)
        mlp.down_proj = _row_parallel(mlp.down_proj, rank, size)


def _shard_opt(model: nn.Module, shape: ModelShape, rank: int, size: int) -> None:
    """OPT: q/k/v/out_proj and fc1/fc2; its attention reshapes by ``num_heads``, so that shrinks too."""
    for layer in model.model.decoder.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, layer.fc1):
            _keep_outputs(proj, rank_share(proj.out_features, rank, size))
        attn.out_proj = _row_parallel(attn.out_proj, rank, size)
        attn.num_heads = shape.num_heads // size
        layer.fc2 = _row_parallel(layer.fc2, rank, size)


def _shard_gpt2(model: nn.Module, shape: ModelShape, rank: int, size: int) -> None:
    """GPT-2: c_attn packs [q | k | v] in one Conv1D, so each third is split by heads."""
    embed = shape.num_heads * shape.head_size
    part = rank_share(embed, rank, size)
    qkv = torch.cat([torch.arange(embed)[part] + i * embed for i in range(3)])
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        _keep_outputs(attn.c_attn, qkv)
        attn.split_size = embed // size  # the forward splits c_attn's output in three by this
        attn.num_heads = shape.num_heads // size
        attn.c_proj = _row_parallel(attn.c_proj, rank, size)
        _keep_outputs(mlp.c_fc, rank_share(mlp.c_fc.nf, rank, size))
        mlp.c_proj = _row_parallel(mlp.c_proj, rank, size)


_SHARDERS: dict[str, Callable[[nn.Module, ModelShape, int, int], None]] = {
    "llama": _shard_llama_like,
    "mistral": _shard_llama_like,
    "qwen2": _shard_llama_like,
    "opt": _shard_opt,
    "gpt2": _shard_gpt2,
}


def shard_model(model: nn.Module, rank: int, size: int) -> None:
    """Keeps rank ``rank``'s share of every decoder layer of ``model`` (in place), of ``size`` ranks."""
    if size == 1:
        return
    config = model.config
    sharder = _SHARDERS.get(config.model_type)
    if sharder is None:
        raise TensorParallelError(
            f"tensor parallelism supports the model types {', '.join(_SHARDERS)}, not {config.model_type!r}"
        )
    sharder(model, model_shape(config), rank, size)
