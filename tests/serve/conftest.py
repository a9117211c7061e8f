"""Fixtures of the serving tests: real uvicorn servers on loopback ports (tests/serve/harness.py) in front of tiny
random models."""

from __future__ import annotations

import pytest

from tests.factories import FAMILIES, make_family_model, make_tiny_model
from tests.serve.harness import FAMILY_ENGINE, TOOL_FAMILIES, ServerThread, tiny_async_engine


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama):
    with tiny_async_engine(tiny_llama[0]) as engine:
        yield engine


@pytest.fixture(scope="session")
def api_server(tiny_engine):
    """The tiny model served as `tiny`, no keys, no limits."""
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny")))
    yield server
    server.stop()


@pytest.fixture()
def client(api_server):
    import openai

    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_pipe):
    """The bundled SmolLM2 served as `smollm2` (the engine of smollm2_pipe)."""
    from lmkit import AsyncEngine
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(AsyncEngine(engine=smollm2_pipe.engine), ServerConfig(model_name="smollm2")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slow_llama(tmp_path_factory):
    """A wider random model (hidden 512, 4 layers: a few ms per step) so that a request takes seconds."""
    folder = tmp_path_factory.mktemp("slow-llama")
    make_tiny_model(folder, "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)
    return folder


@pytest.fixture(scope="session")
def slow_engine(slow_llama):
    from lmkit import AsyncEngine, EngineConfig

    engine = AsyncEngine(slow_llama, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=256,
                                                  max_batch_size=8, cache_block_seq_len=16, session_len=512,
                                                  num_threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def slow_server(slow_engine):
    """The slow model served as `tiny`; yields the server and its engine."""
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(slow_engine, ServerConfig(model_name="tiny")))
    yield server, slow_engine.engine
    server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One api_server per chat family (its tool parser and reasoning parser chosen from its template)."""
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app

    made = {}
    try:
        for name in [*TOOL_FAMILIES, "deepseek_r1"]:
            folder = make_family_model(tmp_path_factory.mktemp(name), FAMILIES[name])
            engine = AsyncEngine(folder, EngineConfig(**FAMILY_ENGINE))
            made[name] = (engine, ServerThread(create_app(engine, ServerConfig(model_name=name))))
            made[name][1].engine = engine
        yield {name: server for name, (_, server) in made.items()}
    finally:
        for engine, server in made.values():
            server.stop()
            engine.close()
