"""The engine, the servers and the CLI run without importing torch or transformers: the tokenizer reads
tokenizer.json with the `tokenizers` library and renders chat templates with jinja2. Checked in fresh
processes, run outside the source tree so that they import the installed package: a script that imports the
servers and generates through a pipeline (text and chat), a real `lmkit serve api_server` answering requests
under ``python -X importtime`` (which logs every import the process ever makes), and the CLI's help."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

HEAVY = ("torch", "transformers")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

SCRIPT = """
import sys
import lmkit.serve.api_server, lmkit.serve.proxy
from lmkit import EngineConfig, GenerationConfig, pipeline

with pipeline(sys.argv[1], EngineConfig(device="cpu", cache_max_entry_count=64, num_threads=1)) as pipe:
    gen = GenerationConfig(max_new_tokens=4)
    assert pipe("hi", gen).generate_token_len == 4
    assert pipe([{"role": "user", "content": "hi"}], gen).generate_token_len == 4
    assert pipe.tokenizer.max_token_chars > 0
print("torch" in sys.modules, "transformers" in sys.modules)
"""


def heavy_imports(importtime_log: str) -> set[str]:
    """The torch / transformers modules named in a ``-X importtime`` log."""
    names = (line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:"))
    return {name for name in names if name.split(".")[0] in HEAVY}


def test_pipeline_and_server_modules_import_neither_torch_nor_transformers(tiny_llama, tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama[0])], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_api_server_process_imports_neither_torch_nor_transformers(tiny_llama, tmp_path):
    from tests.serve.harness import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "importtime.log"
    with open(log, "w") as stderr:  # a file, not a pipe: the log outgrows a pipe's buffer
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "lmkit", "serve", "api_server",
                                 str(tiny_llama[0]), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                                 "--cache-max-entry-count", "64", "--num-threads", "1", "--log-level", "warning",
                                 "--model-name", "tiny"],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=ENV, cwd=tmp_path)
        try:
            wait_healthy(url, proc=proc)
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi ü"}]})
            completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 4, "prompt": "hello", "stream": True})
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert chat.status_code == 200, chat.text
    assert completion.status_code == 200 and "[DONE]" in completion.text, completion.text
    imports = log.read_text()
    assert "lmkit.tokenizer" in imports and "jinja2" in imports, "the log should name every import"
    assert heavy_imports(imports) == set(), sorted(heavy_imports(imports))[:10]


def test_cli_help_imports_neither_torch_nor_transformers(tmp_path):
    for args in (["serve", "api_server", "--help"], ["serve", "proxy", "--help"], ["generate", "--help"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmkit", *args], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env=ENV)
        assert out.returncode == 0 and "Usage" in out.stdout, (args, out.stderr[-2000:])
        assert heavy_imports(out.stderr) == set(), (args, sorted(heavy_imports(out.stderr))[:10])
