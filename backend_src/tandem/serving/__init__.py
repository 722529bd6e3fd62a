"""The serving layer: what runs inside the ``tandem`` Triton model (request parsing, the worker thread,
BLS stage proxies), the shared Triton glue, and the ``tritonserver`` launcher."""
