"""tandem: speculative decoding sessions for a glm5_next trunk, served from Triton.

The engine is importable without Triton; `model_repository/*/1/model.py` are thin adapters.
"""

__version__ = "0.1.0"
