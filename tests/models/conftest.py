"""Fixtures of the checkpoint-format tests: the two tiny random Llamas their writers quantize (read-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import make_tiny_model


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    """A Llama whose every linear fits groups of 128 and 128x128 blocks: hidden 256, intermediate 384."""
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model(folder, "llama", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                    num_key_value_heads=2)
    return folder


@pytest.fixture(scope="session")
def odd_llama(tmp_path_factory) -> Path:
    """A Llama whose linears are no whole number of 128x128 blocks and whose inputs are no power of two: hidden 192,
    intermediate 320, k/v 64 rows."""
    folder = tmp_path_factory.mktemp("odd-llama")
    make_tiny_model(folder, "llama", hidden_size=192, intermediate_size=320, num_attention_heads=3,
                    num_key_value_heads=1)
    return folder
