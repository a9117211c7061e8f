// File-scope includes of an ISA translation unit (isa_*.cpp). Only C headers and intrinsics (malloc,
// math functions) and our thread pool's plain declarations: no C++ standard library template or inline
// function may be instantiated in a unit compiled with ISA-specific flags.
#pragma once
// GCC 12 warns about the self-initialised `__Y = __Y` inside its own AVX-512 intrinsic headers
// (GCC bug 105593), at every use site; silence that false positive in the ISA units only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
