// The row kernels of kernels.h for one instruction set, on simd/vec.h's
// primitives: simd/foreach_isa.h includes this once per tier (no include
// guard).

constexpr float kInf = std::numeric_limits<float>::infinity();

// exp within 1 ulp (Cephes' polynomial); exactly 0 below the float range, so
// masked scores (-inf) vanish.
HP_INL vf vexp(vf x) {
  const vf lo = splat(-87.3365478515625f);
  const vf hi = splat(88.3762626647949f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf t = xc * 1.44269504088896341f + 12582912.0f;  // adding 1.5 * 2^23 rounds to an integer
  const vf n = t - 12582912.0f;
  const vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi two_n = ((vi)t - (0x4B400000 - 127)) << 23;  // t's low mantissa bits hold n
  const vf result = p * (vf)two_n;
  return x < lo ? vf{} : result;
}

HP_INL vf vsigmoid(vf x) { return 1.0f / (1.0f + vexp(-x)); }

template <class F>
HP_INL void with_type(c10::ScalarType t, F&& f) {
  if (t == c10::ScalarType::BFloat16) {
    f(static_cast<bf16*>(nullptr));
  } else {
    f(static_cast<float*>(nullptr));
  }
}
#define HP_TYPE(tag) std::remove_pointer_t<decltype(tag)>

// ---------------------------------------------------------------------------
// Conversions and reductions.

void to_float(c10::ScalarType type, const void* src, float* dst, int64_t n) {
  with_type(type, [&](auto tag) {
    const auto* s = static_cast<const HP_TYPE(tag)*>(src);
    for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { store(dst + i, load(s + i, m), m); });
  });
}

void from_float(c10::ScalarType type, const float* src, void* dst, int64_t n) {
  with_type(type, [&](auto tag) {
    auto* d = static_cast<HP_TYPE(tag)*>(dst);
    for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { store(d + i, load(src + i, m), m); });
  });
}

float dot(const float* a, const float* b, int64_t n) {
  vf acc = {};
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { acc += load(a + i, m) * load(b + i, m); });
  return hsum(acc);
}

// p <- exp(p - top) / their sum, for n floats whose largest is top (finite);
// returns the log-sum-exp.
HP_INL float exp_normalize(float* p, int64_t n, float top) {
  vf acc = {};
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA {
    const vf e = vexp(load(p + i, m, -kInf) - top);
    store(p + i, e, m);
    acc += e;
  });
  const float sum = hsum(acc);
  const float inv = 1.0f / sum;
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { store(p + i, load(p + i, m) * inv, m); });
  return top + std::log(sum);
}

// Softmax of n floats in place; returns the log-sum-exp.
HP_INL float softmax_inplace(float* p, int64_t n) {
  vf mx = splat(-kInf);
  for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA { mx = vmax(mx, load(p + i, m, -kInf)); });
  return exp_normalize(p, n, hmax(mx));
}

// The k largest of p[0, n) in descending order, the lower index first among
// equals: an insertion into a sorted list of k, which most values skip.
HP_INL void top_k(const float* p, int64_t n, int64_t k, float* values, int64_t* index) {
  int64_t count = 0;
  for (int64_t e = 0; e < n; ++e) {
    const float v = p[e];
    if (count == k && !(v > values[k - 1])) continue;
    int64_t j = count < k ? count++ : k - 1;
    for (; j > 0 && v > values[j - 1]; --j) {
      values[j] = values[j - 1];
      index[j] = index[j - 1];
    }
    values[j] = v;
    index[j] = e;
  }
}

// ---------------------------------------------------------------------------
// RMSNorm.

void rms_norm_forward(c10::ScalarType xt, const void* x, c10::ScalarType wt, const void* w, c10::ScalarType yt, void* y,
                      float* rstd, int64_t rows, int64_t n, float eps) {
  with_type(xt, [&](auto xtag) {
    with_type(wt, [&](auto wtag) {
      with_type(yt, [&](auto ytag) {
        using Tx = HP_TYPE(xtag);
        const auto* xs = static_cast<const Tx*>(x);
        const auto* ws = static_cast<const HP_TYPE(wtag)*>(w);
        auto* ys = static_cast<HP_TYPE(ytag)*>(y);
        for (int64_t r = 0; r < rows; ++r) {
          const Tx* xr = xs + r * n;
          vf acc = {};
          for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA {
            const vf v = load(xr + i, m);
            acc += v * v;
          });
          const float rs = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
          rstd[r] = rs;
          auto* yr = ys + r * n;
          for_chunks(n, [&](int64_t i, int64_t m)
                            HP_LAMBDA { store(yr + i, load(ws + i, m) * round_as<Tx>(load(xr + i, m) * rs), m); });
        }
      });
    });
  });
}

void rms_norm_backward(c10::ScalarType yt, const void* dy, c10::ScalarType xt, const void* x, c10::ScalarType wt,
                       const void* w, const float* rstd, void* dx, float* dw_acc, int64_t rows, int64_t n) {
  with_type(xt, [&](auto xtag) {
    with_type(wt, [&](auto wtag) {
      with_type(yt, [&](auto ytag) {
        using Tx = HP_TYPE(xtag);
        const auto* dys = static_cast<const HP_TYPE(ytag)*>(dy);
        const auto* xs = static_cast<const Tx*>(x);
        const auto* ws = static_cast<const HP_TYPE(wtag)*>(w);
        auto* dxs = static_cast<Tx*>(dx);
        for (int64_t r = 0; r < rows; ++r) {
          const auto* dyr = dys + r * n;
          const Tx* xr = xs + r * n;
          const float rs = rstd[r];
          vf acc = {};
          for_chunks(n, [&](int64_t i, int64_t m)
                            HP_LAMBDA { acc += load(dyr + i, m) * load(ws + i, m) * (load(xr + i, m) * rs); });
          const float c = hsum(acc) / static_cast<float>(n);
          Tx* dxr = dxs + r * n;
          for_chunks(n, [&](int64_t i, int64_t m) HP_LAMBDA {
            const vf g = load(dyr + i, m);
            const vf xh = load(xr + i, m) * rs;
            store(dxr + i, (g * load(ws + i, m) - xh * c) * rs, m);
            store(dw_acc + i, load(dw_acc + i, m) + g * round_as<Tx>(xh), m);
          });
        }
      });
    });
  });
}

// ---------------------------------------------------------------------------
// q/k-norm + RoPE, and the attention softmax.

float norm_rope(c10::ScalarType t, const void* x, const void* w, const float* cos, const float* sin, float eps,
                int64_t d, float* out) {
  float rs = 0.f;
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    const auto* xs = static_cast<const T*>(x);
    const auto* ws = static_cast<const T*>(w);
    vf acc = {};
    for_chunks(d, [&](int64_t i, int64_t m) HP_LAMBDA {
      const vf v = load(xs + i, m);
      acc += v * v;
    });
    rs = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(d) + eps);
    for_chunks(d, [&](int64_t i, int64_t m) HP_LAMBDA {
      store(out + i, round_as<T>(load(ws + i, m) * round_as<T>(load(xs + i, m) * rs)), m);
    });
    // rotate_half: out[j] = a*cos - b*sin, out[j+h] = b*cos + a*sin with a = x[j], b = x[j+h].
    const int64_t h = d / 2;
    for_chunks(h, [&](int64_t i, int64_t m) HP_LAMBDA {
      const vf a = load(out + i, m);
      const vf b = load(out + h + i, m);
      store(out + i, a * load(cos + i, m) - b * load(sin + i, m), m);
      store(out + h + i, b * load(cos + h + i, m) + a * load(sin + h + i, m), m);
    });
  });
  return rs;
}

void norm_rope_backward(c10::ScalarType t, const float* g, const void* x, const void* w, const float* cos,
                        const float* sin, float rstd, int64_t d, void* dx, float* dw_acc) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    const auto* xs = static_cast<const T*>(x);
    const auto* ws = static_cast<const T*>(w);
    float gn[kMaxHeadDim];
    const int64_t h = d / 2;
    for_chunks(h, [&](int64_t i, int64_t m) HP_LAMBDA {
      const vf ga = load(g + i, m);
      const vf gb = load(g + h + i, m);
      store(gn + i, ga * load(cos + i, m) + gb * load(sin + h + i, m), m);
      store(gn + h + i, gb * load(cos + h + i, m) - ga * load(sin + i, m), m);
    });
    vf acc = {};
    for_chunks(d, [&](int64_t i, int64_t m)
                      HP_LAMBDA { acc += load(gn + i, m) * load(ws + i, m) * (load(xs + i, m) * rstd); });
    const float c = hsum(acc) / static_cast<float>(d);
    auto* dxs = static_cast<T*>(dx);
    for_chunks(d, [&](int64_t i, int64_t m) HP_LAMBDA {
      const vf gv = load(gn + i, m);
      const vf xh = load(xs + i, m) * rstd;
      store(dxs + i, (gv * load(ws + i, m) - xh * c) * rstd, m);
      store(dw_acc + i, load(dw_acc + i, m) + gv * round_as<T>(xh), m);
    });
  });
}

HP_INL void zero(float* p, int64_t n) {
  if (n > 0) std::memset(p, 0, n * sizeof(float));
}

float softmax_row(float* s, int64_t n_valid, int64_t n_total, float scale, const float* add) {
  vf mx = splat(-kInf);
  for_chunks(n_valid, [&](int64_t i, int64_t m) HP_LAMBDA {
    vf v = load(s + i, m, -kInf) * scale;
    if (add) v += load(add + i, m);
    store(s + i, v, m);
    mx = vmax(mx, v);
  });
  const float top = hmax(mx);
  if (top == -kInf) {
    zero(s, n_total);
    return kInf;
  }
  const float lse = exp_normalize(s, n_valid, top);
  zero(s + n_valid, n_total - n_valid);
  return lse;
}

void softmax_backward_row(float* s, float* dp, int64_t n_valid, int64_t n_total, float scale, const float* add,
                          float lse, float d_o_dot_o) {
  if (lse == kInf) {
    zero(s, n_total);
    zero(dp, n_total);
    return;
  }
  for_chunks(n_valid, [&](int64_t i, int64_t m) HP_LAMBDA {
    vf y = load(s + i, m) * scale;
    if (add) y += load(add + i, m);
    const vf p = vexp(y - lse);
    store(s + i, p, m);
    store(dp + i, p * (load(dp + i, m) - d_o_dot_o) * scale, m);
  });
  zero(s + n_valid, n_total - n_valid);
  zero(dp + n_valid, n_total - n_valid);
}

// ---------------------------------------------------------------------------
// SwiGLU and the MoE's gathers.

void swiglu_forward(c10::ScalarType t, const void* gu, void* a, int64_t rows, int64_t inter) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = static_cast<const T*>(gu) + r * 2 * inter;
      const T* u = g + inter;
      T* ar = static_cast<T*>(a) + r * inter;
      for_chunks(inter, [&](int64_t i, int64_t m) HP_LAMBDA {
        const vf gv = load(g + i, m);
        store(ar + i, gv * vsigmoid(gv) * load(u + i, m), m);
      });
    }
  });
}

void swiglu_backward(c10::ScalarType t, const void* gu, const void* da, const float* row_weight, void* dgu, void* a_w,
                     float* row_dot, int64_t rows, int64_t inter) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = static_cast<const T*>(gu) + r * 2 * inter;
      const T* u = g + inter;
      const T* dar = static_cast<const T*>(da) + r * inter;
      T* dg = static_cast<T*>(dgu) + r * 2 * inter;
      T* du = dg + inter;
      T* awr = static_cast<T*>(a_w) + r * inter;
      const float w = row_weight ? row_weight[r] : 1.0f;
      vf acc = {};
      for_chunks(inter, [&](int64_t i, int64_t m) HP_LAMBDA {
        const vf gv = load(g + i, m);
        const vf uv = load(u + i, m);
        const vf dav = load(dar + i, m);
        const vf sig = vsigmoid(gv);
        const vf silu = gv * sig;
        const vf av = silu * uv;
        acc += dav * av;
        store(awr + i, av * w, m);
        const vf dav_w = dav * w;
        store(dg + i, dav_w * uv * sig * (1.0f + gv * (1.0f - sig)), m);
        store(du + i, dav_w * silu, m);
      });
      if (row_dot) row_dot[r] = hsum(acc);
    }
  });
}

void gather_sum(c10::ScalarType t, const void* src, const int64_t* pos, c10::ScalarType wt, const void* w,
                int64_t tokens, int64_t k, int64_t hidden, void* out) {
  with_type(t, [&](auto tag) {
    with_type(wt, [&](auto wtag) {
      using T = HP_TYPE(tag);
      const auto* ws = static_cast<const HP_TYPE(wtag)*>(w);
      const T* ss = static_cast<const T*>(src);
      for (int64_t tok = 0; tok < tokens; ++tok) {
        const int64_t* p = pos + tok * k;
        T* o = static_cast<T*>(out) + tok * hidden;
        for_chunks(hidden, [&](int64_t i, int64_t m) HP_LAMBDA {
          vf acc = {};
          for (int64_t j = 0; j < k; ++j) {
            const float wj = ws ? static_cast<float>(ws[tok * k + j]) : 1.0f;
            acc += load(ss + p[j] * hidden + i, m) * wj;
          }
          store(o + i, acc, m);
        });
      }
    });
  });
}

// ---------------------------------------------------------------------------
// Router and load-balancing loss.

template <typename T>
HP_INL void softmax_of(const T* logits, int64_t experts, float* p) {
  for_chunks(experts, [&](int64_t i, int64_t m) HP_LAMBDA { store(p + i, load(logits + i, m), m); });
  softmax_inplace(p, experts);
}

void router_forward(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, int64_t k, bool norm,
                    void* scores, int64_t* index) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    std::vector<float> p(experts), values(k);
    for (int64_t r = 0; r < rows; ++r) {
      softmax_of(static_cast<const T*>(logits) + r * experts, experts, p.data());
      int64_t* idx = index + r * k;
      top_k(p.data(), experts, k, values.data(), idx);
      if (norm) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) sum += values[j];
        for (int64_t j = 0; j < k; ++j) values[j] /= sum;
      }
      T* out = static_cast<T*>(scores) + r * k;
      for (int64_t j = 0; j < k; ++j) out[j] = static_cast<T>(values[j]);
    }
  });
}

void router_backward(c10::ScalarType t, const void* logits, const int64_t* index, c10::ScalarType st,
                     const void* grad_scores, const void* grad_logits, int64_t rows, int64_t experts, int64_t k,
                     bool norm, void* dlogits) {
  with_type(t, [&](auto tag) {
    with_type(st, [&](auto stag) {
      using T = HP_TYPE(tag);
      const auto* gs = static_cast<const HP_TYPE(stag)*>(grad_scores);
      std::vector<float> p(experts), dp(experts), dv(k);
      for (int64_t r = 0; r < rows; ++r) {
        softmax_of(static_cast<const T*>(logits) + r * experts, experts, p.data());
        const int64_t* idx = index + r * k;
        for (int64_t j = 0; j < k; ++j) dv[j] = static_cast<float>(gs[r * k + j]);
        if (norm) {
          // s_j = v_j / sum(v): dv_j <- (ds_j - sum_i ds_i s_i) / sum(v).
          float sum = 0.f, weighted = 0.f;
          for (int64_t j = 0; j < k; ++j) sum += p[idx[j]];
          for (int64_t j = 0; j < k; ++j) weighted += dv[j] * p[idx[j]] / sum;
          for (int64_t j = 0; j < k; ++j) dv[j] = (dv[j] - weighted) / sum;
        }
        std::fill(dp.begin(), dp.end(), 0.f);
        float c = 0.f;
        for (int64_t j = 0; j < k; ++j) {
          dp[idx[j]] += dv[j];
          c += p[idx[j]] * dv[j];
        }
        T* out = static_cast<T*>(dlogits) + r * experts;
        const T* gl = grad_logits ? static_cast<const T*>(grad_logits) + r * experts : nullptr;
        for_chunks(experts, [&](int64_t i, int64_t m) HP_LAMBDA {
          vf v = load(p.data() + i, m) * (load(dp.data() + i, m) - c);
          if (gl) v += load(gl + i, m);
          store(out + i, v, m);
        });
      }
    });
  });
}

void aux_loss_accumulate(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, int64_t k,
                         const float* mask, double* counts, double* probs) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    std::vector<float> p(experts), values(k);
    std::vector<int64_t> idx(k);
    for (int64_t r = 0; r < rows; ++r) {
      softmax_of(static_cast<const T*>(logits) + r * experts, experts, p.data());
      for_chunks(experts,
                 [&](int64_t i, int64_t m) HP_LAMBDA { store(p.data() + i, round_as<T>(load(p.data() + i, m)), m); });
      const double weight = mask ? mask[r] : 1.0;
      top_k(p.data(), experts, k, values.data(), idx.data());
      for (int64_t j = 0; j < k; ++j) counts[idx[j]] += weight;
      for (int64_t e = 0; e < experts; ++e) probs[e] += weight * p[e];
    }
  });
}

void aux_loss_backward(c10::ScalarType t, const void* logits, int64_t rows, int64_t experts, const float* coef,
                       const float* mask, void* dlogits) {
  with_type(t, [&](auto tag) {
    using T = HP_TYPE(tag);
    std::vector<float> p(experts);
    for (int64_t r = 0; r < rows; ++r) {
      softmax_of(static_cast<const T*>(logits) + r * experts, experts, p.data());
      const float weight = mask ? mask[r] : 1.0f;
      vf acc = {};
      for_chunks(experts, [&](int64_t i, int64_t m) HP_LAMBDA { acc += load(p.data() + i, m) * load(coef + i, m); });
      const float c = hsum(acc) * weight;
      T* out = static_cast<T*>(dlogits) + r * experts;
      for_chunks(experts, [&](int64_t i, int64_t m) HP_LAMBDA {
        store(out + i, load(p.data() + i, m) * (load(coef + i, m) * weight - c), m);
      });
    }
  });
}

#undef HP_TYPE

Kernels table() {
  return Kernels{&to_float,
                 &from_float,
                 &dot,
                 &rms_norm_forward,
                 &rms_norm_backward,
                 &norm_rope,
                 &norm_rope_backward,
                 &softmax_row,
                 &softmax_backward_row,
                 &swiglu_forward,
                 &swiglu_backward,
                 &gather_sum,
                 &router_forward,
                 &router_backward,
                 &aux_loss_accumulate,
                 &aux_loss_backward};
}
