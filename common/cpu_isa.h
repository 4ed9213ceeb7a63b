// The one CPU check behind every vector kernel of rankscope: the agent's sketch and fingerprint
// kernels (agent/src/sketch.cc, sketch_internal::BestKernelIsa) and the collector's statistics
// kernels (collector/analysis/step_stats.cc). Each maps the level to its own kernels.
//
// Thread safety: thread-safe (the CPU is examined once).
#ifndef RANKSCOPE_COMMON_CPU_ISA_H_
#define RANKSCOPE_COMMON_CPU_ISA_H_

namespace rankscope {

enum class CpuIsaLevel {
  kBaseline,  // no vector extension beyond the target's baseline (SSE2 on x86-64)
  kAvx2,      // AVX2, FMA, BMI2 and F16C
  kAvx512,    // kAvx2 and AVX-512 F, DQ, VL and BW
};

// The highest level this CPU runs; kBaseline off x86-64 or on a compiler without the checks.
CpuIsaLevel BestCpuIsaLevel();

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_CPU_ISA_H_
