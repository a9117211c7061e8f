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

from lmkit.lite.moe import (add_per_layer_input_block, checkpoint_name, layer_awq_map, unfuse_experts,
                            with_per_layer_input)
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
        config = json.loads((folder / "config.json").read_text())
        if "quantization_config" not in config and (folder / "hf_quant_config.json").is_file():
            # ModelOpt's older exports declare their quantization there only: an already quantized checkpoint
            quantization = json.loads((folder / "hf_quant_config.json").read_text()).get("quantization")
            quantization = quantization if isinstance(quantization, dict) else {}
            config["quantization_config"] = {"quant_method": "modelopt", **quantization}
        return config
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder}/config.json cannot be read: {e}") from None


def architecture_of(config: dict, folder: Path) -> str:
    """The single architecture name of an HF config; ValueError when absent."""
    names = config.get("architectures") or []
    if len(names) != 1:
        raise ValueError(f"{folder}/config.json must name exactly one architecture, found {names}")
    return names[0]


def check_not_quantized(config: dict, tensor_names, folder: Path, moe=None) -> None:
    """AlreadyQuantizedError when the config or the tensors say the checkpoint is quantized; gpt-oss's MXFP4 experts
    as shipped (``moe``: its layout, interleaved) are not: lite dequantizes them to float, calibrates, requantizes."""
    qc = config.get("quantization_config")
    if qc and moe is not None and moe.interleaved and isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        qc = None
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
        self.arch.model_fields(raw)  # config.json as the engine reads it: ValueError naming a field it cannot serve
        self.entries = index_folder(self.folder)
        check_not_quantized(raw, self.entries, self.folder, self.awq_map.moe)
        config = AutoConfig.from_pretrained(self.folder)
        if hasattr(config, "quantization_config"):  # gpt-oss's MXFP4: read and dequantized here, not by transformers
            del config.quantization_config
        self.config = text_model_config(config, self.arch)
        with torch.device("meta"):
            # fp32: buffers computed at construction (Gemma's embedding scale) are not rounded to the saved dtype
            self.skeleton = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                             attn_implementation=attention_implementation(self.config))
        self.layers: nn.ModuleList = _get(self.skeleton, self.awq_map.layers)
        if self.awq_map.moe is not None:  # experts as one linear per expert, as the checkpoint has them
            for layer in self.layers:
                unfuse_experts(layer, self.awq_map.moe)
        for layer in self.layers:
            add_per_layer_input_block(layer)
        # Gemma 4 E-models: the per-layer inputs [windows, seq, layers, P] of the last windows ``embed`` embedded
        self.per_layer_inputs: torch.Tensor | None = None
        self._handles: dict[str, Any] = {}
        # gpt-oss: one layer's stacked expert tensors as stored; the last expert's float weight (gate and up share it)
        self._stacked: dict[str, torch.Tensor] = {}
        self._expert: tuple[str, int, torch.Tensor] | None = None

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
        return with_per_layer_input(layer_awq_map(self.awq_map, self.layers[index]), self.layers[index])

    def kv_sharing(self, index: int) -> tuple[str, str] | None:
        """Gemma 4 E-models: ("store" | "reuse", layer type) when decoder layer ``index`` stores its keys and values
        for later layers or reads an earlier layer's (transformers' kv_sharing_modes); else None."""
        attention = getattr(self.layers[index], "self_attn", None)
        if getattr(attention, "is_kv_shared_layer", False):
            return "reuse", attention.layer_type
        if getattr(attention, "store_full_length_kv", False):
            return "store", attention.layer_type
        return None

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
        if layout is not None and layout.interleaved and marker in name:
            return self._expert_of_interleaved(name)
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

    def _expert_of_interleaved(self, name: str) -> torch.Tensor:
        """gpt-oss: expert e's gate / up / down weight or bias ``...experts.{e}.{linear}.{weight | bias}`` out of the
        block's gate_up_proj [E, H, 2I] (gate and up columns interleaved) and down_proj [E, I, H], float or MXFP4
        (``*_blocks`` / ``*_scales``: dequantized by transformers' own converter), and their biases."""
        layout = self.awq_map.moe
        base, rest = name.rsplit(f".{layout.experts}.", 1)
        e, linear, suffix = rest.split(".", 2)
        which = layout.expert_linears.index(linear) if linear in layout.expert_linears else -1
        if not e.isdigit() or which < 0 or suffix not in ("weight", "bias"):
            return self.read_tensor(name)  # raises, naming it
        stacked = f"{base}.{layout.experts}." + ("down_proj" if which == 2 else "gate_up_proj")
        if suffix == "bias":
            tensor = self.read_tensor(stacked + "_bias")[int(e)]
        else:
            tensor = self._float_expert(stacked, int(e)).t()  # [in, out] -> [out, in], as nn.Linear holds it
        return tensor if which == 2 else tensor[which::2]

    def _float_expert(self, stacked: str, e: int) -> torch.Tensor:
        """Expert ``e``'s float [in, out] of gpt-oss's stacked experts ``stacked`` (float, or MXFP4 dequantized by
        transformers' own converter, one expert at a time); the layer's stored tensors are read once."""
        if self._expert is not None and self._expert[:2] == (stacked, e):
            return self._expert[2]
        layer = stacked.rsplit(".", 3)[0]
        if any(not name.startswith(layer + ".") for name in self._stacked):  # a new layer: drop the last one's
            self._stacked.clear()

        def stored(name: str) -> torch.Tensor:
            if name not in self._stacked:
                self._stacked[name] = self.read_tensor(name)
            return self._stacked[name]

        if stacked in self.entries:
            tensor = stored(stacked)[e].float()
        elif stacked + "_blocks" in self.entries:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            blocks, scales = stored(stacked + "_blocks")[e:e + 1], stored(stacked + "_scales")[e:e + 1]
            tensor = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0]
        else:
            return self.read_tensor(stacked)  # raises, naming it
        self._expert = (stacked, e, tensor)
        return tensor

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` in fp32 on the device (a fresh module each call)."""
        return self._materialise(self.layers[index], self.layer_prefix(index))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (fp32) [batch, seq, hidden] of ``input_ids`` [batch, seq], as the model's own
        embedding module computes them (Gemma: scaled by sqrt(hidden_size))."""
        module = self._materialise(_get(self.skeleton, self.awq_map.embed_tokens), self.awq_map.embed_tokens + ".")
        embeds = module(input_ids.to(self.device))
        self.per_layer_inputs = self._per_layer_inputs(input_ids.to(self.device), embeds)
        return embeds

    @torch.no_grad()
    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4 E-models: each layer's per-layer input [batch, seq, layers, P] as the text model computes it
        (its get_per_layer_inputs and project_per_layer_inputs), the table's rows read one by one (E2B's table is
        262144 x 8960); None for any other model."""
        base_name = self.awq_map.layers.rsplit(".", 1)[0]
        base = _get(self.skeleton, base_name)
        per_layer = int(getattr(base, "hidden_size_per_layer_input", 0) or 0)
        if not per_layer:
            return None
        from safetensors import safe_open

        table = self.arch.to_checkpoint(f"{base_name}.embed_tokens_per_layer.weight")
        ids, inverse = input_ids.unique(return_inverse=True)
        with safe_open(self.entries[table].path, framework="pt") as f:
            rows = f.get_slice(table)
            values = torch.cat([rows[i:i + 1] for i in ids.tolist()]).to(self.device, torch.float32)
        shape = (*input_ids.shape, self.num_layers, per_layer)
        tokens = (values[inverse] * base.embed_tokens_per_layer.scalar_embed_scale).reshape(shape)
        projection = self._materialise(base.per_layer_model_projection, f"{base_name}.per_layer_model_projection.")
        norm = self._materialise(base.per_layer_projection_norm, f"{base_name}.per_layer_projection_norm.")
        projected = norm((projection(embeds) * base.per_layer_model_projection_scale).reshape(shape))
        return (projected + tokens) * base.per_layer_input_scale

    # -- layer arguments ----------------------------------------------------------------------------
    def capture_layer_kwargs(self, batch_size: int, seqlen: int) -> list[LayerKwargs]:
        """The keyword arguments HF passes to each decoder layer for a [batch_size, seqlen] batch of
        unpadded sequences starting at position 0 (one dict per layer; tensors on the device)."""
        base = _get(self.skeleton, self.awq_map.layers.rsplit(".", 1)[0])
        embed_name = self.awq_map.embed_tokens.rsplit(".", 1)[1]
        real_embed = nn.Embedding(1, self.config.hidden_size, device=self.device)  # ids below are all 0
        saved = {"embed": getattr(base, embed_name), "layers": list(self.layers),
                 "per_layer": getattr(base, "hidden_size_per_layer_input", None)}
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
                # Gemma 4's shared KV: None (read only by the layers that share KV; LayerRunner gives them their own)
                recorded.append({k: (None if k == "shared_kv_states" else v) for k, v in kwargs.items()
                                 if k not in ("past_key_values", "use_cache")})
                if self.last:
                    raise _Stop
                return hidden_states

        try:
            setattr(base, embed_name, real_embed)
            if saved["per_layer"]:  # Gemma 4 E-models: LayerRunner gives each window its per-layer input
                base.hidden_size_per_layer_input = 0
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
            if saved["per_layer"]:
                base.hidden_size_per_layer_input = saved["per_layer"]
            for i, layer in enumerate(saved["layers"]):
                self.layers[i] = layer
            if rotary_name:
                setattr(base, rotary_name, saved_rotary)
        if len(recorded) != len(self.layers):
            raise RuntimeError(f"captured arguments of {len(recorded)} decoder layers, expected {len(self.layers)}")
        return recorded

    def close(self) -> None:
        self._handles.clear()
