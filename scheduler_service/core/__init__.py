"""Pure scheduling core: sequences, KV-block bookkeeping and the batch scheduler.

Nothing in this package does I/O, reads clocks or imports torch/gRPC/Redis, so
it can be unit-tested exhaustively and driven by any engine loop.
"""
