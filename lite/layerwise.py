"""An HF causal LM opened for layer-by-layer work: the module tree is built on the ``meta`` device (no
memory), and each decoder layer is materialised from the safetensors files only when asked for, so
only one layer's weights are ever in working memory.

The arguments HF passes to every decoder layer (causal mask, rotary ``position_embeddings``,
``position_ids``; per layer, since Qwen2 may mix sliding and full attention) are captured by running
the model's own forward with each layer replaced by a recorder, so masks and rotary embeddings are
exactly those of transformers, whatever its version (Gemma 3: global or local rotary tables per layer;
sliding-window masks on the layers that have them).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmkit.lite.moe import checkpoint_name, layer_awq_map, unfuse_experts
from lmkit.models import AwqMap, get_architecture, get_awq_map
from lmkit.models.safetensors_index import index_folder

LayerKwargs = dict[str, Any]


class AlreadyQuantizedError(ValueError):
    """The input checkpoint is quantized already; AWQ needs the floating-point model."""


def read_config(folder: Path) -> dict:
    """config.json of ``folder`` as a dict; ValueError when unreadable, or when ``folder`` is a GGUF file or lmkit's
    view of one (lite reads and writes safetensors checkpoints: the GGUF's weights are llama.cpp's already
    quantized blocks)."""
    from lmkit.models.gguf_file import MARKER, is_gguf_file

    folder = Path(folder)
    if is_gguf_file(folder) or (folder / MARKER).is_file():
        raise ValueError(f"{folder} is a GGUF model: lmkit lite works on a Hugging Face folder (config.json and "
                         "safetensors in floating point); give it the model's HF checkpoint instead (lmkit serves "
                         "the GGUF file as it is)")
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder}/config.json cannot be read: {e}") from None


def architecture_of(config: dict, folder: Path) -> str:
    """The single architecture name of an HF config; ValueError when absent."""
    names = config.get("architectures") or []
    if len(names) != 1:
        raise ValueError(f"{folder}/config.json must name exactly one architecture, found {names}")
    return names[0]


def check_not_quantized(config: dict, tensor_names, folder: Path) -> None:
    """AlreadyQuantizedError when the config or the tensors say the checkpoint is quantized."""
    qc = config.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise AlreadyQuantizedError(
            f"{folder} is already quantized (quantization_config.quant_method={method!r}); "
            "AWQ needs the original floating-point checkpoint"
        )
    packed = [n for n in tensor_names  # AutoAWQ / GPTQ; compressed-tensors (int4 packed, int8 with scales)
              if n.endswith((".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_scale"))]
    if packed:
        raise AlreadyQuantizedError(
            f"{folder} holds packed quantized tensors (e.g. {packed[0]}); "
            "AWQ needs the original floating-point checkpoint"
        )


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path)


def text_model_config(config, arch):
    """The transformers config lite builds its CausalLM from: ``config`` itself, or for a multimodal checkpoint
    (``arch.text_prefix``: the text model under model.language_model) its text_config, tied as the checkpoint is."""
    if arch.text_prefix == "model.":
        return config
    tied = getattr(config, "tie_word_embeddings", None)
    config = config.get_text_config()
    if tied is not None:
        config.tie_word_embeddings = tied
    return config


def attention_implementation(config) -> str:
    """The transformers attention the torch reference runs: "sdpa" where transformers supports it for the
    architecture, else "eager" (Gemma 2: sdpa cannot soft-cap attention logits)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


class LayerwiseModel:
    """The model at ``folder`` with decoder layers loaded on demand (fp32 on ``device``).

    Construction reads config.json and safetensors headers only and validates: a supported
    architecture, not already quantized, float weights.
    """

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(folder)
        self.device = device
        raw = read_config(self.folder)
        self.architecture = architecture_of(raw, self.folder)
        self.awq_map: AwqMap = get_awq_map(self.architecture)
        self.arch = get_architecture(self.architecture)  # a multimodal checkpoint: the text model, its names mapped
        fields = self.arch.model_fields(raw)
        if fields.moe_beside_mlp:
            raise ValueError(f"lmkit lite does not quantize {self.architecture}'s MoE block (routed experts beside the "
                             "dense MLP, Gemma 4 26B-A4B) yet; it quantizes the dense Gemma 4 models. The engine runs "
                             "this one in fp16/bf16/fp32")
        if fields.per_layer_input_size or fields.layer_kv_source:
            raise ValueError(f"lmkit lite does not quantize {self.architecture}'s E-model form (per-layer embeddings, "
                             "layers reading earlier layers' KV: Gemma 4 E2B/E4B) yet: its layer-wise pass carries "
                             "neither; it quantizes the dense Gemma 4 models. The engine runs this one in "
                             "fp16/bf16/fp32")
        self.entries = index_folder(self.folder)
        check_not_quantized(raw, self.entries, self.folder)
        self.config = text_model_config(AutoConfig.from_pretrained(self.folder), self.arch)
        with torch.device("meta"):
            self.skeleton = AutoModelForCausalLM.from_config(self.config,
                                                             attn_implementation=attention_implementation(self.config))
        self.layers: nn.ModuleList = _get(self.skeleton, self.awq_map.layers)
        if self.awq_map.moe is not None:  # experts as one linear per expert, as the checkpoint has them
            for layer in self.layers:
                unfuse_experts(layer, self.awq_map.moe)
        self._handles: dict[str, Any] = {}

    # -- shapes -------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_seqlen(self) -> int:
        """The model's context length (max_position_embeddings)."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def layer_prefix(self, index: int) -> str:
        """Decoder layer ``index``'s module path in the text model (checkpoint names: ``checkpoint_name``)."""
        return f"{self.awq_map.layers}.{index}."

    def layer_awq_map(self, index: int) -> AwqMap:
        """The AWQ map of decoder layer ``index`` (a sparse layer's groups name its experts; lite.moe)."""
        return layer_awq_map(self.awq_map, self.layers[index])

    def checkpoint_name(self, index: int, name: str) -> str:
        """The checkpoint's name of module path ``name`` of decoder layer ``index`` (Mixtral's block_sparse_moe)."""
        return self.arch.to_checkpoint(self.layer_prefix(index) + checkpoint_name(self.awq_map.moe, name))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every quantized linear of every layer -> (out_features, in_features), from the meta skeleton."""
        shapes = {}
        for i, layer in enumerate(self.layers):
            for name in self.layer_awq_map(i).linears:
                module = _get(layer, name)
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"{self.layer_prefix(i)}{name} is {type(module).__name__}, not a Linear")
                shapes[self.layer_prefix(i) + name] = (module.out_features, module.in_features)
        return shapes

    # -- tensors ------------------------------------------------------------------------------------
    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor of the checkpoint, as stored (memory-mapped read)."""
        from safetensors import safe_open

        entry = self.entries.get(name)
        if entry is None:
            raise ValueError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        if entry.path not in self._handles:
            self._handles[entry.path] = safe_open(entry.path, framework="pt")
        return self._handles[entry.path].get_tensor(name)

    def _materialise(self, meta_module: nn.Module, prefix: str) -> nn.Module:
        """A real fp32 copy of ``meta_module`` with weights ``prefix + name`` read from the checkpoint and
        computed buffers (Gemma's embedding scale) set by the model's own initialisation."""
        module = copy.deepcopy(meta_module).to_empty(device=self.device)
        persistent = set(meta_module.state_dict())
        for name, _ in meta_module.named_buffers():
            if name not in persistent:  # computed at construction: transformers' own initialisation sets it
                self.skeleton._init_weights(module.get_submodule(name.rpartition(".")[0]))
        state = {}
        for name, _ in meta_module.state_dict().items():
            stored = self.arch.to_checkpoint(prefix + checkpoint_name(self.awq_map.moe, name))
            tensor = self.read_tensor(stored) if stored in self.entries else self._expert_of_stacked(stored)
            if not tensor.is_floating_point():
                raise ValueError(f"{self.folder}: tensor {stored} is {tensor.dtype}, expected a float weight")
            state[name] = tensor.to(device=self.device, dtype=torch.float32)
        module.load_state_dict(state, strict=True)
        return module.float().eval()

    def _expert_of_stacked(self, name: str) -> torch.Tensor:
        """An expert linear's weight (``...experts.{e}.{gate | up | down}.weight``) from a checkpoint that stacks its
        block's experts (Qwen3.5-MoE as shipped: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
        [E, H, I]); ValueError naming ``name`` when neither form is there."""
        layout = self.awq_map.moe
        marker = f".{layout.experts}." if layout is not None else None
        if marker is None or marker not in name or not name.endswith(".weight"):
            return self.read_tensor(name)  # raises, naming it
        base, rest = name.rsplit(marker, 1)
        e, linear, _ = rest.split(".", 2)
        which = layout.expert_linears.index(linear) if linear in layout.expert_linears else -1
        stacked = f"{base}.{layout.experts}." + ("down_proj" if which == 2 else "gate_up_proj")
        if not e.isdigit() or which < 0 or stacked not in self.entries:
            return self.read_tensor(name)
        tensor = self.read_tensor(stacked)[int(e)]
        if which == 2:
            return tensor
        inter = tensor.shape[0] // 2
        return tensor[:inter] if which == 0 else tensor[inter:]

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` in fp32 on the device (a fresh module each call)."""
        return self._materialise(self.layers[index], self.layer_prefix(index))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (fp32) [batch, seq, hidden] of ``input_ids`` [batch, seq], as the model's own
        embedding module computes them (Gemma: scaled by sqrt(hidden_size))."""
        module = self._materialise(_get(self.skeleton, self.awq_map.embed_tokens), self.awq_map.embed_tokens + ".")
        return module(input_ids.to(self.device))

    # -- layer arguments ----------------------------------------------------------------------------
    def capture_layer_kwargs(self, batch_size: int, seqlen: int) -> list[LayerKwargs]:
        """The keyword arguments HF passes to each decoder layer for a [batch_size, seqlen] batch of
        unpadded sequences starting at position 0 (one dict per layer; tensors on the device)."""
        base = _get(self.skeleton, self.awq_map.layers.rsplit(".", 1)[0])
        embed_name = self.awq_map.embed_tokens.rsplit(".", 1)[1]
        real_embed = nn.Embedding(1, self.config.hidden_size, device=self.device)  # ids below are all 0
        saved = {"embed": getattr(base, embed_name), "layers": list(self.layers)}
        recorded: list[LayerKwargs] = []
        rotary_name = "rotary_emb" if hasattr(base, "rotary_emb") else None
        saved_rotary = getattr(base, rotary_name) if rotary_name else None

        class _Stop(Exception):
            pass

        class _Recorder(nn.Module):
            def __init__(self, last: bool):
                super().__init__()
                self.last = last

            def forward(self, hidden_states, *args, **kwargs):
                if any(a is not None for a in args):  # Gemma 4 passes its per-layer input (None here) by position
                    raise RuntimeError("decoder layers are expected to get their arguments by keyword")
                recorded.append({k: v for k, v in kwargs.items() if k not in ("past_key_values", "use_cache")})
                if self.last:
                    raise _Stop
                return hidden_states

        try:
            setattr(base, embed_name, real_embed)
            if rotary_name:
                with torch.device(self.device):  # rotary tables are computed at construction
                    setattr(base, rotary_name, type(saved_rotary)(config=self.config))
            for i in range(len(self.layers)):
                self.layers[i] = _Recorder(last=i == len(self.layers) - 1)
            ids = torch.zeros(batch_size, seqlen, dtype=torch.long, device=self.device)
            try:
                with torch.no_grad():
                    base(input_ids=ids, use_cache=False)
            except _Stop:
                pass
        finally:
            setattr(base, embed_name, saved["embed"])
            for i, layer in enumerate(saved["layers"]):
                self.layers[i] = layer
            if rotary_name:
                setattr(base, rotary_name, saved_rotary)
        if len(recorded) != len(self.layers):
            raise RuntimeError(f"captured arguments of {len(recorded)} decoder layers, expected {len(self.layers)}")
        return recorded

    def close(self) -> None:
        self._handles.clear()
