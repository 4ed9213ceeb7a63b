// The x86 instruction-set targets of the kernels' hand-written paths (sketch.cc, fingerprint.cc):
// RANKSCOPE_KERNEL_X86 is defined where they can be built (x86-64, GCC or Clang), and with it
// <immintrin.h> and the function attributes that enable AVX2 or AVX-512 for one function. The
// caller checks the CPU (sketch_internal::BestKernelIsa) before calling such a function.
#ifndef RANKSCOPE_AGENT_SRC_ISA_TARGETS_H_
#define RANKSCOPE_AGENT_SRC_ISA_TARGETS_H_

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RANKSCOPE_KERNEL_X86 1
// GCC 12's AVX-512 intrinsics trip -Wmaybe-uninitialized on their own _mm512_undefined_*()
// (GCC bug 105593, fixed in GCC 13); the warning is located in the header, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define RANKSCOPE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define RANKSCOPE_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c,bmi2")))
#endif

#endif  // RANKSCOPE_AGENT_SRC_ISA_TARGETS_H_
