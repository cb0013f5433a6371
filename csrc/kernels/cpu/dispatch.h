// Helpers shared by the CPU kernel files (not part of the kernel API).
#pragma once

#include "../dtype_dispatch.h"

// Clone hot loops for AVX2+F16C machines: float16 conversions become single
// instructions and float math runs 8 wide. The default clone keeps the
// extension loadable on any x86-64 (and the attribute is skipped elsewhere).
// Sanitizer builds (the C++ tests) get one clone: an ifunc resolver runs
// while the dynamic loader relocates, before the sanitizer's runtime is up,
// and an instrumented resolver crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
#define PYCOMM_MULTIVERSION __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define PYCOMM_MULTIVERSION
#endif
