#include "hyperparallel/optim/muon.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>

#include "hyperparallel/comm/c10d.h"
#include "hyperparallel/comm/reduce.h"
#include "muon_kernels.h"
#include "muon_plan.h"

namespace hp::optim {
namespace {

constexpr int64_t kAlign = 64;  // pools start on cache lines

std::string shape_string(const std::vector<int64_t>& shape) { return c10::str(c10::IntArrayRef(shape)); }

// What the one-pass elementwise kernels take; anything else takes ATen's ops.
bool plain_fp32(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }

std::map<c10::DeviceType, MuonFactory>& muon_factories() {
  static std::map<c10::DeviceType, MuonFactory> factories;
  return factories;
}

std::atomic<uint64_t> peer_bytes_read{0};

}  // namespace

uint64_t muon_peer_bytes() { return peer_bytes_read.load(); }
void reset_muon_peer_bytes() { peer_bytes_read = 0; }
void plan::add_peer_bytes(uint64_t bytes) { peer_bytes_read.fetch_add(bytes, std::memory_order_relaxed); }

void register_muon_factory(c10::DeviceType type, MuonFactory factory) { muon_factories()[type] = factory; }

std::shared_ptr<MuonPlan> MuonPlan::create(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
                                           c10::intrusive_ptr<c10d::ProcessGroup> counterparts, c10::Device device) {
  if (device.is_cpu()) return std::make_shared<Muon>(std::move(params), comm, std::move(mesh), std::move(counterparts));
  auto it = muon_factories().find(device.type());
  TORCH_CHECK(it != muon_factories().end(), "hp.optim.Muon: parameters on ", device,
              ", but this build of hyperparallel has no ", c10::DeviceTypeName(device.type()),
              " backend; rebuild it against a torch with ", c10::DeviceTypeName(device.type()),
              " (and nvcc on PATH for CUDA)");
  return it->second(std::move(params), comm, std::move(mesh), std::move(counterparts), device);
}

Muon::Muon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
           c10::intrusive_ptr<c10d::ProcessGroup> counterparts)
    : params_(std::move(params)), comm_(comm), mesh_(std::move(mesh)), counterparts_(std::move(counterparts)) {
  check_layout();
  plan_matrices();
  plan_owners();
  allocate_slots();
  plan_pieces();
  plan_transfers();
  count_peer_bytes();
}

void Muon::check_layout() {
  bool any_sharded = false;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& shape = params_[i].shape;
    TORCH_CHECK(shape.size() == 2 || shape.size() == 3, "hp.optim.Muon: parameter ", i, " has shape ",
                shape_string(shape), "; Muon takes matrices (2-D) and stacks of expert matrices (3-D). Give ",
                "biases, norms and embeddings to AdamW (hp.optim.muon_param_split does the usual split)");
    TORCH_CHECK(std::all_of(shape.begin(), shape.end(), [](int64_t size) { return size > 0; }),
                "hp.optim.Muon: parameter ", i, " has shape ", shape_string(shape), " with an empty dimension");
    any_sharded |= params_[i].sharded;
  }
  if (!any_sharded) return;  // a plan of this process alone
  TORCH_CHECK(comm_, "hp.optim.Muon: sharded (DTensor) parameters need the fabric; call hp.comm.init() first");
  const fabric::Topology& topology = comm_->topology();
  rank_ = topology.rank, world_ = topology.world_size, node_ = topology.node, nodes_ = topology.num_nodes;
  local_rank_ = topology.local_rank, local_world_ = topology.local_world_size;
  TORCH_CHECK(int(mesh_.shard.size()) == world_ && int(mesh_.replica.size()) == world_,
              "hp.optim.Muon: the parameters' device mesh must hold every rank of the job (", world_,
              " ranks), but it holds ", mesh_.shard.size(), "; shard them over a mesh of all ranks");
  shards_ = *std::max_element(mesh_.shard.begin(), mesh_.shard.end()) + 1;
  shard_ = mesh_.shard[rank_];
  const int64_t replicas = *std::max_element(mesh_.replica.begin(), mesh_.replica.end()) + 1;
  std::set<std::pair<int64_t, int64_t>> places;
  for (int g = 0; g < world_; ++g) places.insert({mesh_.replica[g], mesh_.shard[g]});
  TORCH_CHECK(shards_ * replicas == world_ && int(places.size()) == world_,
              "hp.optim.Muon: the mesh layout is not a (replicate, shard) grid over the ", world_, " ranks");
  TORCH_CHECK(nodes_ == 1 || counterparts_,
              "hp.optim.Muon: a job over several nodes needs each rank's c10d group of counterparts");
}

void Muon::plan_matrices() {
  // One pool per shape and Newton–Schulz options; sharded and private
  // matrices apart, since only the first live in shared memory.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& spec = params_[i];
    const int64_t dims = spec.shape.size(), experts = dims == 3 ? spec.shape[0] : 1;
    const int64_t rows = spec.shape[dims - 2], cols = spec.shape[dims - 1];
    auto found = std::find_if(pools_.begin(), pools_.end(), [&](const Pool& pool) {
      return pool.rows == rows && pool.cols == cols && pool.ns == spec.ns && pool.shared == spec.sharded;
    });
    const int pool = int(found - pools_.begin());
    if (found == pools_.end()) pools_.push_back(Pool{rows, cols, spec.ns, spec.sharded});
    pools_[pool].count += experts;
    for (int64_t e = 0; e < experts; ++e) matrices_.push_back(Matrix{int64_t(i), e, pool, rank_, 0});
  }
}

void Muon::plan_owners() {
  // Sharded matrices: one owner in the job, cost-balanced. Private ones stay
  // with this rank.
  std::vector<int64_t> costs;
  std::vector<std::vector<int>> homes;
  std::vector<std::size_t> sharded;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const Pool& pool = pools_[matrices_[k].pool];
    if (!pool.shared) continue;
    sharded.push_back(k);
    costs.push_back(plan::ns_cost(pool.rows, pool.cols));
    std::vector<int> home;
    for (int g = 0; g < world_; ++g)
      if (shard_rows(matrices_[k], mesh_.shard[g]).second == pool.rows) home.push_back(g);
    homes.push_back(std::move(home));
  }
  assignment_ = assign_owners(costs, homes, world_);
  for (std::size_t j = 0; j < sharded.size(); ++j) matrices_[sharded[j]].owner = assignment_.owner[j];
}

void Muon::allocate_slots() {
  // Each owner's matrices of a pool side by side, so that its batch is one
  // contiguous tensor.
  std::vector<std::size_t> order(matrices_.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return matrices_[x].owner < matrices_[y].owner; });
  std::vector<int64_t> filled(pools_.size(), 0);
  for (std::size_t k : order) {
    Matrix& matrix = matrices_[k];
    Pool& pool = pools_[matrix.pool];
    matrix.slot = filled[matrix.pool]++;
    if (matrix.owner == rank_) {
      if (pool.mine_end == pool.mine_begin) pool.mine_begin = pool.mine_end = matrix.slot;
      pool.mine_end = matrix.slot + 1;
    }
  }
  // The sharded pools in one node-shared window, the others private.
  int64_t shared_bytes = 0;
  for (Pool& pool : pools_) {
    if (!pool.shared) {
      pool.slots = at::empty({pool.count, pool.rows, pool.cols}, at::kBFloat16);
      continue;
    }
    pool.offset = shared_bytes;
    shared_bytes += (pool.count * pool.rows * pool.cols * 2 + kAlign - 1) / kAlign * kAlign;
  }
  if (shared_bytes == 0) return;
  window_ = comm_->node().shared(shared_bytes);
  auto* base = static_cast<char*>(window_->data());
  for (Pool& pool : pools_)
    if (pool.shared) pool.slots = at::from_blob(base + pool.offset, {pool.count, pool.rows, pool.cols}, at::kBFloat16);
}

std::pair<int64_t, int64_t> Muon::shard_rows(const Matrix& matrix, int64_t shard) const {
  return plan::held_rows(params_[matrix.param].shape, shards_, shard, matrix.expert);
}

int64_t Muon::writer(int node, int64_t shard) const {
  for (int local = 0; local < local_world_; ++local)
    if (mesh_.shard[node * local_world_ + local] == shard) return local;
  return -1;
}

int64_t Muon::byte_offset(const Matrix& matrix, int64_t row) const {
  const Pool& pool = pools_[matrix.pool];
  return pool.offset + (matrix.slot * pool.rows + row) * pool.cols * 2;
}

void Muon::plan_pieces() {
  pieces_.assign(params_.size(), {});
  // Of several replicas on one node, the lowest writes the node's copy.
  const bool writes = world_ == 1 || writer(node_, shard_) == local_rank_;
  int64_t first = 0;  // index of the parameter's first matrix
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& spec = params_[i];
    const int64_t experts = spec.shape.size() == 3 ? spec.shape[0] : 1;
    const int64_t rows = spec.shape[spec.shape.size() - 2];
    if (!spec.sharded) {
      for (int64_t e = 0; e < experts; ++e)
        pieces_[i].push_back(Piece{first + e, spec.shape.size() == 3 ? e : -1, 0, rows, true});
    } else if (spec.shape.size() == 3) {
      const comm::Range mine = comm::chunk(experts, int(shards_), int(shard_));
      for (int64_t e = mine.begin; e < int64_t(mine.end); ++e)
        pieces_[i].push_back(Piece{first + e, e - int64_t(mine.begin), 0, rows, writes});
    } else {
      auto [begin, count] = shard_rows(matrices_[first], shard_);
      if (count > 0) pieces_[i].push_back(Piece{first, -1, begin, count, writes});
    }
    first += experts;
  }
  // Whether the pieces cover the local tensor (always so for hp.fully_shard's
  // shards): then the elementwise passes can run piece by piece.
  whole_.assign(params_.size(), false);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::vector<int64_t> local = local_shape(i);
    int64_t covered = 0;
    for (const Piece& piece : pieces_[i]) covered += piece.row_count * local.back();
    whole_[i] = covered == c10::multiply_integers(local);
  }
}

void Muon::count_peer_bytes() {
  // Rows that cross ranks in a step: those of this rank's matrices held by
  // others, and this rank's rows of others' results (bf16: 2 bytes).
  for (const Matrix& matrix : matrices_) {
    const Pool& pool = pools_[matrix.pool];
    if (pool.shared && matrix.owner == rank_)
      peer_bytes_ += (pool.rows - shard_rows(matrix, shard_).second) * pool.cols * 2;
  }
  for (const auto& pieces : pieces_)
    for (const Piece& piece : pieces) {
      const Matrix& matrix = matrices_[piece.matrix];
      const Pool& pool = pools_[matrix.pool];
      if (pool.shared && matrix.owner != rank_) peer_bytes_ += piece.row_count * pool.cols * 2;
    }
}

void Muon::plan_transfers() {
  if (nodes_ == 1) return;
  const Transfer none{std::vector<Ranges>(nodes_), std::vector<Ranges>(nodes_)};
  gather_ = none;
  results_.assign(pools_.size(), none);
  // Adjacent rows travel as one range.
  auto append = [](Ranges& ranges, std::pair<int64_t, int64_t> range) {
    if (!ranges.empty() && ranges.back().first + ranges.back().second == range.first)
      ranges.back().second += range.second;
    else
      ranges.push_back(range);
  };
  // Every rank walks the same matrices and shards in the same order, so both
  // ends of a link list its ranges in the same order.
  for (const Matrix& matrix : matrices_) {
    if (!pools_[matrix.pool].shared) continue;
    const int owner_node = matrix.owner / local_world_, owner_local = matrix.owner % local_world_;
    for (int64_t shard = 0; shard < shards_; ++shard) {
      auto [begin, count] = shard_rows(matrix, shard);
      if (count == 0) continue;
      const std::pair<int64_t, int64_t> range{byte_offset(matrix, begin), count * pools_[matrix.pool].cols * 2};
      // To the owner's node, if no rank there holds these rows: from the
      // first node that does, between counterparts.
      if (writer(owner_node, shard) < 0) {
        int from = 0;
        while (writer(from, shard) < 0) ++from;
        const int64_t local = writer(from, shard);
        if (node_ == from && local_rank_ == local) append(gather_.send[owner_node], range);
        if (node_ == owner_node && local_rank_ == local) append(gather_.recv[from], range);
      }
      // The update, from the owner to its counterpart on every other node
      // that holds these rows, which writes them into its node's buffer.
      for (int node = 0; node < nodes_; ++node) {
        if (node == owner_node || writer(node, shard) < 0) continue;
        if (rank_ == matrix.owner) append(results_[matrix.pool].send[node], range);
        if (node_ == node && local_rank_ == owner_local) append(results_[matrix.pool].recv[owner_node], range);
      }
    }
  }
}

Muon::Pending Muon::start(const Transfer& transfer) {
  Pending pending;
  pending.transfer = &transfer;
  std::vector<int64_t> send_sizes(nodes_, 0), recv_sizes(nodes_, 0);
  for (int node = 0; node < nodes_; ++node) {
    for (auto [offset, bytes] : transfer.send[node]) send_sizes[node] += bytes;
    for (auto [offset, bytes] : transfer.recv[node]) recv_sizes[node] += bytes;
  }
  auto total = [](const std::vector<int64_t>& sizes) {
    return std::accumulate(sizes.begin(), sizes.end(), int64_t(0));
  };
  pending.send = at::empty({total(send_sizes)}, at::kByte);
  pending.recv = at::empty({total(recv_sizes)}, at::kByte);
  const auto* base = static_cast<const char*>(window_->data());
  char* out = static_cast<char*>(pending.send.data_ptr());
  for (int node = 0; node < nodes_; ++node)
    for (auto [offset, bytes] : transfer.send[node]) {
      std::memcpy(out, base + offset, bytes);
      out += bytes;
    }
  pending.work = comm::c10d_compat::all_to_all_single(*counterparts_, pending.recv, pending.send, recv_sizes, send_sizes);
  return pending;
}

void Muon::finish(Pending& pending) {
  pending.work->wait();
  auto* base = static_cast<char*>(window_->data());
  const char* in = static_cast<const char*>(pending.recv.data_ptr());
  for (int node = 0; node < nodes_; ++node)
    for (auto [offset, bytes] : pending.transfer->recv[node]) {
      std::memcpy(base + offset, in, bytes);
      in += bytes;
    }
}

at::Tensor Muon::slot_rows(const Piece& piece) const {
  const Matrix& matrix = matrices_[piece.matrix];
  return pools_[matrix.pool].slots.select(0, matrix.slot).narrow(0, piece.row_begin, piece.row_count);
}

at::Tensor Muon::local_rows(const at::Tensor& local, const Piece& piece) {
  return piece.local_expert >= 0 ? local.select(0, piece.local_expert) : local;
}

std::vector<int64_t> Muon::local_shape(std::size_t i) const {
  std::vector<int64_t> shape = params_[i].shape;
  if (params_[i].sharded) shape[0] = comm::chunk(shape[0], int(shards_), int(shard_)).size();
  return shape;
}

void Muon::check_locals(const std::vector<at::Tensor>& tensors, const char* what) const {
  TORCH_CHECK(tensors.size() == params_.size(), "hp.optim.Muon: step got ", tensors.size(), " ", what,
              " tensors for a plan of ", params_.size(), " parameters");
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::vector<int64_t> expected = local_shape(i);
    TORCH_CHECK(tensors[i].sizes() == c10::IntArrayRef(expected), "hp.optim.Muon: ", what, " ", i,
                " has local shape ", tensors[i].sizes(), " but the plan expects ", shape_string(expected),
                " (of global shape ", shape_string(params_[i].shape), "); were the parameters resharded after the ",
                "optimizer was built?");
  }
}

void Muon::step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& momentum, const std::vector<StepOptions>& options) {
  check_locals(params, "parameter");
  check_locals(grads, "gradient");
  check_locals(momentum, "momentum buffer");
  TORCH_CHECK(options.size() == params_.size(), "hp.optim.Muon: step got ", options.size(),
              " option sets for ", params_.size(), " parameters");
  at::NoGradGuard no_grad;
  comm::NodeComm* node = window_ ? &comm_->node() : nullptr;

  // Momentum on this rank's rows; the rows of the matrices to orthogonalise
  // go into the buffer once per node.
  if (node) node->acquire(*window_);
  const MuonKernels& kernels = muon_kernels();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    at::Tensor buffer = momentum[i];
    // A replica whose node already has a piece's rows from another one
    // leaves that piece's slot alone.
    if (whole_[i] && plain_fp32(grads[i]) && plain_fp32(buffer)) {
      // One pass per piece: the momentum, and the update into the node's
      // buffer where this replica writes the piece.
      for (const Piece& piece : pieces_[i]) {
        at::Tensor rows = local_rows(buffer, piece);
        auto* slot = piece.write ? static_cast<simd::bf16*>(slot_rows(piece).data_ptr()) : nullptr;
        kernels.momentum(rows.data_ptr<float>(), local_rows(grads[i], piece).data_ptr<float>(), slot, rows.numel(),
                         o.momentum, o.nesterov);
      }
      continue;
    }
    buffer.lerp_(grads[i], 1.0 - o.momentum);
    auto writes = [](const Piece& piece) { return piece.write; };
    if (std::none_of(pieces_[i].begin(), pieces_[i].end(), writes)) continue;
    at::Tensor update = o.nesterov ? at::lerp(grads[i], buffer, o.momentum) : buffer;
    for (const Piece& piece : pieces_[i])
      if (piece.write) slot_rows(piece).copy_(local_rows(update, piece));
  }
  if (nodes_ > 1) {
    Pending gathered = start(gather_);
    finish(gathered);
  }
  if (node) node->publish(*window_);

  // Each owner orthogonalises its matrices in place, one batch per pool. The
  // rows of a pool's results that other nodes hold travel while the next
  // pool is orthogonalised.
  std::vector<Pending> sent;
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const Pool& pool = pools_[p];
    if (pool.mine_end > pool.mine_begin)
      newton_schulz_(pool.slots.narrow(0, pool.mine_begin, pool.mine_end - pool.mine_begin), pool.ns);
    if (nodes_ > 1 && pool.shared) sent.push_back(start(results_[p]));
  }
  for (Pending& pending : sent) finish(pending);
  if (node) node->publish(*window_);

  // torch.optim.Muon's update, on this rank's rows.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    at::Tensor param = params[i];
    const bool one_pass = whole_[i] && plain_fp32(param);
    if (!one_pass) param.mul_(1.0 - o.lr * o.weight_decay);
    for (const Piece& piece : pieces_[i]) {
      const Pool& pool = pools_[matrices_[piece.matrix].pool];
      const double alpha = -plan::adjusted_lr(o, pool.rows, pool.cols);
      at::Tensor rows = local_rows(param, piece), slot = slot_rows(piece);
      if (one_pass)
        kernels.apply(rows.data_ptr<float>(), static_cast<const simd::bf16*>(slot.const_data_ptr()), rows.numel(),
                      float(1.0 - o.lr * o.weight_decay), float(alpha));
      else
        rows.add_(slot, alpha);
    }
  }
  plan::add_peer_bytes(uint64_t(peer_bytes_));
}

std::vector<std::pair<int64_t, int64_t>> Muon::owned() const {
  std::vector<std::pair<int64_t, int64_t>> mine;
  for (const Matrix& matrix : matrices_)
    if (matrix.owner == rank_) mine.emplace_back(matrix.param, matrix.expert);
  return mine;
}

}  // namespace hp::optim
