// AVX-512 kernels (F/BW/VL/DQ + FMA + F16C). CMakeLists.txt compiles this file with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx2 -mfma -mf16c; dispatch.cpp calls it only when the CPU and OS support AVX-512.
#include "kernels/cpu/isa_prelude.h"
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__F16C__) || !defined(__FMA__)
#error "isa_avx512.cpp must be compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c"
#endif

#define LMKIT_ISA avx512
#define LMKIT_ISA_NAME "avx512"
#define LMKIT_ISA_TABLE avx512_table
#include "kernels/cpu/isa_body.h"
