"""llmserve: a vLLM-style LLM inference server built as gRPC microservices."""

__version__ = "0.1.0"
