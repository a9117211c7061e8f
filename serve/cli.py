"""`lmkit serve api_server | proxy` and `lmkit chat`: thin typer wrappers over run_api_server, run_proxy and
run_chat. FastAPI and uvicorn are imported only when a command runs."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from lmkit.config import EngineConfig, field_help
from lmkit.messages import GenerationConfig
from lmkit.model_path import MODEL_HELP
from lmkit.models.loader import GENERATION_DEFAULT_FIELDS
from lmkit.serve.ray.config import ReplicaConfig

# rich_markup_mode=None: click's plain help, whole option names at any width (see lmkit/cli/main.py)
app = typer.Typer(help="Serve models over HTTP: an OpenAI-compatible api_server, a proxy in front of many, and "
                       "replicas on Ray Serve. `lmkit serve MODEL [OPTIONS]` is `lmkit serve api_server MODEL "
                       "[OPTIONS]`.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)

_E = EngineConfig.field_help()  # the first sentences of EngineConfig's field docstrings
_R = field_help(ReplicaConfig)
# GenerationConfig's field docs; the fields a model's generation_config.json may set default to the model's
_G = {name: text + (" Default: the model's." if name in GENERATION_DEFAULT_FIELDS else "")
      for name, text in field_help(GenerationConfig).items()}


def _keys(values: Optional[List[str]]) -> tuple[str, ...]:
    """--api-keys a --api-keys b, or --api-keys a,b; none given: LMKIT_API_KEYS."""
    from lmkit import env

    return tuple(k.strip() for v in values or [] for k in v.split(",") if k.strip()) or env.api_keys()

# Options of several commands, each written once (typer reads the same OptionInfo in every command).
_HEADER_TIMEOUT = typer.Option(None, help="Seconds a connection may take to send a request's headers; then it is "
                                          "closed. Default 10.")
_BODY_TIMEOUT = typer.Option(None, help="Seconds a request body may take after its headers; then 408. Default 30.")
_DRAIN_TIMEOUT = typer.Option(None, help="On SIGTERM or SIGINT, new requests and /health get 503 at once and "
                                         "requests in progress may finish for this many seconds; then they are "
                                         "cancelled and the server exits 0. Default 30.")
_NO_WEB_UI = typer.Option(False, "--no-web-ui", help="Serve no chat page at / (then / answers 404). The page is open "
                                                     "without an API key; it asks the user for one.")
# Engine and server options of api_server and ray, each written once
LOG_LEVEL = typer.Option("info", help="debug | info | warning | error")
DEVICE = typer.Option("auto", help=_E["device"])
DTYPE = typer.Option("auto", help=_E["dtype"])
MAX_BATCH_SIZE = typer.Option(64, "--max-batch-size", "--max-num-seqs", help=_E["max_batch_size"])
SESSION_LEN = typer.Option(None, "--session-len", "--max-model-len", help=_E["session_len"])
CACHE_BLOCK_SEQ_LEN = typer.Option(64, help=_E["cache_block_seq_len"])
CACHE_MAX_ENTRY_COUNT = typer.Option(None, "--cache-max-entry-count", "--gpu-memory-utilization",
                                     help=_E["cache_max_entry_count"])
MAX_PREFILL_TOKEN_NUM = typer.Option(8192, "--max-prefill-token-num", "--max-num-batched-tokens",
                                     help=_E["max_prefill_token_num"])
DECODE_SLOWDOWN = typer.Option(1.75, help="Prompt pacing: decodes keep at least 1 / this of their speed beside "
                                              "long prompts (0: off; see EngineConfig.decode_slowdown).")
QUANT_POLICY = typer.Option(0, help=_E["quant_policy"])
QUANTIZATION = typer.Option("none", help=_E["quantization"])
ENABLE_PREFIX_CACHING = typer.Option(False, help=_E["enable_prefix_caching"])
KV_CACHE_DIR = typer.Option(None, help=_E["kv_cache_dir"])
KV_CACHE_DISK_GIB = typer.Option(EngineConfig.__dataclass_fields__["kv_cache_disk_gib"].default,
                                 help=_E["kv_cache_disk_gib"])
SPECULATIVE = typer.Option("auto", help=_E["speculative"])
NUM_SPECULATIVE_TOKENS = typer.Option(8, help=_E["num_speculative_tokens"])
DRAFT_MODEL = typer.Option(None, help=_E["draft_model"], show_default=False)
CHAT_TEMPLATE = typer.Option(None, help="A Jinja chat template file replacing the tokenizer's.")
AUTO_TOOL_CHOICE = typer.Option(False, "--enable-auto-tool-choice",
                                help="Accepted for vLLM's command lines: tool_choice auto is always on.")
STREAM_INTERVAL = typer.Option(1, min=1, help="Tokens per chunk of a streamed completion (its first token and "
                                              "its end go at once): larger costs the server (and Ray's "
                                              "transport) less per token, streams less smoothly.")
MAX_BODY_BYTES = typer.Option(None, help="Larger request bodies get 413 (default: 32 bytes per token of context, at "
                                         "least 1 MiB).", show_default=False)
MAX_NEW_TOKENS = typer.Option(None, help=_G["max_new_tokens"])
TEMPERATURE = typer.Option(None, help=_G["temperature"])
TOP_P = typer.Option(None, help=_G["top_p"])
TOP_K = typer.Option(None, help=_G["top_k"])
MIN_P = typer.Option(None, help=_G["min_p"])
REPETITION_PENALTY = typer.Option(None, help=_G["repetition_penalty"])
SEED = typer.Option(None, help=_G["random_seed"])


def model_sampling(path, max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
                   seed) -> GenerationConfig:
    """The model's generation defaults (its generation_config.json) with the sampling options given on top."""
    from lmkit.models import load_model_spec

    return load_model_spec(path).generation_config(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, random_seed=seed)


def _timeouts(header: Optional[float], body: Optional[float], drain: Optional[float]) -> dict[str, float]:
    """GateConfig's timeout fields that were given (the others keep GateConfig's defaults)."""
    given = {"header_timeout_s": header, "body_timeout_s": body, "drain_timeout_s": drain}
    return {name: value for name, value in given.items() if value is not None}


def engine_config(device: str, max_batch_size: int, session_len: Optional[int], cache_block_seq_len: int,
                  cache_max_entry_count: Optional[float], max_prefill_token_num: int, quant_policy: int,
                  kv_policy: Optional[Path], enable_prefix_caching: bool, num_threads: Optional[int],
                  dtype: str = "auto", cpu_binding: str = "auto", speculative: str = "auto",
                  num_speculative_tokens: int = 8, decode_slowdown: float = 1.75, kv_cache_dir: Optional[Path] = None,
                  kv_cache_disk_gib: Optional[float] = None, quantization: str = "none",
                  draft_model: Optional[str] = None) -> EngineConfig:
    store = {} if kv_cache_dir is None else {"kv_cache_dir": str(kv_cache_dir)}
    if kv_cache_disk_gib is not None:
        store["kv_cache_disk_gib"] = kv_cache_disk_gib
    return EngineConfig(device=device, dtype=dtype, max_batch_size=max_batch_size, session_len=session_len,
                        cache_block_seq_len=cache_block_seq_len, cache_max_entry_count=cache_max_entry_count,
                        max_prefill_token_num=max_prefill_token_num, quant_policy=quant_policy,
                        kv_policy=str(kv_policy) if kv_policy is not None else None,
                        enable_prefix_caching=enable_prefix_caching, num_threads=num_threads,
                        cpu_binding=cpu_binding, speculative=speculative,
                        num_speculative_tokens=num_speculative_tokens, draft_model=draft_model,
                        decode_slowdown=decode_slowdown,
                        quantization=quantization, **store)


@app.command("api_server")
def api_server(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: "
                                               "every interface, then set --api-keys)."),
    port: int = typer.Option(23333, help="TCP port."),
    model_name: Optional[str] = typer.Option(None, "--model-name", "--served-model-name",
                                             help="Name clients pass as `model` (default: the folder's name)."),
    api_keys: Optional[List[str]] = typer.Option(None, "--api-keys", "--api-key",
                                                 help="Accepted Bearer tokens (repeat, or comma-separated; default: "
                                                      "the LMKIT_API_KEYS variable); none: no authentication. When "
                                                      "set, every route but /health and the chat page (GET /) "
                                                      "needs one: the API, /metrics, /openapi.json, /docs, /redoc."),
    public_metrics: bool = typer.Option(False, "--public-metrics", help="Serve /metrics without an API key even "
                                                                        "when --api-keys is set (for a scraper)."),
    max_concurrent_requests: Optional[int] = typer.Option(None, help="Generation requests in flight at most; "
                                                                     "more get 429."),
    max_body_bytes: Optional[int] = MAX_BODY_BYTES,
    max_waiting_seqs: Optional[int] = typer.Option(None, help="Sequences (prompts x n) admitted beyond the "
                                                              "--max-batch-size running, to wait for a slot; a "
                                                              "request beyond gets 429. Default: --max-batch-size."),
    header_timeout: Optional[float] = _HEADER_TIMEOUT,
    body_timeout: Optional[float] = _BODY_TIMEOUT,
    drain_timeout: Optional[float] = _DRAIN_TIMEOUT,
    chat_template: Optional[Path] = CHAT_TEMPLATE,
    tool_call_parser: str = typer.Option("auto", help="How the model writes tool calls: hermes, llama3_json, "
                                                      "mistral, qwen3_coder, openai (gpt-oss), gemma4, generic (JSON "
                                                      "taught by a system message); auto: the format its chat "
                                                      "template teaches, else generic; none: requests with tools "
                                                      "get a 400."),
    enable_auto_tool_choice: bool = AUTO_TOOL_CHOICE,
    reasoning_parser: str = typer.Option("auto", help="How the model marks its thinking (sent as "
                                                      "reasoning_content): qwen3, deepseek_r1, openai_gptoss, gemma4; "
                                                      "auto: the one the chat template writes; none: the "
                                                      "thinking stays in content."),
    stream_interval: int = STREAM_INTERVAL,
    proxy_url: Optional[str] = typer.Option(None, help="Register with this lmkit proxy once ready."),
    proxy_admin_key: Optional[str] = typer.Option(None, help="The proxy's admin key, if it has one."),
    advertise_url: Optional[str] = typer.Option(None, help="URL the proxy should use for this server "
                                                           "(default http://HOST:PORT)."),
    no_web_ui: bool = _NO_WEB_UI,
    responses_store_max_bytes: int = typer.Option(0, help="Memory (approximate bytes) for keeping /v1/responses "
                                                          "answers, so that a request may continue one by "
                                                          "previous_response_id; least recently used evicted first. "
                                                          "0: none kept."),
    otlp_traces_endpoint: Optional[str] = typer.Option(
        None, help="Send an OpenTelemetry span per generation and embedding request to this OTLP/HTTP collector "
                   "(http://HOST:4318, or its whole /v1/traces URL), as vLLM's option; needs pip install -e "
                   "\".[otel]\". Default: no tracing."),
    log_level: str = LOG_LEVEL,
    device: str = DEVICE,
    dtype: str = DTYPE,
    max_batch_size: int = MAX_BATCH_SIZE,
    session_len: Optional[int] = SESSION_LEN,
    cache_block_seq_len: int = CACHE_BLOCK_SEQ_LEN,
    cache_max_entry_count: Optional[float] = CACHE_MAX_ENTRY_COUNT,
    max_prefill_token_num: int = MAX_PREFILL_TOKEN_NUM,
    decode_slowdown: float = DECODE_SLOWDOWN,
    quant_policy: int = QUANT_POLICY,
    kv_policy: Optional[Path] = typer.Option(None, help="Per-layer KV precision file (kv_policy.json from "
                                                        "`lmkit lite calibrate`)."),
    quantization: str = QUANTIZATION,
    enable_prefix_caching: bool = ENABLE_PREFIX_CACHING,
    kv_cache_dir: Optional[Path] = KV_CACHE_DIR,
    kv_cache_disk_gib: float = KV_CACHE_DISK_GIB,
    speculative: str = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    draft_model: Optional[str] = DRAFT_MODEL,
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
    cpu_binding: str = typer.Option("auto", help=_E["cpu_binding"]),
) -> None:
    """Serve one model with the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    from lmkit.serve.api_server import ServerConfig, run_api_server
    from lmkit.serve.gate import GateConfig

    config = engine_config(device, max_batch_size, session_len, cache_block_seq_len, cache_max_entry_count,
                           max_prefill_token_num, quant_policy, kv_policy, enable_prefix_caching, num_threads, dtype,
                           cpu_binding, speculative, num_speculative_tokens, decode_slowdown, kv_cache_dir,
                           kv_cache_disk_gib, quantization, draft_model)
    template = None
    if chat_template is not None:
        if not chat_template.is_file():
            raise FileNotFoundError(f"--chat-template {chat_template} is not a file")
        template = chat_template.read_text()
    server = ServerConfig(host=host, port=port, model_name=model_name,
                          gate=GateConfig(api_keys=_keys(api_keys), max_body_bytes=max_body_bytes,
                                          max_concurrent_requests=max_concurrent_requests,
                                          public_metrics=public_metrics,
                                          **_timeouts(header_timeout, body_timeout, drain_timeout)),
                          max_waiting_seqs=max_waiting_seqs, proxy_url=proxy_url, proxy_admin_key=proxy_admin_key,
                          advertise_url=advertise_url, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser, stream_interval=stream_interval, web_ui=not no_web_ui,
                          otlp_traces_endpoint=otlp_traces_endpoint,
                          responses_store_max_bytes=responses_store_max_bytes)
    run_api_server(model, config, server, chat_template=template, log_level=log_level)


@app.command("proxy")
def proxy(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: "
                                               "every interface, then set --api-keys)."),
    port: int = typer.Option(8000, help="TCP port."),
    node: Optional[List[str]] = typer.Option(None, help="A node known at start, http(s)://HOST[:PORT] (repeat for "
                                                        "more)."),
    strategy: str = typer.Option("min_expected_latency",
                                 help="random | min_expected_latency | min_observed_latency | prefix (the node "
                                      "that holds the request's prefix, bounded by load)"),
    admin_key: Optional[str] = typer.Option(None, help="Bearer token that opens /nodes/add, /nodes/remove, "
                                                       "/nodes/status; without it they answer 403."),
    unsafe_open_admin_on_loopback: bool = typer.Option(
        False, "--unsafe-open-admin-on-loopback",
        help="Open /nodes/* without a key to clients on this machine (any local process); needs a loopback "
             "--host."),
    allow_node_network: Optional[List[str]] = typer.Option(
        None, "--allow-node-network",
        help="A network (CIDR, repeat for more) nodes may be on although the proxy refuses it by default: "
             "link-local (169.254.0.0/16, fe80::/10) and cloud metadata addresses, which would hand the host's "
             "credentials to whoever can add a node."),
    api_keys: Optional[List[str]] = typer.Option(None, "--api-keys", "--api-key",
                                                 help="Bearer tokens clients must send (repeat, or comma-separated; "
                                                      "default: the LMKIT_API_KEYS variable); none: open. When set, "
                                                      "every route but /health, /nodes/* and the chat page (GET /) "
                                                      "needs one (/openapi.json, /docs, /redoc too)."),
    max_concurrent_requests: Optional[int] = typer.Option(None, help="Requests in flight at most; more get 429."),
    max_body_bytes: Optional[int] = typer.Option(None, help="Larger request bodies get 413 (default 4 MiB).",
                                                 show_default=False),
    header_timeout: Optional[float] = _HEADER_TIMEOUT,
    body_timeout: Optional[float] = _BODY_TIMEOUT,
    drain_timeout: Optional[float] = _DRAIN_TIMEOUT,
    health_interval: float = typer.Option(3.0, help="Seconds between health checks of every node."),
    no_web_ui: bool = _NO_WEB_UI,
    log_level: str = LOG_LEVEL,
) -> None:
    """Route OpenAI requests across api_servers by model, load and health; retry on another node when one fails."""
    from lmkit.serve.gate import GateConfig
    from lmkit.serve.proxy import STRATEGIES, ProxyConfig, run_proxy

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown routing strategy {strategy!r}; known: {', '.join(sorted(STRATEGIES))}")
    config = ProxyConfig(host=host, port=port, strategy=strategy, nodes=tuple(node or ()), admin_key=admin_key,
                         unsafe_open_admin_on_loopback=unsafe_open_admin_on_loopback,
                         allow_node_networks=tuple(allow_node_network or ()),
                         gate=GateConfig(api_keys=_keys(api_keys), max_body_bytes=max_body_bytes,
                                         max_concurrent_requests=max_concurrent_requests,
                                         **_timeouts(header_timeout, body_timeout, drain_timeout)),
                         health_interval_s=health_interval, web_ui=not no_web_ui)
    run_proxy(config, log_level)


@app.command("ray")
def ray(
    models: Optional[List[str]] = typer.Argument(None, metavar="[NAME=]MODEL...", show_default=False,
                                                 help="Models to serve, each an HF folder, GGUF file, hub id or "
                                                      "smollm2, optionally named (NAME=MODEL; default name: the "
                                                      "folder's); none: the bundled model. Requests go to the one "
                                                      "their `model` names."),
    address: Optional[str] = typer.Option(None, help="Ray cluster to join: auto, or HOST:PORT of its head; default: "
                                                     "RAY_ADDRESS if set, else a local Ray for this command."),
    host: str = typer.Option("127.0.0.1", help="Address Ray's HTTP proxy listens on (0.0.0.0: every interface, then "
                                               "set --api-keys)."),
    port: int = typer.Option(8000, help="TCP port of Ray's HTTP proxy (a cluster's Serve keeps the port it started "
                                        "with)."),
    app_name: str = typer.Option("lmkit", help="Name of the Ray Serve application."),
    route_prefix: str = typer.Option("/", help="Path prefix of the application's routes."),
    min_replicas: int = typer.Option(ReplicaConfig.min_replicas, help=_R["min_replicas"]),
    max_replicas: int = typer.Option(ReplicaConfig.max_replicas, help=_R["max_replicas"]),
    target_ongoing_requests: float = typer.Option(ReplicaConfig.target_ongoing_requests,
                                                  help=_R["target_ongoing_requests"]),
    num_cpus_per_replica: float = typer.Option(ReplicaConfig.num_cpus_per_replica, help=_R["num_cpus_per_replica"]),
    max_ongoing_requests: Optional[int] = typer.Option(None, help=_R["max_ongoing_requests"]),
    upscale_delay: float = typer.Option(ReplicaConfig.upscale_delay_s, help=_R["upscale_delay_s"]),
    downscale_delay: float = typer.Option(ReplicaConfig.downscale_delay_s, help=_R["downscale_delay_s"]),
    look_back_period: float = typer.Option(ReplicaConfig.look_back_period_s, help=_R["look_back_period_s"]),
    request_router: str = typer.Option(ReplicaConfig.request_router, help=_R["request_router"]),
    api_keys: Optional[List[str]] = typer.Option(None, "--api-keys", "--api-key",
                                                 help="Accepted Bearer tokens (repeat, or comma-separated; "
                                                      "default: the LMKIT_API_KEYS variable), checked by every "
                                                      "replica as by api_server; none: no authentication."),
    max_concurrent_requests: Optional[int] = typer.Option(None, help="Generation requests in flight at most per "
                                                                     "replica; more get 429."),
    max_body_bytes: Optional[int] = MAX_BODY_BYTES,
    drain_timeout: Optional[float] = typer.Option(None, help="On SIGTERM or SIGINT the application is deleted: "
                                                             "each replica's requests in progress may finish for "
                                                             "this many seconds. Default 30."),
    chat_template: Optional[Path] = CHAT_TEMPLATE,
    tool_call_parser: str = typer.Option("auto", help="As api_server's --tool-call-parser."),
    enable_auto_tool_choice: bool = AUTO_TOOL_CHOICE,
    reasoning_parser: str = typer.Option("auto", help="As api_server's --reasoning-parser."),
    stream_interval: int = STREAM_INTERVAL,
    log_level: str = LOG_LEVEL,
    device: str = DEVICE,
    dtype: str = DTYPE,
    max_batch_size: int = MAX_BATCH_SIZE,
    session_len: Optional[int] = SESSION_LEN,
    cache_block_seq_len: int = CACHE_BLOCK_SEQ_LEN,
    cache_max_entry_count: Optional[float] = CACHE_MAX_ENTRY_COUNT,
    max_prefill_token_num: int = MAX_PREFILL_TOKEN_NUM,
    decode_slowdown: float = DECODE_SLOWDOWN,
    quant_policy: int = QUANT_POLICY,
    quantization: str = QUANTIZATION,
    enable_prefix_caching: bool = ENABLE_PREFIX_CACHING,
    kv_cache_dir: Optional[Path] = KV_CACHE_DIR,
    kv_cache_disk_gib: float = KV_CACHE_DISK_GIB,
    speculative: str = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    draft_model: Optional[str] = DRAFT_MODEL,
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"] + " On Ray: default "
                                                                                "--num-cpus-per-replica."),
) -> None:
    """Serve models on Ray Serve: replicas of the engine with api_server's routes behind Ray's HTTP proxy,
    autoscaled on ongoing requests between --min-replicas and --max-replicas (needs pip install -e ".[ray]")."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:  # a user-facing problem: the message, no traceback
        raise RuntimeError(f'lmkit serve ray needs Ray Serve: pip install -e ".[ray]" ({e})') from None
    from lmkit.serve.api_server import ServerConfig
    from lmkit.serve.gate import GateConfig
    from lmkit.serve.ray import run_ray

    config = engine_config(device, max_batch_size, session_len, cache_block_seq_len, cache_max_entry_count,
                           max_prefill_token_num, quant_policy, None, enable_prefix_caching, num_threads, dtype,
                           speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                           decode_slowdown=decode_slowdown, kv_cache_dir=kv_cache_dir,
                           kv_cache_disk_gib=kv_cache_disk_gib, quantization=quantization, draft_model=draft_model)
    template = None
    if chat_template is not None:
        if not chat_template.is_file():
            raise FileNotFoundError(f"--chat-template {chat_template} is not a file")
        template = chat_template.read_text()
    server = ServerConfig(host=host, port=port,
                          gate=GateConfig(api_keys=_keys(api_keys), max_body_bytes=max_body_bytes,
                                          max_concurrent_requests=max_concurrent_requests,
                                          **_timeouts(None, None, drain_timeout)),
                          tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                          stream_interval=stream_interval)
    replicas = ReplicaConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                             target_ongoing_requests=target_ongoing_requests,
                             num_cpus_per_replica=num_cpus_per_replica, max_ongoing_requests=max_ongoing_requests,
                             upscale_delay_s=upscale_delay, downscale_delay_s=downscale_delay,
                             look_back_period_s=look_back_period, request_router=request_router)
    run_ray(models or None, config, server, replicas, address=address, app_name=app_name, route_prefix=route_prefix,
            chat_template=template, log_level=log_level)


def chat(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Answer this one message on stdout and exit."),
    system: Optional[str] = typer.Option(None, help="A system message at the start of the conversation."),
    max_new_tokens: Optional[int] = MAX_NEW_TOKENS,
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    min_p: Optional[float] = MIN_P,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: Optional[int] = SEED,
    session_len: Optional[int] = SESSION_LEN,
    num_threads: Optional[int] = typer.Option(None, help=_E["num_threads"]),
    dtype: str = typer.Option(EngineConfig.dtype, help=_E["dtype"]),
    speculative: str = SPECULATIVE,
    draft_model: Optional[str] = DRAFT_MODEL,
    quantization: str = QUANTIZATION,
) -> None:
    """Chat with a model in the terminal (multi-turn, streamed); Ctrl-C stops an answer, /reset, /exit. Sampling
    options left out take the model's values from its generation_config.json (greedy when it sets none)."""
    from lmkit.model_path import resolve_model
    from lmkit.serve.chat import run_chat

    path = resolve_model(model)
    gen = model_sampling(path, max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed)
    raise typer.Exit(run_chat(str(path), EngineConfig(session_len=session_len, num_threads=num_threads, dtype=dtype,
                                                      speculative=speculative, quantization=quantization,
                                                      draft_model=draft_model),
                              gen, system=system, prompt=prompt))
