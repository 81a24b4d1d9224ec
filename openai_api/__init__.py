"""OpenAI-compatible HTTP front: a stateless client of the scheduler's public gRPC API.

    HTTP client ──/v1/...──▶ openai_api (FastAPI) ──gRPC Generate──▶ any scheduler replica

It holds no engine state: every request becomes one `Generate` call per prompt, so admission,
validation and the chat template are the scheduler's, exactly as for gRPC clients, and the front
scales (and restarts) independently of the schedulers.
"""
