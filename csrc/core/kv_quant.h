// A layer's KV-cache precision as the user asks for it: the backend's full precision, int8 or int4. The
// one encoding of that choice in the engine; the user-facing spellings (LMDeploy's quant_policy 0 / 8 / 4,
// kv_policy.json's per-layer bits) are translated into it once, in lmkit/config.py. How a backend stores
// "full precision" (fp32, bf16, the activation dtype) is its own business: ops::KVLayer::bits.
#pragma once
#include <stdint.h>

namespace lmkit {

enum class KVQuant : int32_t { kNone = 0, kInt8 = 8, kInt4 = 4 };

}  // namespace lmkit
