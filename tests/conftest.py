"""Shared fixtures: the shipped checkpoint, fp32/bf16 trunks, tokenizer and real prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.model.checkpoint import DEFAULT_CHECKPOINT, load_trunk
from tandem.model.tokenizer import ChatTokenizer

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))

CHECKPOINT = Path(os.environ.get("TANDEM_TEST_CHECKPOINT", DEFAULT_CHECKPOINT))


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.fail(f"checkpoint missing: {CHECKPOINT} (run `make model`)")
    return CHECKPOINT


@pytest.fixture(scope="session")
def tokenizer(checkpoint) -> ChatTokenizer:
    return ChatTokenizer(checkpoint / "tokenizer.json")


@pytest.fixture(scope="session")
def trunk_fp32(checkpoint):
    return load_trunk(checkpoint, torch.float32)


@pytest.fixture(scope="session")
def sharegpt_prompts():
    from tandem.tools.data import sharegpt_prompts as sp

    return sp(20, seed=1234, max_chars=600)
