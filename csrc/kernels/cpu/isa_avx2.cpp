// AVX2 kernels (AVX2 + FMA + F16C). CMakeLists.txt compiles this file with -mavx2 -mfma -mf16c; dispatch.cpp
// calls it only when the CPU supports all three.
#include "kernels/cpu/isa_prelude.h"
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "isa_avx2.cpp must be compiled with exactly -mavx2 -mfma -mf16c"
#endif

#define LMKIT_ISA avx2
#define LMKIT_ISA_NAME "avx2"
#define LMKIT_ISA_TABLE avx2_table
#include "kernels/cpu/isa_body.h"
