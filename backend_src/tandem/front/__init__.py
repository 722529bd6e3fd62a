"""The OpenAI-compatible front (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``): a process of its
own (uvicorn, started by ``make serve`` beside tritonserver), a gRPC streaming client of the ``tandem`` model as
any Triton client is. It imports no engine code."""
