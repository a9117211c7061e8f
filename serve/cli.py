"""`lmkit serve api_server | proxy` and `lmkit chat`: thin typer wrappers over run_api_server, run_proxy and
run_chat. FastAPI and uvicorn are imported only when a command runs."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from lmkit.config import EngineConfig

app = typer.Typer(help="Serve models over HTTP: an OpenAI-compatible api_server, and a proxy in front of many.",
                  no_args_is_help=True, add_completion=False)

_E = EngineConfig.field_docs()
_MODEL_HELP = "HF model folder (or AWQ folder), hub id, or smollm2; default: the bundled SmolLM2-135M-Instruct."


def _keys(values: Optional[List[str]]) -> tuple[str, ...]:
    """--api-keys a --api-keys b, or --api-keys a,b."""
    return tuple(k.strip() for v in values or [] for k in v.split(",") if k.strip())


def engine_config(device: str, max_batch_size: int, session_len: Optional[int], cache_block_seq_len: int,
                  cache_max_entry_count: float, max_prefill_token_num: int, quant_policy: int,
                  kv_policy: Optional[Path], enable_prefix_caching: bool, num_threads: Optional[int],
                  dtype: str = "auto") -> EngineConfig:
    return EngineConfig(device=device, dtype=dtype, max_batch_size=max_batch_size, session_len=session_len,
                        cache_block_seq_len=cache_block_seq_len, cache_max_entry_count=cache_max_entry_count,
                        max_prefill_token_num=max_prefill_token_num, quant_policy=quant_policy,
                        kv_policy=str(kv_policy) if kv_policy is not None else None,
                        enable_prefix_caching=enable_prefix_caching, num_threads=num_threads)


@app.command("api_server")
def api_server(
    model: Optional[str] = typer.Argument(None, help=_MODEL_HELP),
    host: str = typer.Option("0.0.0.0", help="Address to listen on."),
    port: int = typer.Option(23333, help="TCP port."),
    model_name: Optional[str] = typer.Option(None, help="Name clients pass as `model` (default: the folder's name)."),
    api_keys: Optional[List[str]] = typer.Option(None, help="Accepted Bearer tokens (repeat, or comma-separated); "
                                                            "none: no authentication."),
    max_concurrent_requests: Optional[int] = typer.Option(None, help="Generation requests in flight at most; "
                                                                     "more get 429."),
    max_body_bytes: int = typer.Option(4 * 2**20, help="Larger request bodies get 413."),
    chat_template: Optional[Path] = typer.Option(None, help="A Jinja chat template file replacing the tokenizer's."),
    proxy_url: Optional[str] = typer.Option(None, help="Register with this lmkit proxy once ready."),
    proxy_admin_key: Optional[str] = typer.Option(None, help="The proxy's admin key, if it has one."),
    advertise_url: Optional[str] = typer.Option(None, help="URL the proxy should use for this server "
                                                           "(default http://HOST:PORT)."),
    log_level: str = typer.Option("info", help="debug | info | warning | error"),
    device: str = typer.Option("auto", help=_E["device"]),
    dtype: str = typer.Option("auto", help=_E["dtype"]),
    max_batch_size: int = typer.Option(64, help=_E["max_batch_size"]),
    session_len: Optional[int] = typer.Option(None, help=_E["session_len"]),
    cache_block_seq_len: int = typer.Option(64, help=_E["cache_block_seq_len"]),
    cache_max_entry_count: float = typer.Option(0.8, help=_E["cache_max_entry_count"]),
    max_prefill_token_num: int = typer.Option(8192, help=_E["max_prefill_token_num"]),
    quant_policy: int = typer.Option(0, help=_E["quant_policy"]),
    kv_policy: Optional[Path] = typer.Option(None, help="Per-layer KV precision file (kv_policy.json from "
                                                        "`lmkit lite calibrate`)."),
    enable_prefix_caching: bool = typer.Option(False, help=_E["enable_prefix_caching"]),
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
) -> None:
    """Serve one model with the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    from lmkit.serve.api_server import ServerConfig, run_api_server
    from lmkit.serve.gate import GateConfig

    config = engine_config(device, max_batch_size, session_len, cache_block_seq_len, cache_max_entry_count,
                           max_prefill_token_num, quant_policy, kv_policy, enable_prefix_caching, num_threads, dtype)
    template = None
    if chat_template is not None:
        if not chat_template.is_file():
            raise FileNotFoundError(f"--chat-template {chat_template} is not a file")
        template = chat_template.read_text()
    server = ServerConfig(host=host, port=port, model_name=model_name,
                          gate=GateConfig(api_keys=_keys(api_keys), max_body_bytes=max_body_bytes,
                                          max_concurrent_requests=max_concurrent_requests),
                          proxy_url=proxy_url, proxy_admin_key=proxy_admin_key, advertise_url=advertise_url)
    run_api_server(model, config, server, chat_template=template, log_level=log_level)


@app.command("proxy")
def proxy(
    host: str = typer.Option("0.0.0.0", help="Address to listen on."),
    port: int = typer.Option(8000, help="TCP port."),
    node: Optional[List[str]] = typer.Option(None, help="A node URL known at start (repeat for more)."),
    strategy: str = typer.Option("min_expected_latency",
                                 help="random | min_expected_latency | min_observed_latency"),
    admin_key: Optional[str] = typer.Option(None, help="Bearer token required by /nodes/add, /nodes/remove, "
                                                       "/nodes/status."),
    api_keys: Optional[List[str]] = typer.Option(None, help="Bearer tokens clients must send (repeat, or "
                                                            "comma-separated); none: open."),
    max_concurrent_requests: Optional[int] = typer.Option(None, help="Requests in flight at most; more get 429."),
    max_body_bytes: int = typer.Option(4 * 2**20, help="Larger request bodies get 413."),
    health_interval: float = typer.Option(3.0, help="Seconds between health checks of every node."),
    log_level: str = typer.Option("info", help="debug | info | warning | error"),
) -> None:
    """Route OpenAI requests across api_servers by model, load and health; retry on another node when one fails."""
    from lmkit.serve.gate import GateConfig
    from lmkit.serve.proxy import STRATEGIES, ProxyConfig, run_proxy

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown routing strategy {strategy!r}; known: {', '.join(sorted(STRATEGIES))}")
    config = ProxyConfig(host=host, port=port, strategy=strategy, nodes=tuple(node or ()), admin_key=admin_key,
                         gate=GateConfig(api_keys=_keys(api_keys), max_body_bytes=max_body_bytes,
                                         max_concurrent_requests=max_concurrent_requests),
                         health_interval_s=health_interval)
    run_proxy(config, log_level)


def chat(
    model: Optional[str] = typer.Argument(None, help=_MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Answer this one message on stdout and exit."),
    system: Optional[str] = typer.Option(None, help="A system message at the start of the conversation."),
    max_new_tokens: int = typer.Option(512, help="Tokens per answer at most."),
    temperature: float = typer.Option(0.7, help="0: greedy; > 0: sample at this temperature."),
    top_p: float = typer.Option(0.9, help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: off)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    session_len: Optional[int] = typer.Option(None, help=_E["session_len"]),
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
    dtype: str = typer.Option("auto", help=_E["dtype"]),
) -> None:
    """Chat with a model in the terminal (multi-turn, streamed); Ctrl-C stops an answer, /reset, /exit."""
    from lmkit.messages import GenerationConfig
    from lmkit.serve.chat import run_chat

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                           temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                           random_seed=seed)
    raise typer.Exit(run_chat(model, EngineConfig(session_len=session_len, num_threads=num_threads, dtype=dtype), gen,
                              system=system, prompt=prompt))
