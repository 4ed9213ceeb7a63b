#include "common/cpu_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RANKSCOPE_CPU_X86 1
#include <cpuid.h>
#endif

namespace rankscope {
namespace {

CpuIsaLevel DetectCpuIsaLevel() {
#ifdef RANKSCOPE_CPU_X86
  __builtin_cpu_init();
  unsigned eax, ebx, ecx, edx;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  if (!f16c || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("bmi2") ||
      !__builtin_cpu_supports("fma")) {
    return CpuIsaLevel::kBaseline;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
    return CpuIsaLevel::kAvx512;
  }
  return CpuIsaLevel::kAvx2;
#else
  return CpuIsaLevel::kBaseline;
#endif
}

}  // namespace

CpuIsaLevel BestCpuIsaLevel() {
  static const CpuIsaLevel level = DetectCpuIsaLevel();
  return level;
}

}  // namespace rankscope
