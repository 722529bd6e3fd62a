"""The Triton models' processes: one composition root per model of the repository
(``model_repository/*/1/model.py`` forwards to it), the engine core's worker, request parsing and
response sending, drafter proxies, metrics. Everything here runs inside a Python-backend stub."""
