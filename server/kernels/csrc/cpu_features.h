// What this CPU (and its OS) can run: the one place the kernels ask.  Every file
// that picks inner loops by instruction set reads cpu_features() and nothing
// else; cpu_features.cpp alone asks the CPU (tests/component/kernels/test_cpu_probe.py
// keeps it so).  The caps (ferrum_woq/ferrum_qact set_max_isa) then choose among
// what is here, so tests run every path this CPU has.
#pragma once

namespace ferrum_cpu {

struct Features {
  bool avx2 = false, fma = false, f16c = false, avxvnni = false;
  bool avx512f = false, avx512vl = false, avx512bw = false, avx512vnni = false, avx512bf16 = false;
};

// Found once per process; all false off x86-64.
const Features& cpu_features();

}  // namespace ferrum_cpu

// The inner loops every file's cap allows (woq.cpp, ferrum_woq.set_max_isa):
// 0 portable, 1 avx2, 2 avx512, and at most what cpu_features() has.
int ferrum_active_isa();
