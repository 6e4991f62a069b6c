// muon_kernels.h's passes for one instruction set: simd/foreach_isa.h
// includes this once per tier (no include guard).

// ATen's vectorised lerp(self, end, weight) for a scalar weight.
HP_INL vf vlerp(vf self, vf end, float weight) {
  const bool small = std::abs(weight) < 0.5f;
  return vfma(splat(small ? weight : weight - 1.0f), end - self, small ? self : end);
}

void update_momentum(float* buf, const float* grad, bf16* out, int64_t n, double momentum, bool nesterov) {
  // torch passes the weights as Scalars (double), converted to float.
  const float to_grad = float(1.0 - momentum), to_buf = float(momentum);
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA {
    const vf g = load(grad + i, m);
    const vf b = vlerp(load(buf + i, m), g, to_grad);
    store(buf + i, b, m);
    if (out) store(out + i, nesterov ? vlerp(g, b, to_buf) : b, m);
  });
}

void apply_update(float* param, const bf16* update, int64_t n, float decay, float alpha) {
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA {
    const vf p = load(param + i, m) * decay;
    store(param + i, vfma(load(update + i, m), splat(alpha), p), m);
  });
}

MuonKernels table() { return MuonKernels{&update_momentum, &apply_update}; }
