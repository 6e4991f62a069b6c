// reduce()'s kernel for one instruction set: simd/foreach_isa.h includes
// this once per tier (no include guard). Sources are summed a block at a
// time into an fp32 accumulator small enough to stay in L1, so each source
// element is read once and `out` may alias a source.

constexpr std::size_t kBlock = 2048;

// In is float or bf16 (widened); Out is float or bf16 (the sum rounded once).
template <typename In, typename Out>
void reduce_rows(Out* out, const In* const* srcs, int count, std::size_t n, float scale) {
  alignas(64) float acc[kBlock];
  for (std::size_t base = 0; base < n; base += kBlock) {
    const int64_t len = int64_t(std::min(kBlock, n - base));
    for_chunks(len, [&](int64_t i, int64_t m) HP_LAMBDA { store(acc + i, load(srcs[0] + base + i, m), m); });
    for (int s = 1; s < count; ++s) {
      const In* src = srcs[s] + base;
      for_chunks(len, [&](int64_t i, int64_t m) HP_LAMBDA { store(acc + i, load(acc + i, m) + load(src + i, m), m); });
    }
    Out* dst = out + base;
    if (scale == 1.0f) {
      for_chunks(len, [&](int64_t i, int64_t m) HP_LAMBDA { store(dst + i, load(acc + i, m), m); });
    } else {
      for_chunks(len, [&](int64_t i, int64_t m) HP_LAMBDA { store(dst + i, load(acc + i, m) * scale, m); });
    }
  }
}
