"""GGUF files (llama.cpp, Ollama, LM Studio) as lmkit models.

A GGUF file holds the weights, the model config (as metadata), the tokenizer and the chat template. lmkit serves
it in place: the tensors are mapped from the file itself (``gguf_tensors``; the engine repacks each quantized block
type losslessly, csrc/model/ggml_blocks.h), and the rest becomes a small folder beside nothing else, made once per
file under ``cache_dir()/gguf`` (``gguf_view``): config.json from the metadata by transformers' GGUF config tables,
tokenizer.json by transformers' GGUF tokenizer conversion, tokenizer_config.json with the chat template,
``gguf_tensors.json`` (the file's tensor table: where each tensor's bytes are) and ``lmkit_gguf.json`` pointing back
at the file. The folder is written by a subprocess (transformers' tokenizer conversion imports torch, which the engine
and the servers must not), or in this process where torch is loaded already (conversion, ``lmkit.lite``, a notebook:
the subprocess would only import it again, ~3 s); that writer is the only one to parse the file's metadata (the
``gguf`` package's reader takes seconds over a vocabulary of 50k-150k strings): a later start reads the view, a
stat and two small JSON files.

Supported: the architectures of ``ARCHITECTURES`` and the tensor types of ``ENGINE_TYPES``; anything else fails
naming the architecture, or the type and the tensor, before the engine commits any memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from lmkit import env
from lmkit.models.safetensors_index import BLOCK_TYPES, CorruptCheckpointError, TensorEntry

MAGIC = b"GGUF"
MARKER = "lmkit_gguf.json"  # in a view folder: which file it describes
TENSORS = "gguf_tensors.json"  # in a view folder: the file's tensor table
VIEW_FORMAT = 3  # bump when the view's recipe changes: views of another format are rebuilt
_GGUF_ERROR_EXIT = 3  # the view subprocess's exit status for a GgufError (its message on stderr)
ENGINE_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)  # the GGML tensor types the engine runs
# general.architecture -> the HF architecture lmkit serves it as; llama.cpp's converter stores these with q/k rows
# permuted for its interleaved rotary (the engine reads them back: ModelConfig.qk_rotary_interleaved)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
                 "gpt-oss": "GptOssForCausalLM", "gemma4": "Gemma4ForCausalLM"}
QK_INTERLEAVED = frozenset({"llama"})
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
               "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next",
               "gpt-oss": "gpt_oss", "gemma4": "gemma4_text"}
# transformers' GGUF config tables by its own spelling of an architecture, and the keys lmkit reads beyond them
# (its qwen3_moe table has no expert width: Qwen3MoeConfig's default, 768, would silently apply to every file)
CONFIG_TABLES = {"qwen3moe": "qwen3_moe"}
EXTRA_CONFIG_KEYS = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"}}
# an architecture whose files with experts are another HF architecture: llama.cpp writes Mixtral as "llama" with
# expert_count, its experts' width as the feed_forward_length
WITH_EXPERTS = {"llama": "MixtralForCausalLM"}
# llama.cpp's Gated DeltaNet hybrids (convert_hf_to_gguf.py; transformers' GGUF loader undoes the same steps): the
# norms HF scales by (1 + w) stored as 1 + w (the engine reads them with no offset; the gated output norm ssm_norm
# is plain in both), A_log stored as ssm_a = -exp(A_log), conv1d squeezed to [channels, taps], dt_bias named
# ssm_dt.bias; Qwen3.5's files also the value heads of every value-indexed tensor tiled
# (ModelConfig.linear_value_heads_tiled) and the multi-token-prediction block written as the layers after the
# decoder's (blk.{num_hidden_layers}.*). Qwen3-Next's keep HF's grouped heads: in_proj_qkvz as it is (ssm_in, older
# files) or split into q | k | v (attn_qkv) and z (attn_gate), in_proj_ba as it is (ssm_ba).
HYBRID_LAYOUT = frozenset({"qwen35", "qwen35moe", "qwen3next"})
TILED_VALUE_HEADS = frozenset({"qwen35", "qwen35moe"})


def gguf_arch_of(cfg: dict) -> str:
    """The GGUF architecture name of a view's config.json."""
    return gguf_arch_of_architecture((cfg.get("architectures") or [""])[0])


def gguf_arch_of_architecture(name: str) -> str:
    by_hf = {hf: arch for arch, hf in (*ARCHITECTURES.items(), *WITH_EXPERTS.items())}
    return by_hf[name]


class GgufError(CorruptCheckpointError):
    """A GGUF file lmkit cannot read or serve; the message names the file and the field, type or tensor."""


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def _reader(path: Path):
    """gguf's reader of the file; GgufError for a file it cannot parse (truncated, wrong magic, unknown types).
    Seconds for a large vocabulary (every string is parsed in Python): only the view subprocess calls it."""
    from gguf import GGUFReader

    _check_magic(path)
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, struct.error) as e:
        raise GgufError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise GgufError(f"{path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:  # a malformed value: treated as absent, the checks below name what is missing
        return default


def gguf_architecture(reader, path: Path) -> str:
    """general.architecture, checked against ARCHITECTURES."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path}: general.architecture={arch!r} is not supported for GGUF files yet; lmkit reads "
                        f"{', '.join(sorted(ARCHITECTURES))} (other architectures: load their HF folder)")
    return arch


def gguf_tensors(reader, path: Path) -> dict[str, TensorEntry]:
    """GGUF tensor name -> where its bytes are, with its HF shape (GGUF lists dimensions innermost first) and its
    GGML type name as dtype, from the file's reader. GgufError naming the tensor for a type the engine cannot run or
    bytes past the end."""
    size = path.stat().st_size
    entries: dict[str, TensorEntry] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ENGINE_TYPES:
            raise GgufError(f"{path}: tensor {t.name!r} has GGML type {kind}, which lmkit cannot run yet "
                            f"(supported: {', '.join(ENGINE_TYPES)})")
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        if t.data_offset + t.n_bytes > size:
            raise GgufError(f"{path}: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} but the file has "
                            f"{size} bytes (truncated download?)")
        entries[t.name] = TensorEntry(str(path), int(t.data_offset), kind, shape)
    return entries


def hf_to_gguf_names(hf_names, gguf_arch: str, num_layers: int) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, by the gguf package's own tensor-name table (a Gated DeltaNet's
    dt_bias under the name llama.cpp's converter gives it first, dt_proj.bias; gpt-oss's sinks with .weight)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = {name: a for a, name in MODEL_ARCH_NAMES.items()}[gguf_arch]
    table = get_tensor_name_map(arch, num_layers)
    out = {}
    for name in hf_names:
        lookup = name[: -len("dt_bias")] + "dt_proj.bias" if name.endswith("linear_attn.dt_bias") else name
        mapped = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        if mapped is not None and name.endswith("self_attn.sinks"):  # llama.cpp's converter writes attn_sinks.weight
            mapped += ".weight"
        if gguf_arch == "gemma4":  # llama.cpp's Gemma4Model: the router's two scale vectors under the tensors they
            # scale, and ".weight" after the names of parameters that have none in HF (layer_scalar, the experts)
            layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
            if name.endswith("router.scale"):
                mapped = f"blk.{layer}.ffn_gate_inp.scale"
            elif name.endswith("router.per_expert_scale"):
                mapped = f"blk.{layer}.ffn_down_exps.scale"
            elif mapped is not None and not mapped.endswith((".weight", ".bias")):
                mapped += ".weight"
        if mapped is not None:
            out[name] = mapped
    return out


# llama.cpp's names of the MTP head's own tensors in its first block (blk.{num_layers}): its converter renames mtp.fc,
# the two pre-fc norms and mtp.norm to eh_proj, enorm, hnorm and shared_head.norm of that layer (gguf's NEXTN_*
# tensors; their norms, (1 + w) ones, stored as 1 + w like the model's), writes a copy into every MTP block, and the
# MTP layers' own tensors as blocks num_layers + j under the decoder's names.
NEXTN_HEAD = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
              "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}
# copies of the model's embedding and lm_head some files carry in the MTP blocks (Qwen's head shares them)
NEXTN_SHARED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")


def mtp_to_gguf_names(hf_names, gguf_arch: str, num_layers: int, mtp_layers: int) -> tuple[dict[str, str], set[str]]:
    """The MTP head's checkpoint names (mtp.*) among ``hf_names`` -> their GGUF names in llama.cpp's nextn blocks
    (blk.{num_layers + j}); and the GGUF names of those blocks left unread (the head's copies in blocks past the
    first, NEXTN_SHARED)."""
    out = {}
    blocks = [f"blk.{num_layers + j}." for j in range(mtp_layers)]
    layer_names = [n for n in hf_names if n.startswith("mtp.layers.") and int(n.split(".")[2]) < mtp_layers]
    decoder_names = {f"model.layers.{num_layers + int(n.split('.')[2])}.{n.split('.', 3)[3]}": n for n in layer_names}
    for model_name, gguf_name in hf_to_gguf_names(decoder_names, gguf_arch, num_layers + mtp_layers).items():
        out[decoder_names[model_name]] = gguf_name
    if mtp_layers:
        out.update({hf: blocks[0] + name for hf, name in NEXTN_HEAD.items() if hf in hf_names})
    skipped = {b + name for b in blocks for name in NEXTN_SHARED} | {
        b + name for b in blocks[1:] for name in NEXTN_HEAD.values()}
    return out, skipped


# ------------------------------------------------------------------------------------------ the view folder
def view_dir(path: Path) -> Path:
    """Where the view of GGUF file ``path`` lives (keyed by its absolute path, size and modification time)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{VIEW_FORMAT}".encode()).hexdigest()[:16]
    return env.cache_dir() / "gguf" / f"{path.stem}-{key}"


def is_view(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def view_source(folder: Path) -> Path:
    """The GGUF file a view folder describes; FileNotFoundError when it is gone, GgufError when it changed since
    the view was made (its tensor table would point at the wrong bytes)."""
    info = json.loads((Path(folder) / MARKER).read_text())
    source = Path(info["gguf"])
    if not source.is_file():
        raise FileNotFoundError(f"{folder}: the GGUF file it was made from, {source}, is gone")
    st = source.stat()
    if (st.st_size, st.st_mtime_ns) != (info.get("size"), info.get("mtime_ns")):
        raise GgufError(f"{folder}: {source} changed since this view of it was made; load the .gguf file itself "
                        "(lmkit makes a new view of it)")
    return source


def view_tensors(folder: Path, source: Path) -> dict[str, TensorEntry]:
    """The tensor table of view folder ``folder`` (``gguf_tensors`` as the view subprocess wrote it), pointing into
    ``source``, its GGUF file as ``view_source`` checked it."""
    table = json.loads((Path(folder) / TENSORS).read_text())
    return {name: TensorEntry(str(source), offset, dtype, tuple(shape)) for name, offset, dtype, shape in table}


def gguf_view(path: str | os.PathLike, in_process: bool | None = None) -> Path:
    """The view folder of GGUF file ``path`` (made once; atomically renamed into place). ``in_process``: write it
    here rather than in a subprocess; None: here exactly when torch is loaded already. GgufError naming the field,
    type or tensor for a file lmkit cannot serve."""
    path = Path(path).expanduser().resolve()
    _check_magic(path)
    target = view_dir(path)
    if is_view(target):
        return target
    if in_process is None:
        in_process = sys.modules.get("torch") is not None  # None there: an import blocked on purpose
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if in_process:
            try:
                write_view(path, work)
            except GgufError:
                raise
            except Exception as e:  # the subprocess's last line, as below
                raise GgufError(f"{path}: reading its config and tokenizer failed: {type(e).__name__}: {e}") from e
        else:
            done = subprocess.run([sys.executable, "-m", "lmkit.models.gguf_file", str(path), str(work)],
                                  capture_output=True, text=True)
            if done.returncode == _GGUF_ERROR_EXIT:
                raise GgufError(done.stderr.strip())
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise GgufError(f"{path}: reading its config and tokenizer failed: {last}")
        with contextlib.suppress(OSError):
            os.replace(work, target)  # a concurrent maker may have won: its view is as good
        if not is_view(target):
            raise GgufError(f"{path}: could not write its view folder {target}")
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def config_from_metadata(reader, path: Path) -> dict:
    """config.json of the file: the metadata through transformers' GGUF config tables (integrations.ggml), or
    for the architectures it reads by a function of its own (the hybrids), that function."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = gguf_architecture(reader, path)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names and (arch == "gpt-oss" or arch in HYBRID_LAYOUT):
        raise GgufError(f"{path}: tensor 'rope_freqs.weight': rope frequency factors in {arch} files are not "
                        "supported")
    if arch in HYBRID_LAYOUT:
        _refuse_unread_rope_scaling(reader, path, f"{arch}.rope.scaling.", read=(), kind=None,
                                    why=f"rope scaling in {arch} files is not supported")
    if arch == "gpt-oss":
        return _gpt_oss_config(reader, path)
    if arch == "gemma4":
        return _gemma4_config(reader, path)
    if arch == "qwen3next":
        return _qwen3next_config(reader, path)
    if arch in HYBRID_LAYOUT:
        return _hybrid_config(reader, path, arch)
    table = CONFIG_TABLES.get(arch, arch)
    cfg = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(table, {}))
    for key, name in {**GGUF_CONFIG_MAPPING[table], **EXTRA_CONFIG_KEYS.get(arch, {})}.items():
        value = _field(reader, f"{arch}.{key}")
        if name is not None and value is not None:
            cfg[name] = value
    experts = _field(reader, f"{arch}.expert_count")
    hf_arch, model_type = ARCHITECTURES[arch], MODEL_TYPES[arch]
    if experts and arch in WITH_EXPERTS:  # Mixtral: its class's names for the expert counts
        used = _field(reader, f"{arch}.expert_used_count")
        if not used:
            raise GgufError(f"{path}: {arch}.expert_count={experts} but no {arch}.expert_used_count")
        cfg.update(num_local_experts=int(experts), num_experts_per_tok=int(used), sliding_window=None)
        hf_arch, model_type = WITH_EXPERTS[arch], "mixtral"
    elif experts and "num_experts" not in cfg:  # a table that does not read the experts: it would drop them
        raise GgufError(f"{path}: {arch}.expert_count={experts}: {arch} files with experts are not supported yet; "
                        "load the HF folder")
    if cfg.get("num_experts"):
        if "moe_intermediate_size" not in cfg:
            raise GgufError(f"{path}: the metadata has no {arch}.expert_feed_forward_length (the experts' width)")
        cfg.setdefault("intermediate_size", 0)  # every layer's MLP a mixture of experts: no dense width stated
    # llama.cpp's head size: attention.key_length when written, else hidden / heads (Qwen3's class default differs)
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        cfg["head_dim"] = int(key_length)
    elif "hidden_size" in cfg and cfg.get("num_attention_heads"):
        cfg.setdefault("head_dim", int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if "vocab_size" not in cfg:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            cfg["vocab_size"] = len(tokens.data)
    for required in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if required not in cfg:
            raise GgufError(f"{path}: the metadata has no {required} ({arch}.* keys missing)")
    cfg.update(architectures=[hf_arch], model_type=model_type, tie_word_embeddings="output.weight" not in names)
    cfg.setdefault("max_position_embeddings", 4096)
    scaled = _scaled_rope(reader, path, arch, cfg)
    if scaled is not None:
        cfg["rope_parameters"] = scaled
    if "head_dim" in cfg and cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"] and arch == "llama":
        raise GgufError(f"{path}: {arch}.rope.dimension_count={cfg['head_dim']} (partial rotary) is not supported")
    cfg.update(_token_ids(reader))
    return cfg


# llama.cpp's rope.scaling.* keys that _scaled_rope reads; the others are refused by name unless they hold the
# value that changes nothing (NEUTRAL_ROPE_SCALING; yarn_ext_factor: -1, llama.cpp's "unset", or what the type
# implies, 1 for yarn and 0 for the others; any other key: 0, 1 or "none", as before they were read)
ROPE_SCALING_KEYS = ("type", "factor", "original_context_length", "attn_factor", "finetuned", "yarn_beta_fast",
                     "yarn_beta_slow")
NEUTRAL_ROPE_SCALING = {"yarn_log_multiplier": (0.0,), "yarn_attn_factor": ()}


def _refuse_unread_rope_scaling(reader, path: Path, prefix: str, read: tuple, kind: str | None, why: str) -> None:
    """GgufError naming the first ``prefix`` key outside ``read`` whose value would change the rope of a file of
    scaling type ``kind``."""
    for key in reader.fields:
        name = key[len(prefix):]
        if not key.startswith(prefix) or name in read:
            continue
        value = _field(reader, key)
        neutral = NEUTRAL_ROPE_SCALING.get(name, (0, 1, "none"))
        if name == "yarn_ext_factor":
            neutral = (-1.0, 1.0) if kind == "yarn" else (-1.0, 0.0)
        if value is not None and value not in neutral:
            raise GgufError(f"{path}: {key}={value!r}: {why}")


def _scaled_rope(reader, path: Path, arch: str, cfg: dict) -> dict | None:
    """The view's rope_parameters when the file's rope is scaled, as llama.cpp reads it: rope.scaling.type
    (linear when only a factor is written, as llama.cpp assumes) with its factor, yarn's original context and
    betas; the rope_freqs tensor (convert_hf_to_gguf.py's form of Llama 3.1's llama3 scaling: a divisor per
    rotary angle) as freq_factors. None when nothing is scaled. GgufError naming a key or type it cannot
    follow (longrope, an attention factor other than 1)."""
    import numpy as np

    prefix = f"{arch}.rope.scaling."
    kind = _field(reader, prefix + "type")
    _refuse_unread_rope_scaling(reader, path, prefix, ROPE_SCALING_KEYS, kind, "not supported")
    factor = _field(reader, prefix + "factor", _field(reader, f"{arch}.rope.scale_linear"))
    attn_factor = _field(reader, prefix + "attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise GgufError(f"{path}: {prefix}attn_factor={attn_factor!r}: only 1 is supported")
    theta = float(cfg.get("rope_theta", 10000.0))
    if kind is None and factor not in (None, 0, 0.0, 1.0):  # llama.cpp's default type; "none" never scales
        kind = "linear"
    if kind in ("linear", "yarn") and (not factor or float(factor) <= 0):
        raise GgufError(f"{path}: {prefix}type={kind!r} needs {prefix}factor > 0, got {factor!r}")
    if kind in (None, "none"):
        params = None
    elif kind == "linear":
        params = {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    elif kind == "yarn":
        original = _field(reader, prefix + "original_context_length") or cfg["max_position_embeddings"]
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                  "original_max_position_embeddings": int(original), "truncate": True,
                  "beta_fast": float(_field(reader, prefix + "yarn_beta_fast", 32.0)),
                  "beta_slow": float(_field(reader, prefix + "yarn_beta_slow", 1.0))}
    else:
        raise GgufError(f"{path}: {prefix}type={kind!r}: {arch} files with this rope scaling are not supported "
                        "(linear and yarn are); load the HF folder")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(freqs.data).astype(np.float32).reshape(-1)
        if freqs.tensor_type.name not in ("F32", "F16") or not np.all(np.isfinite(values) & (values > 0)):
            raise GgufError(f"{path}: rope_freqs.weight must hold positive F32 or F16 factors "
                            f"({freqs.tensor_type.name})")
        params = {**(params or {"rope_type": "default", "rope_theta": theta}), "freq_factors": values.tolist()}
    return params


def _hybrid_config(reader, path: Path, arch: str) -> dict:
    """config.json of a hybrid's file by transformers' own reader of its metadata (gguf_config_mapping), plus
    mtp_num_hidden_layers: the multi-token-prediction layers written after the decoder's."""
    from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS

    metadata = {key: _field(reader, key) for key in reader.fields
                if key.startswith((f"{arch}.", "general."))
                or (key.startswith("tokenizer.ggml.") and key.endswith("_token_id"))}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    metadata["tokenizer.ggml.tokens"] = len(tokens.data) if tokens is not None else None
    names = tuple(t.name for t in reader.tensors)
    try:
        cfg = GGUF_CONFIG_ARCHS[arch](metadata, names)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise GgufError(f"{path}: the metadata of this {arch} file is incomplete ({type(e).__name__}: {e})") from None
    if cfg.get("vocab_size") is None:
        raise GgufError(f"{path}: the metadata has no tokenizer.ggml.tokens (the vocabulary)")
    cfg.update(architectures=[ARCHITECTURES[arch]], model_type=MODEL_TYPES[arch],
               mtp_num_hidden_layers=int(metadata.get(f"{arch}.nextn_predict_layers") or 0))
    return {k: v for k, v in cfg.items() if v is not None}


def _qwen3next_config(reader, path: Path) -> dict:
    """config.json of a Qwen3-Next file as llama.cpp's converter writes it (Qwen3NextModel; transformers has no GGUF
    table for it): Qwen3.5's keys without the rope sections and the MTP layers; every layer sparse, its top-k
    weights renormalized (llama.cpp's graph for this architecture), the shared expert's width its own key."""
    arch = "qwen3next"
    need = _needed(reader, path, arch)
    tokens = _vocabulary(reader, path)
    names = {t.name for t in reader.tensors}
    head_dim, value_heads = int(need("attention.key_length")), int(need("ssm.time_step_rank"))
    if value_heads <= 0 or head_dim <= 0:
        raise GgufError(f"{path}: {arch}.ssm.time_step_rank and {arch}.attention.key_length must be > 0")
    cfg = dict(architectures=[ARCHITECTURES[arch]], model_type=MODEL_TYPES[arch], vocab_size=len(tokens.data),
               hidden_size=int(need("embedding_length")), num_hidden_layers=int(need("block_count")),
               num_attention_heads=int(need("attention.head_count")),
               num_key_value_heads=int(need("attention.head_count_kv")), head_dim=head_dim,
               rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
               max_position_embeddings=int(need("context_length")),
               full_attention_interval=int(_field(reader, f"{arch}.full_attention_interval", 4)),
               linear_conv_kernel_dim=int(need("ssm.conv_kernel")), linear_key_head_dim=int(need("ssm.state_size")),
               linear_num_key_heads=int(need("ssm.group_count")), linear_num_value_heads=value_heads,
               linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
               intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", 0) or 0),
               num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
               moe_intermediate_size=int(need("expert_feed_forward_length")),
               shared_expert_intermediate_size=int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
                                                   or 0),
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               tie_word_embeddings="output.weight" not in names,
               rope_parameters={"rope_type": "default", "rope_theta": float(need("rope.freq_base")),
                                "partial_rotary_factor": int(need("rope.dimension_count")) / head_dim})
    cfg.update(_token_ids(reader))
    return cfg


def _vocabulary(reader, path: Path):
    """The file's tokenizer.ggml.tokens field; GgufError when it has none."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GgufError(f"{path}: the metadata has no tokenizer.ggml.tokens (the vocabulary)")
    return tokens


def _token_ids(reader) -> dict:
    """bos_token_id, eos_token_id and pad_token_id as the file's tokenizer.ggml.* metadata states them."""
    ids = {}
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            ids[name] = int(value)
    return ids


def _needed(reader, path: Path, arch: str):
    """key -> the value of metadata key ``{arch}.{key}``; GgufError naming it when the file has none."""
    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GgufError(f"{path}: the metadata has no {arch}.{key}")
        return value
    return need


def _gpt_oss_config(reader, path: Path) -> dict:
    """config.json of a gpt-oss file as llama.cpp's converter writes it (GptOssModel): the usual shape keys, the
    sliding window, the experts' width and yarn's factor and original context (its betas and truncation are gpt-oss's
    own, which llama.cpp also assumes); transformers has no GGUF table for it."""
    arch = "gpt-oss"

    need = _needed(reader, path, arch)

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling != "yarn":
        raise GgufError(f"{path}: {arch}.rope.scaling.type={scaling!r}: gpt-oss files use yarn")
    tokens = _vocabulary(reader, path)
    names = {t.name for t in reader.tensors}
    cfg = dict(architectures=[ARCHITECTURES[arch]], model_type=MODEL_TYPES[arch], vocab_size=len(tokens.data),
               hidden_size=int(need("embedding_length")), num_hidden_layers=int(need("block_count")),
               intermediate_size=int(need("expert_feed_forward_length")),
               num_attention_heads=int(need("attention.head_count")),
               num_key_value_heads=int(need("attention.head_count_kv")), head_dim=int(need("attention.key_length")),
               rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
               max_position_embeddings=int(need("context_length")), num_local_experts=int(need("expert_count")),
               num_experts_per_tok=int(need("expert_used_count")), sliding_window=int(need("attention.sliding_window")),
               tie_word_embeddings="output.weight" not in names, attention_bias=True,
               rope_parameters={"rope_type": "yarn", "rope_theta": float(need("rope.freq_base")),
                                "factor": float(need("rope.scaling.factor")),
                                "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
    cfg.update(_token_ids(reader))
    # harmony ends an answer with <|return|> and a tool call with <|call|> (llama.cpp's vocabulary counts both as
    # end of generation by their text; the file names one eos): both stop, beside the file's own
    words = tokens.contents()
    stops = [words.index(t) for t in ("<|return|>", "<|call|>") if t in words]
    eos = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    if stops:
        cfg["eos_token_id"] = eos + [i for i in stops if i not in eos]
    return cfg


def _gemma4_config(reader, path: Path) -> dict:
    """config.json of a Gemma 4 file as llama.cpp's converter writes it (Gemma4Model): the global layers' head size
    as attention.key_length (the sliding ones' as key_length_swa), the layer kinds as a per-layer bool array
    (sliding_window_pattern), KV heads as a scalar or a per-layer array, the global layers' proportional RoPE as a
    rope_freqs tensor (1 on the rotated angles, 1e30 on the others), attention_k_eq_v as full layers without
    attn_v, the MoE block as the expert counts. Read back into the HF config's fields (per_layer_config for the
    global layers' shape). The E-models' (E2B, E4B): embedding_length_per_layer_input (0 on the others) with the
    per-layer tensors as HF's under gguf's names (per_layer_token_embd [vocab rows, layers * P], not cut to the
    vocabulary as token_embd is), attention.shared_kv_layers (0 on the others; the sharing layers have no attn_k /
    attn_v), and use_double_wide_mlp as feed_forward_length per layer (the sharing layers' twice the others')."""
    import numpy as np

    arch = "gemma4"

    need = _needed(reader, path, arch)

    tokens = _vocabulary(reader, path)
    names = {t.name for t in reader.tensors}
    n = int(need("block_count"))
    pattern = need("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise GgufError(f"{path}: {arch}.attention.sliding_window_pattern must hold one bool per layer ({n})")
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    shared = int(_field(reader, f"{arch}.attention.shared_kv_layers") or 0)
    ff, double_wide = need("feed_forward_length"), False
    if isinstance(ff, list):  # use_double_wide_mlp: the last `shared` layers' MLP twice as wide
        ff, first = [int(x) for x in ff], int(ff[0]) if ff else 0
        if len(ff) != n or ff not in ([first] * n, [first] * (n - shared) + [2 * first] * shared):
            raise GgufError(f"{path}: {arch}.feed_forward_length per layer must be one width, or with "
                            f"use_double_wide_mlp twice it on the last {shared} (KV-sharing) layers; got {ff}")
        double_wide, ff = ff != [first] * n, first
    per_layer = int(_field(reader, f"{arch}.embedding_length_per_layer_input") or 0)
    ple_table = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    if per_layer and ple_table is None:
        raise GgufError(f"{path}: {arch}.embedding_length_per_layer_input={per_layer} but the file has no "
                        "per_layer_token_embd.weight")
    head_dim, global_dim = int(need("attention.key_length_swa")), int(need("attention.key_length"))
    kv = need("attention.head_count_kv")
    kv_of = [int(kv[i]) for i in range(n)] if isinstance(kv, list) else [int(kv)] * n
    sliding_kv = {kv_of[i] for i, t in enumerate(types) if t == "sliding_attention"} or {kv_of[0]}
    if len(sliding_kv) != 1:
        raise GgufError(f"{path}: {arch}.attention.head_count_kv differs between sliding layers: {sorted(sliding_kv)}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    own_kv = [i for i in full if i < n - shared]  # the KV-sharing layers have neither attn_k nor attn_v
    without_v = [i for i in own_kv if f"blk.{i}.attn_v.weight" not in names]
    if without_v and without_v != own_kv:
        raise GgufError(f"{path}: layers {without_v} have no attn_v but global layers "
                        f"{sorted(set(own_kv) - set(without_v))} do: attention_k_eq_v is all global layers or none")
    rotated = 1.0
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and global_dim:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if values.size != global_dim // 2 or not np.all((values == 1.0) | (values >= 1e29)):
            raise GgufError(f"{path}: rope_freqs.weight must hold {global_dim // 2} factors of 1 or 1e30 (Gemma 4's "
                            "proportional RoPE)")
        rotated = float(np.count_nonzero(values == 1.0) * 2) / global_dim
    swa_rot = _field(reader, f"{arch}.rope.dimension_count_swa")
    sliding_rope = {"rope_type": "default", "rope_theta": float(need("rope.freq_base_swa"))}
    if swa_rot is not None and int(swa_rot) != head_dim:
        sliding_rope["partial_rotary_factor"] = int(swa_rot) / head_dim
    cfg = dict(architectures=[ARCHITECTURES[arch]], model_type=MODEL_TYPES[arch], vocab_size=len(tokens.data),
               hidden_size=int(need("embedding_length")), num_hidden_layers=n, intermediate_size=int(ff),
               num_attention_heads=int(need("attention.head_count")), num_key_value_heads=sliding_kv.pop(),
               head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
               max_position_embeddings=int(need("context_length")),
               sliding_window=int(need("attention.sliding_window")), layer_types=types,
               per_layer_config={str(i): {"head_dim": global_dim, "num_key_value_heads": kv_of[i]} for i in full},
               attention_k_eq_v=bool(without_v),
               hidden_size_per_layer_input=per_layer,
               vocab_size_per_layer_input=int(ple_table.shape[-1]) if per_layer else None,
               num_kv_shared_layers=shared, use_double_wide_mlp=double_wide,
               final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping"),
               tie_word_embeddings="output.weight" not in names,
               rope_parameters={"sliding_attention": sliding_rope,
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": rotated,
                                                   "rope_theta": float(need("rope.freq_base"))}})
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        cfg.update(enable_moe_block=True, num_experts=int(experts), top_k_experts=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")))
    cfg.update(_token_ids(reader))
    return {k: v for k, v in cfg.items() if v is not None}


def write_view(path: Path, out: Path) -> None:
    """Writes the view folder of GGUF file ``path`` into ``out`` (imports transformers, and with it torch).
    The cheap checks first: a file lmkit cannot serve fails before the tokenizer conversion."""
    reader = _reader(path)
    gguf_architecture(reader, path)
    tensors = gguf_tensors(reader, path)
    cfg = config_from_metadata(reader, path)
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    arch, tokenizer, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    backend.save(str(out / "tokenizer.json"))
    tokenizer_config.update(extra)
    tokenizer_config = {k: v for k, v in tokenizer_config.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    table = [[name, e.offset, e.dtype, list(e.shape)] for name, e in tensors.items()]
    (out / TENSORS).write_text(json.dumps(table) + "\n")
    st = path.stat()
    (out / MARKER).write_text(json.dumps({"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                          "format": VIEW_FORMAT}) + "\n")
    for p in (out, *out.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)


if __name__ == "__main__":  # python -m lmkit.models.gguf_file FILE OUT: gguf_view's subprocess
    try:
        write_view(Path(sys.argv[1]), Path(sys.argv[2]))
    except GgufError as e:
        print(e, file=sys.stderr)
        sys.exit(_GGUF_ERROR_EXIT)
