#include "hyperparallel/optim/newton_schulz.h"

#include <ATen/Parallel.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "gram.h"
#include "reference_gemm.h"

namespace hp::optim {
namespace {

std::atomic<uint64_t> ns_calls{0}, ns_matrices{0};

// Matrices go through all the steps a group at a time, the group's operands
// about this size: several small matrices share each GEMM call, while large
// ones go one by one so that the operands stay in cache between the GEMMs.
constexpr int64_t kGroupBytes = int64_t(2) << 20;

// dst = the transpose of the 8 x 8 block at src, row strides ss and ds
// (bfloat16 bits: a copy needs no arithmetic).
inline void transpose8(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds) {
#if defined(__SSE2__)
  __m128i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ss));
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[i + 4] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  // t: (rows 01, 23, 45, 67) x (columns 0-3), then x (columns 4-7).
  for (int h = 0; h < 2; ++h) {
    const __m128i* u = t + 4 * h;
    const __m128i lo01 = _mm_unpacklo_epi32(u[0], u[1]), hi01 = _mm_unpackhi_epi32(u[0], u[1]);
    const __m128i lo23 = _mm_unpacklo_epi32(u[2], u[3]), hi23 = _mm_unpackhi_epi32(u[2], u[3]);
    uint16_t* out = dst + 4 * h * ds;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi64(lo01, lo23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + ds), _mm_unpackhi_epi64(lo01, lo23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * ds), _mm_unpacklo_epi64(hi01, hi23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 3 * ds), _mm_unpackhi_epi64(hi01, hi23));
  }
#else
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 8; ++j) dst[j * ds + i] = src[i * ss + j];
#endif
}

// dst (cols x rows, contiguous) = the transpose of src (rows x cols, contiguous).
void transpose_copy(const at::Tensor& src, const at::Tensor& dst) {
  const int64_t rows = src.size(0), cols = src.size(1);
  const auto* from = reinterpret_cast<const uint16_t*>(src.const_data_ptr());
  auto* to = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr());
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t i = 0; i < rows8; i += 8)
    for (int64_t j = 0; j < cols8; j += 8) transpose8(from + i * cols + j, cols, to + j * rows + i, rows);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows8 ? cols8 : 0; j < cols; ++j) to[j * rows + i] = from[i * cols + j];
}

// Copies the upper triangle of the square matrix `a` onto its lower
// triangle, 8 x 8 blocks by register transposes (a transposing copy through
// TensorIterator is an element at a time).
void mirror_upper(at::Tensor& a) {
  const int64_t m = a.size(0), full = m / 8 * 8;
  auto* data = reinterpret_cast<uint16_t*>(a.data_ptr());
  for (int64_t ib = 0; ib < full; ib += 8) {
    for (int64_t jb = ib + 8; jb < full; jb += 8) transpose8(data + ib * m + jb, m, data + jb * m + ib, m);
    // The diagonal block, and the columns past the last whole block.
    for (int64_t i = ib; i < ib + 8; ++i) {
      for (int64_t j = i + 1; j < ib + 8; ++j) data[j * m + i] = data[i * m + j];
      for (int64_t j = full; j < m; ++j) data[j * m + i] = data[i * m + j];
    }
  }
  for (int64_t i = full; i < m; ++i)
    for (int64_t j = i + 1; j < m; ++j) data[j * m + i] = data[i * m + j];
}

// out = beta * c + alpha * a aᵀ for a batch, where out (and c, if defined) is
// symmetric: only the upper triangle's column blocks are computed, by the
// gram kernels, and then mirrored. Element (i, j) is the same dot product,
// over the same k in the same order, as in oneDNN's AVX-512 bfloat16 GEMM
// (see gram.h), so the result is bit for bit torch's. `scratch` holds the
// kernels' packed operand (grown as needed). On the emulated kind,
// `transposed` is aᵀ, which its kernels pack from without a transpose (a
// symmetric a is its own).
void symmetric_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& transposed, const at::Tensor& c,
                       double beta, double alpha, at::Tensor& scratch) {
  const int64_t count = a.size(0), m = a.size(1), k = a.size(2);
  // The upper triangle's column blocks, block p paired with block
  // blocks - 1 - p so that each task has the same work.
  const int64_t blocks = (m + gram::kBlock - 1) / gram::kBlock;
  if (scratch.numel() < gram::packed_words(m, k)) scratch = at::empty({gram::packed_words(m, k)}, at::kInt);
  auto* packed = reinterpret_cast<uint32_t*>(scratch.mutable_data_ptr());
  const bool emulated = gram::kind() == gram::Kind::emulated;
  for (int64_t i = 0; i < count; ++i) {
    const auto* y = reinterpret_cast<const uint16_t*>(a[i].const_data_ptr());
    const auto* addend = c.defined() ? reinterpret_cast<const uint16_t*>(c[i].const_data_ptr()) : nullptr;
    auto* result = reinterpret_cast<uint16_t*>(out[i].mutable_data_ptr());
    if (emulated)
      gram::pack_transposed(reinterpret_cast<const uint16_t*>(transposed[i].const_data_ptr()), k, m, packed);
    else
      gram::pack(y, m, k, packed);
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        gram::upper_block(y, packed, m, k, p, addend, float(beta), float(alpha), result);
        if (blocks - 1 - p != p)
          gram::upper_block(y, packed, m, k, blocks - 1 - p, addend, float(beta), float(alpha), result);
      }
    });
    at::Tensor matrix = out[i];
    mirror_upper(matrix);
  }
}

// out = fma(x, a, h x) for h (m x m, symmetric) and x (m x n), as torch's
// addmm(x, h, x, beta=a) sums it on the emulated kind (gram.h): the kernels
// over out's 32-column blocks, on every thread. Both operands pack without
// a transpose: h is its own, and the columns of x are its rows' segments.
// `packed_h` and `packed_xt` are their scratch.
void product_hx(at::Tensor& out, const at::Tensor& h, const at::Tensor& x, double a, at::Tensor& packed_h,
                at::Tensor& packed_xt) {
  const int64_t m = x.size(0), n = x.size(1);
  if (packed_h.numel() < gram::packed_words(m, m)) packed_h = at::empty({gram::packed_words(m, m)}, at::kInt);
  if (packed_xt.numel() < gram::packed_words(n, m)) packed_xt = at::empty({gram::packed_words(n, m)}, at::kInt);
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); };
  auto* rows = reinterpret_cast<uint32_t*>(packed_h.mutable_data_ptr());
  auto* columns = reinterpret_cast<uint32_t*>(packed_xt.mutable_data_ptr());
  gram::pack_transposed(bits(h), m, m, rows);
  gram::pack_transposed(bits(x), m, n, columns);
  const uint16_t* addend = bits(x);
  auto* result = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  at::parallel_for(0, (n + gram::kBlock - 1) / gram::kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      gram::product_block(rows, columns, m, n, m, block, addend, float(a), 1.0f, result);
  });
}

// Without the gram kernels (an inner size they do not fit) on an AVX-512
// CPU: torch.optim.Muon's own calls on one matrix, the
// same operands in the same layouts (a tall matrix's transposed view in the
// first round included). There oneDNN's sums depend on the operands' shapes
// and layouts (a row panel, GᵀG for GG or a transposed copy each move some
// elements by a bfloat16 ulp), so only the very same calls give torch's bits.
void torch_rounds_(const at::Tensor& matrix, const NsOptions& options) {
  const bool tall = matrix.size(0) > matrix.size(1);
  at::Tensor x = tall ? matrix.t() : matrix;
  x = x.div(x.norm().clamp_min(options.eps));
  for (int64_t step = 0; step < options.steps; ++step) {
    const at::Tensor gram = at::mm(x, x.t());
    const at::Tensor update = at::addmm(gram, gram, gram, options.b, options.c);
    x = at::addmm(x, update, x, options.a, 1.0);
  }
  matrix.copy_(tall ? x.t() : x);
}

// On a GPU, X Xᵀ and b G + c G G are symmetric, so each can be three
// products of halves instead of one of the whole: the two diagonal blocks
// and the upper one, each written into place by a batched cuBLAS call, then
// the lower block copied as the upper one's transpose. That is 3/4 of those
// two products' work (B X, the round's third, stays whole); the operands are
// torch's own (row and column blocks of X, Xᵀ and G), so only the blocks'
// GEMM shapes differ from torch's calls. For m a multiple of 16 (each block
// 16-byte aligned) and large enough that the halves stay large GEMMs.
// HP_NS_SYMMETRIC=0 computes the whole products, as torch does.
constexpr int64_t kHalvesMin = 256;

bool symmetric_halves(int64_t m) {
  const char* value = std::getenv("HP_NS_SYMMETRIC");
  const std::string setting = value ? value : "";
  TORCH_CHECK(setting.empty() || setting == "0" || setting == "1", "HP_NS_SYMMETRIC must be 0 or 1, got '", setting,
              "' (docs/env.md)");
  return setting != "0" && m % 16 == 0 && m >= kHalvesMin;
}

at::Tensor block(const at::Tensor& t, int64_t i, int64_t j, int64_t h) {
  return t.narrow(1, i * h, h).narrow(2, j * h, h);
}

// out = beta * addend + alpha * left right, over the blocks (i, j) of the
// upper triangle and the diagonal; left's row block i times right's column
// block j; then the lower block from the upper one.
void symmetric_product(at::Tensor& out, const at::Tensor& left, const at::Tensor& right, const at::Tensor* addend,
                       double beta, double alpha) {
  const int64_t h = out.size(1) / 2;
  for (auto [i, j] : {std::pair<int64_t, int64_t>{0, 0}, {1, 1}, {0, 1}}) {
    at::Tensor target = block(out, i, j, h);
    const at::Tensor rows = left.narrow(1, i * h, h), columns = right.narrow(2, j * h, h);
    if (addend)
      at::baddbmm_out(target, block(*addend, i, j, h), rows, columns, beta, alpha);
    else
      at::bmm_out(target, rows, columns);
  }
  block(out, 1, 0, h).copy_(block(out, 0, 1, h).transpose(1, 2));
}

// The second stream of device_rounds_, one per device for the process: drawn
// from the pool once, so that it is not, by the pool's turn, a stream that
// other work (Muon's results, a collective) queues on.
c10::Stream side_stream(c10::Device device) {
  static std::mutex mutex;
  static std::unordered_map<c10::Device, c10::Stream> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(device);
  if (found == streams.end()) {
    const c10::Stream drawn = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, true);
    found = streams.emplace(device, drawn).first;
  }
  return found->second;
}

// On a GPU: torch's rounds for a group of matrices at once, each product one
// batched cuBLAS call (bmm, baddbmm with torch's alpha and beta) or, for the
// symmetric ones, three (above), and every matrix's Frobenius norm in one
// reduction.
//
// baddbmm copies its addend into its result before the product adds into it
// (beta = a != 0): for B X + a X that is a pass over X on the compute stream
// every round. Here a second stream makes that copy while the round's Gram
// products run, and the product then adds into it in place: the very same
// cuBLAS call on the very same operands, so the same bits.
void device_rounds_(const at::Tensor& batch, const NsOptions& options) {
  const bool tall = batch.size(1) > batch.size(2);
  at::Tensor wide = tall ? batch.transpose(1, 2) : batch;
  at::Tensor norms = at::linalg_vector_norm(wide, 2, at::IntArrayRef{1, 2}, /*keepdim=*/true).clamp_min(options.eps);
  at::Tensor x = at::div(wide, norms).contiguous();
  const int64_t count = x.size(0), m = x.size(1);
  const bool halves = symmetric_halves(m);
  at::Tensor gram, update, next = at::empty_like(x);
  if (halves) {
    gram = at::empty({count, m, m}, x.options());
    update = at::empty_like(gram);
  }
  const c10::Device device = batch.device();
  const c10::Stream compute = c10::impl::VirtualGuardImpl(device.type()).getStream(device), side = side_stream(device);
  c10::Event x_ready(device.type()), copied(device.type());
  // However a round ends (an out-of-memory product), the compute stream, on
  // whose pool x and next go back, waits for the side stream's last copy.
  struct Joined {
    const c10::Event& copied;
    const c10::Stream& compute;
    ~Joined() {
      try {
        copied.block(compute);
      } catch (...) {  // a destructor must not throw; a device that cannot wait has failed louder elsewhere
      }
    }
  } joined{copied, compute};
  for (int64_t step = 0; step < options.steps; ++step) {
    // A wide batch's last round lands in the batch itself: no allocation and
    // no copy back.
    const bool into_batch = !tall && step == options.steps - 1;
    at::Tensor result = into_batch ? batch : next;
    // The side stream writes the result only after the compute stream's
    // last read of it (the round before, when it was X).
    x_ready.record(compute);
    x_ready.block(side);
    {
      const c10::StreamGuard on_side(side);
      result.copy_(x);
    }
    copied.record(side);
    if (halves) {
      symmetric_product(gram, x, x.transpose(1, 2), nullptr, 0.0, 1.0);
      symmetric_product(update, gram, gram, &gram, options.b, options.c);
    } else {
      gram = at::bmm(x, x.transpose(1, 2));
      update = at::baddbmm(gram, gram, gram, options.b, options.c);
    }
    copied.block(compute);
    at::baddbmm_out(result, result, update, x, options.a, 1.0);
    if (into_batch) return;
    std::swap(x, next);
  }
  batch.copy_(tall ? x.transpose(1, 2) : x);
}

// The rounds' temporaries (x, the next x, the Gram matrix and its update)
// for a pool of experts at once would be several GiB beside the model: groups
// of at most about this many bytes keep each product a large batched call,
// and groups of nearly equal size keep the last from a fraction of the GPU.
constexpr int64_t kDeviceGroupBytes = int64_t(512) << 20;

void newton_schulz_device_(const at::Tensor& batch, const NsOptions& options) {
  const int64_t count = batch.size(0);
  const int64_t m = std::min(batch.size(1), batch.size(2)), n = std::max(batch.size(1), batch.size(2));
  const int64_t per_matrix = int64_t(sizeof(uint16_t)) * (2 * m * n + 2 * m * m);
  const int64_t most = std::clamp<int64_t>(kDeviceGroupBytes / std::max<int64_t>(per_matrix, 1), 1, count);
  const int64_t groups = (count + most - 1) / most, group = (count + groups - 1) / groups;
  for (int64_t first = 0; first < count; first += group)
    device_rounds_(batch.narrow(0, first, std::min(group, count - first)), options);
}

// torch_rounds_' results from reference_gemm's kernels (see
// reference_gemm.h), each GEMM on every thread.
void reference_rounds_(const at::Tensor& matrix, const NsOptions& options) {
  const reference_gemm::Parallel parallel = [](int64_t tasks, const std::function<void(int64_t, int64_t)>& body) {
    at::parallel_for(0, tasks, 1, body);
  };
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  auto floats = [](const at::Tensor& t) { return t.const_data_ptr<float>(); };
  const bool tall = matrix.size(0) > matrix.size(1);
  const int64_t m = std::min(matrix.size(0), matrix.size(1)), n = std::max(matrix.size(0), matrix.size(1));
  const at::Tensor oriented = tall ? matrix.t() : matrix;
  at::Tensor x = oriented.div(oriented.norm().clamp_min(options.eps)).contiguous();  // m x n
  at::Tensor gram = at::empty({m, m}, x.options()), update = at::empty_like(gram), next = at::empty_like(x);
  at::Tensor wide = at::empty({m, n}, x.options().dtype(at::kFloat)), square = at::empty({m, m}, wide.options());
  for (int64_t step = 0; step < options.steps; ++step) {
    // A tall matrix's first round: torch multiplies the transposed view, so
    // its X Xᵀ is Yᵀ Y with Y (the matrix, n x m) row-major, and H X reads
    // X's columns, Y's rows.
    const bool transposed = tall && step == 0;
    at::Tensor rows;  // Y, n x m
    if (transposed) {
      rows = x.t().to(at::kFloat).contiguous();
      reference_gemm::gram_sequential(floats(rows), n, m, bits(gram), parallel);
    } else {
      wide.copy_(x);
      reference_gemm::gram(floats(wide), m, n, bits(gram), parallel);
    }
    square.copy_(gram);
    reference_gemm::product(floats(square), floats(square), m, m, m, bits(gram), float(options.b), float(options.c),
                            bits(update), parallel);
    square.copy_(update);
    if (transposed)
      reference_gemm::dots(floats(square), floats(rows), m, n, m, bits(x), float(options.a), 1.0f, bits(next),
                           parallel);
    else
      reference_gemm::product(floats(square), floats(wide), m, m, n, bits(x), float(options.a), 1.0f, bits(next),
                              parallel);
    std::swap(x, next);
  }
  matrix.copy_(tall ? x.t() : x);
}

}  // namespace

void newton_schulz_(const at::Tensor& batch, const NsOptions& options) {
  TORCH_CHECK(batch.dim() == 3 && batch.scalar_type() == at::kBFloat16 && batch.is_contiguous(),
              "hp.optim Newton–Schulz: expected a contiguous bfloat16 batch [count, rows, cols], got ",
              batch.scalar_type(), " of shape ", batch.sizes());
  TORCH_CHECK(options.steps >= 0 && options.steps < 100, "hp.optim.Muon: ns_steps must be in [0, 100), got ",
              options.steps, "; 5 is the usual choice");
  const int64_t count = batch.size(0);
  if (count == 0) return;
  if (!batch.is_cpu()) {
    newton_schulz_device_(batch, options);
    ns_calls.fetch_add(1, std::memory_order_relaxed);
    ns_matrices.fetch_add(count, std::memory_order_relaxed);
    return;
  }
  // torch iterates on the wide orientation (rows <= cols), so that the Gram
  // matrix is the smaller one.
  const bool tall = batch.size(1) > batch.size(2);
  const int64_t m = std::min(batch.size(1), batch.size(2)), n = std::max(batch.size(1), batch.size(2));
  // X Xᵀ sums over n, b G + c G G over m.
  const int threads = at::get_num_threads();
  if (!gram::available() || !gram::fits(m, m, n, threads) || !gram::fits(m, m, m, threads)) {
    // One matrix after another, each GEMM on every thread, as torch runs them
    // (a oneDNN GEMM's sums may depend on how its threads split the work).
    const bool reference = reference_gemm::available();
    for (int64_t i = 0; i < count; ++i) (reference ? reference_rounds_ : torch_rounds_)(batch[i], options);
    ns_calls.fetch_add(1, std::memory_order_relaxed);
    ns_matrices.fetch_add(count, std::memory_order_relaxed);
    return;
  }
  // The emulated kind packs X from its transpose (symmetric_product).
  const bool emulated = gram::kind() == gram::Kind::emulated;
  // bfloat16 x, next, gram, update (and xᵀ)
  const int64_t matrix_bytes = 2 * ((emulated ? 3 : 2) * m * n + 2 * m * m);
  const int64_t group = std::clamp<int64_t>(kGroupBytes / matrix_bytes, 1, count);
  auto options_bf16 = batch.options();
  at::Tensor x_buffer = at::empty({group, m, n}, options_bf16), next_buffer = at::empty_like(x_buffer);
  at::Tensor gram_buffer = at::empty({group, m, m}, options_bf16), update_buffer = at::empty_like(gram_buffer);
  at::Tensor xt_buffer = emulated ? at::empty({group, n, m}, options_bf16) : at::Tensor();
  at::Tensor scratch = at::empty({0}, at::kInt);
  // H X on the emulated kind's kernels where they give torch's bits (else
  // torch's call); with bfloat16 dot products it stays one batched call.
  const bool own_product = emulated && gram::fits(m, n, m, threads);
  at::Tensor scratch_bt = at::empty({0}, at::kInt);
  for (int64_t first = 0; first < count; first += group) {
    const int64_t size = std::min(group, count - first);
    at::Tensor x = x_buffer.narrow(0, 0, size), next = next_buffer.narrow(0, 0, size);
    at::Tensor gram = gram_buffer.narrow(0, 0, size), update = update_buffer.narrow(0, 0, size);
    at::Tensor xt = emulated ? xt_buffer.narrow(0, 0, size) : at::Tensor();
    for (int64_t i = 0; i < size; ++i) {
      // One norm per matrix, the very reduction torch runs, so that a
      // different summation order cannot move the scale by a bfloat16 ulp.
      // A tall matrix is divided in place (its own result overwrites it)
      // and then copied transposed: the quotients are the same either way.
      at::Tensor matrix = batch[first + i];
      at::Tensor norm = at::clamp(at::linalg_vector_norm(tall ? matrix.t() : matrix, 2), options.eps);
      if (tall) {
        matrix.div_(norm);
        transpose_copy(matrix, x[i]);
      } else {
        at::Tensor normalised = x[i];
        at::div_out(normalised, matrix, norm);
      }
    }
    for (int64_t step = 0; step < options.steps; ++step) {
      // The first round of tall matrices finds Xᵀ in the batch, divided in
      // place above.
      const bool batch_is_xt = tall && step == 0;
      if (emulated && !batch_is_xt)
        for (int64_t i = 0; i < size; ++i) transpose_copy(x[i], xt[i]);
      if (batch_is_xt && !emulated && n > 1024) {
        // oneDNN's k blocks past 1024 for this transposed operand differ
        // between CPUs with bfloat16 dot products (blocks of 512 on an AMD
        // EPYC Zen 4, where a contiguous one gets blocks of 1024, as both
        // did on the Zen 5 the gram kernels were matched on): torch's own
        // call on its very operands, X = Yᵀ and Xᵀ = Y.
        for (int64_t i = 0; i < size; ++i) {
          at::Tensor out = gram[i];
          const at::Tensor y = batch[first + i];
          at::mm_out(out, y.t(), y);
        }
      } else {
        symmetric_product(gram, x, batch_is_xt ? batch.narrow(0, first, size) : xt, at::Tensor(), 0.0, 1.0, scratch);
      }
      symmetric_product(update, gram, gram, gram, options.b, options.c, scratch);  // b G + c G Gᵀ, and G Gᵀ = G G
      if (own_product) {
        for (int64_t i = 0; i < size; ++i) {
          at::Tensor out = next[i];
          product_hx(out, update[i], x[i], options.a, scratch, scratch_bt);
        }
      } else if (emulated) {
        // torch's own call per matrix: a batched one splits its outputs over
        // the threads across matrices, and a share cut inside a row goes to
        // that GEMM's gemv kernel (see gram::fits).
        for (int64_t i = 0; i < size; ++i) {
          at::Tensor out = next[i];
          at::addmm_out(out, x[i], update[i], x[i], options.a, 1.0);
        }
      } else {
        at::baddbmm_out(next, x, update, x, options.a, 1.0);
      }
      std::swap(x, next);
    }
    if (tall)
      for (int64_t i = 0; i < size; ++i) transpose_copy(x[i], batch[first + i]);
    else
      batch.narrow(0, first, size).copy_(x);
  }
  ns_calls.fetch_add(1, std::memory_order_relaxed);
  ns_matrices.fetch_add(count, std::memory_order_relaxed);
}

NsStats ns_stats() { return NsStats{ns_calls.load(), ns_matrices.load()}; }

void reset_ns_stats() {
  ns_calls = 0;
  ns_matrices = 0;
}

}  // namespace hp::optim
