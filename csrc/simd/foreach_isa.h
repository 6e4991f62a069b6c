// Builds one source file once per instruction-set tier (see isa.h), for
// portable vector code; code written in one tier's intrinsics takes
// HP_SIMD_TARGET instead. Either way simd::isa() alone chooses. At file scope:
//
//   #define HP_SIMD_BODY "ops/kernels_isa.h"   // relative to csrc/
//   #define HP_SIMD_NAMESPACE hp::ops::cpu
//   #include "simd/foreach_isa.h"
//
// puts the body, after vec.h's primitives, into HP_SIMD_NAMESPACE::avx512,
// ::avx2 and ::baseline (only the last off x86-64), each compiled for its
// tier; HP_SIMD_PICK(hp::ops::cpu, f) is then the f of the tier simd::isa()
// chose. A body includes nothing (it sits inside namespaces):
// its file includes what the body needs before this header.
//
// Deliberately no include guard; the two macros are consumed.
#ifndef HP_SIMD_BODY
#error "define HP_SIMD_BODY (the per-tier source, relative to csrc/) before including simd/foreach_isa.h"
#endif
#ifndef HP_SIMD_NAMESPACE
#error "define HP_SIMD_NAMESPACE (where the per-tier namespaces go) before including simd/foreach_isa.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "isa.h"

#ifndef HP_SIMD_FOREACH_ONCE
#define HP_SIMD_FOREACH_ONCE
#define HP_INL inline __attribute__((always_inline))
#define HP_LAMBDA __attribute__((always_inline))
#define HP_SIMD_PRAGMA(text) _Pragma(#text)
#define HP_SIMD_PRAGMA_TARGET(features) HP_SIMD_PRAGMA(GCC target(features))
#if defined(__x86_64__)
// Variadic: a template's arguments may hold commas.
#define HP_SIMD_PICK(space, ...) \
  ::hp::simd::pick(space::avx512::__VA_ARGS__, space::avx2::__VA_ARGS__, space::baseline::__VA_ARGS__)
#else
#define HP_SIMD_PICK(space, ...) (space::baseline::__VA_ARGS__)
#endif
#endif

#if defined(__x86_64__)
#pragma GCC push_options
HP_SIMD_PRAGMA_TARGET(HP_SIMD_AVX512)
namespace HP_SIMD_NAMESPACE::avx512 {
#define HP_SIMD_WIDTH 16
#include "vec.h"
#include HP_SIMD_BODY
#undef HP_SIMD_WIDTH
}  // namespace HP_SIMD_NAMESPACE::avx512
#pragma GCC pop_options

#pragma GCC push_options
HP_SIMD_PRAGMA_TARGET(HP_SIMD_AVX2)
namespace HP_SIMD_NAMESPACE::avx2 {
#define HP_SIMD_WIDTH 8
#include "vec.h"
#include HP_SIMD_BODY
#undef HP_SIMD_WIDTH
}  // namespace HP_SIMD_NAMESPACE::avx2
#pragma GCC pop_options
#endif

namespace HP_SIMD_NAMESPACE::baseline {
#define HP_SIMD_WIDTH 4
#include "vec.h"
#include HP_SIMD_BODY
#undef HP_SIMD_WIDTH
}  // namespace HP_SIMD_NAMESPACE::baseline

#undef HP_SIMD_BODY
#undef HP_SIMD_NAMESPACE
