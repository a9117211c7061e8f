"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's layer with per-head q/k RMSNorms and
no attention soft-cap; five sliding layers per global one (layer_types, or sliding_window_pattern). Global
layers use rope_theta with its scaling, sliding ones their own table (rope_local_base_freq, no scaling).

config.json layouts: transformers 5 writes rope_parameters keyed by layer type ({"full_attention": {...},
"sliding_attention": {...}}); 4.x wrote rope_theta, rope_scaling (global layers) and rope_local_base_freq.
"""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, ROPE_LOCAL, Architecture, HfConfig, KvCalibHooks, ModelFields, \
    layer_type_rope, layer_types, softcap, windows_of
from lmkit.models.gemma2 import KEY_MAP as GEMMA2_KEY_MAP, gemma_awq_map, gemma_fields
from lmkit.models.llama import QK_NORM_LAYER, layer_keys

NAME = "Gemma3ForCausalLM"
KEY_MAP = {**GEMMA2_KEY_MAP, **layer_keys(QK_NORM_LAYER)}
# transformers.Gemma3TextConfig's defaults of the fields read here
DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "head_dim": 256, "attention_bias": False, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "final_logit_softcapping": None, "use_bidirectional_attention": False,
            "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


def read_config(c: HfConfig) -> ModelFields:
    if c.raw.get("model_type", "gemma3_text") != "gemma3_text" or "text_config" in c.raw:
        raise c.error("model_type", "lmkit serves the Gemma 3 text model (model_type gemma3_text), not the "
                                    "multimodal Gemma3ForConditionalGeneration config")
    fields = gemma_fields(c)
    n, head_dim = fields["num_layers"], fields["head_dim"]
    pattern = int(c.get("sliding_window_pattern"))
    types = layer_types(c, n, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    # Gemma3TextConfig.convert_rope_params_to_dict: rope_scaling updates the global table's parameters.
    params = dict(c.raw.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(c.raw.get("rope_scaling") or {})
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    rope, rotary_dim = layer_type_rope(c, head_dim, full, float(c.get("rope_theta")))
    rope_local, local_dim = layer_type_rope(c, head_dim, sliding, float(c.get("rope_local_base_freq")))
    if local_dim != rotary_dim:
        raise c.error("rope_parameters", "both layer types must rotate the same dims")
    # HF's Gemma 3 attention does not apply attn_logit_softcapping (it never passes it to attention).
    return ModelFields(**fields, rope=rope, rope_local=rope_local, rotary_dim=rotary_dim, has_qk_norm=True,
                       layer_rope=[ROPE_LOCAL if t == "sliding_attention" else ROPE_GLOBAL for t in types],
                       layer_sliding_window=windows_of(types, c.get("sliding_window")),
                       final_logit_softcap=softcap(c.get("final_logit_softcapping")))


KV_CALIB = KvCalibHooks(final_logit_softcap="final_logit_softcapping")
ARCHITECTURE = Architecture(NAME, "gemma", KEY_MAP, read_config, DEFAULTS, gemma_awq_map(NAME), KV_CALIB)
