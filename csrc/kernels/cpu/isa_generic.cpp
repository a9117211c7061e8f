// Generic kernels: plain C++ with 4-lane GCC vector extensions, for any CPU (the baseline flags only).
#include "kernels/cpu/isa_prelude.h"


#define LMKIT_ISA generic
#define LMKIT_ISA_NAME "generic"
#define LMKIT_ISA_TABLE generic_table
#include "kernels/cpu/isa_body.h"
