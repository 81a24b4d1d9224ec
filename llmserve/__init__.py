"""llmserve: a vLLM-style LLM inference server built as gRPC microservices.

`from llmserve import LLM, SamplingParams, StructuredOutputsParams` gives the offline API (llmserve.offline).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> object:
    # Imported on first use: the command line (`llmserve --help`) should not pay for gRPC and friends.
    if name == "LLM":
        from llmserve.offline import LLM

        return LLM
    if name == "SamplingParams":
        from shared.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from shared.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
