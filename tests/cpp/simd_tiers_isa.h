// test_simd.cpp's view of simd/vec.h in one tier: simd/foreach_isa.h
// includes this once per tier (no include guard).

// float -> bfloat16 through the tier's vector rounding (vec.h's store).
void round_to_bf16(const float* in, bf16* out, int64_t n) {
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { store(out + i, load(in + i, m), m); });
}

// bfloat16 -> float through the tier's vector widening (vec.h's load).
void widen(const bf16* in, float* out, int64_t n) {
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { store(out + i, load(in + i, m), m); });
}
