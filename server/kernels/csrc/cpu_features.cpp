// cpu_features.h's answer, from libgcc's CPU model: its checks take in the OS
// saving the AVX and AVX-512 register state (XCR0), so a listed feature is one
// whose instructions run here.  An extension this compiler cannot name
// (avxvnni before GCC 11) reads as absent.
#include "cpu_features.h"

namespace ferrum_cpu {

const Features& cpu_features() {
  static const Features found = [] {
    Features f;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.f16c = __builtin_cpu_supports("f16c");
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
    f.avxvnni = __builtin_cpu_supports("avxvnni");
#endif
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vnni = __builtin_cpu_supports("avx512vnni");
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
    return f;
  }();
  return found;
}

}  // namespace ferrum_cpu
