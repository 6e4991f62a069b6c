// hp.optim.Muon on CUDA (see muon.h): each matrix orthogonalised by exactly
// one rank of the node, same-shape matrices in one batched Newton–Schulz.
//
// Every rank keeps one device buffer that its peers map (fabric::PeerMemory),
// in two sections laid out identically on every rank's computation of every
// rank's plan:
// - owned: the full matrices this rank orthogonalises, each pool's side by
//   side, so that a pool is one [count, rows, cols] bfloat16 batch;
// - rows: this rank's rows of the matrices others own.
// A step: each rank writes its rows of the momentum-updated matrices (into
// its owned section where it owns the matrix, so a rank that holds a whole
// expert orthogonalises it with no copy at all); owners pull the rest of
// their matrices' rows from the holders' rows sections; each pool is one
// Newton–Schulz; every rank pulls its rows of the others' results back into
// its rows section and applies its update. Pulls are batched copies on the
// copy engines; the three hand-overs are DeviceSignal rounds, so the host
// never waits on the GPU.
//
// Parameters that are not sharded are orthogonalised by the process that
// holds them, batched per shape. Sharded parameters must be hp.fully_shard's
// (each node holds every shard); a mesh whose shards span nodes, and HSDP's
// cross-node delivery of results, are refused for now with a message.
// This file reaches CUDA only through c10's device interfaces and the
// torch-free device layer; it is linked where torch has CUDA.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/fabric/device.h"
#include "hyperparallel/optim/muon.h"
#include "muon_plan.h"

namespace hp::optim {
namespace {

constexpr int64_t kAlign = 256;  // sections and pools start where cudaMalloc's own alignment would

int64_t align_up(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

fabric::StreamHandle current_stream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(device).native_handle();
}

class DeviceMuon : public MuonPlan {
 public:
  DeviceMuon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh, c10::Device device);
  // Waits until every peer has finished reading this rank's buffer: a plan
  // rebuilt in its place may get the same addresses back.
  ~DeviceMuon() override;
  void step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
            const std::vector<at::Tensor>& momentum, const std::vector<StepOptions>& options) override;
  std::vector<std::pair<int64_t, int64_t>> owned() const override;
  double balance() const override { return assignment_.balance(); }

 private:
  struct Pool {
    int64_t rows = 0, cols = 0;
    NsOptions ns;
    bool sharded = false;
    std::vector<int64_t> owned_begin;  // per rank: its first byte in the owned section (sharded pools)
    std::vector<int64_t> owned_count;  // per rank: matrices of this pool it owns
    at::Tensor batch;                  // this rank's matrices of the pool, [count, rows, cols] bfloat16
    int64_t bytes() const { return rows * cols * 2; }
  };
  struct Matrix {
    int64_t param = 0, expert = 0;
    int pool = 0;
    int owner = 0;
    int64_t index = 0;                // among its owner's matrices of the pool
    std::vector<int64_t> rows_at;     // per rank: byte offset of its rows in its rows section (-1: none there)
  };

  // Rows [begin, begin + count) of `matrix` that shard `shard` holds.
  std::pair<int64_t, int64_t> shard_rows(const Matrix& matrix, int64_t shard) const;
  // Byte offset of row `row` of `matrix` in its owner's buffer.
  int64_t owned_at(const Matrix& matrix, int64_t row) const;
  // This rank's rows of `matrix` in its own buffer: where it writes them and
  // where it reads the result.
  at::Tensor my_rows(const Matrix& matrix) const;

  std::vector<ParamSpec> params_;
  comm::Communicator* comm_ = nullptr;
  c10::Device device_;
  int rank_ = 0, ranks_ = 1;
  int64_t shards_ = 1;
  std::vector<Pool> pools_;
  std::vector<Matrix> matrices_;
  std::vector<std::vector<int64_t>> matrices_of_;  // per parameter
  Assignment assignment_;
  int64_t rows_section_ = 0;  // byte offset of the rows section, the same on every rank
  int64_t peer_bytes_ = 0;    // pulled from peers each step (muon_peer_bytes)
  std::shared_ptr<fabric::PeerMemory> buffer_;
  at::Tensor bytes_;  // this rank's buffer as bytes
  std::unique_ptr<fabric::DeviceSignal> written_, read_;
  std::vector<std::unique_ptr<fabric::DeviceSignal>> solved_;  // per pool: its owners' results are there
  fabric::CopyBatch gather_;                 // owners' pulls of their matrices' rows, planned once
  std::vector<fabric::CopyBatch> scatter_;   // per pool: this rank's pulls of its rows of the results
  // A parameter's rows in this rank's buffer as few tensors as the layout
  // allows: consecutive experts whose rows lie side by side are one run.
  struct Run {
    int64_t first = 0;  // local index along dim 0 (an expert), or 0 for a matrix
    at::Tensor rows;    // [count, rows, cols] for experts, [rows, cols] for a matrix
  };
  std::vector<std::vector<Run>> runs_;  // per parameter
  c10::Stream results_stream_;          // the results' pulls, beside the next pool's Newton-Schulz
  fabric::DeviceEvent results_pulled_;
};

DeviceMuon::DeviceMuon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh, c10::Device device)
    : params_(std::move(params)),
      comm_(comm),
      device_(device),
      results_stream_(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, false)),
      results_pulled_(device.index()) {
  c10::DeviceGuard guard(device_);
  bool any_sharded = false;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& shape = params_[i].shape;
    TORCH_CHECK(shape.size() == 2 || shape.size() == 3, "hp.optim.Muon: parameter ", i, " has shape ",
                c10::IntArrayRef(shape), "; Muon takes matrices (2-D) and stacks of expert matrices (3-D)");
    any_sharded |= params_[i].sharded;
  }
  if (any_sharded) {
    TORCH_CHECK(comm_, "hp.optim.Muon: sharded (DTensor) parameters need the fabric; call hp.comm.init() first");
    const fabric::Topology& topology = comm_->topology();
    TORCH_CHECK(topology.num_nodes == 1,
                "hp.optim.Muon on CUDA: the job spans ", topology.num_nodes, " nodes; on GPUs hp.optim.Muon "
                "runs within one node for now (HSDP across nodes: use one Muon per node's replica, or the CPU)");
    rank_ = topology.local_rank;
    ranks_ = topology.local_world_size;
    TORCH_CHECK(int(mesh.shard.size()) == ranks_, "hp.optim.Muon: the parameters' mesh must hold every rank");
    for (int g = 0; g < ranks_; ++g)
      TORCH_CHECK(mesh.shard[g] == g, "hp.optim.Muon on CUDA: expected the shard dimension in rank order (FSDP's "
                  "1-D mesh over one node)");
    shards_ = ranks_;
  }

  // Matrices and pools: one pool per shape and Newton–Schulz options,
  // sharded and private apart.
  matrices_of_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& spec = params_[i];
    const int64_t dims = spec.shape.size(), experts = dims == 3 ? spec.shape[0] : 1;
    const int64_t rows = spec.shape[dims - 2], cols = spec.shape[dims - 1];
    auto found = std::find_if(pools_.begin(), pools_.end(), [&](const Pool& pool) {
      return pool.rows == rows && pool.cols == cols && pool.ns == spec.ns && pool.sharded == spec.sharded;
    });
    const int pool = int(found - pools_.begin());
    if (found == pools_.end()) {
      Pool& added = pools_.emplace_back();
      added.rows = rows;
      added.cols = cols;
      added.ns = spec.ns;
      added.sharded = spec.sharded;
    }
    for (int64_t e = 0; e < experts; ++e) {
      matrices_of_[i].push_back(int64_t(matrices_.size()));
      matrices_.push_back(Matrix{int64_t(i), e, pool, rank_, 0, {}});
    }
  }

  // Owners: cost-balanced over the node; a rank that holds a matrix whole
  // (an expert of its shard) is its home. Private matrices stay here.
  std::vector<int64_t> costs;
  std::vector<std::vector<int>> homes;
  std::vector<std::size_t> sharded;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const Pool& pool = pools_[matrices_[k].pool];
    if (!pool.sharded) continue;
    sharded.push_back(k);
    costs.push_back(plan::ns_cost(pool.rows, pool.cols));
    std::vector<int> home;
    for (int g = 0; g < ranks_; ++g)
      if (shard_rows(matrices_[k], g).second == pool.rows) home.push_back(g);
    homes.push_back(std::move(home));
  }
  assignment_ = assign_owners(costs, homes, ranks_);
  for (std::size_t j = 0; j < sharded.size(); ++j) matrices_[sharded[j]].owner = assignment_.owner[j];

  // The owned section: per pool, each owner's matrices side by side.
  std::vector<int64_t> owned_bytes(ranks_, 0);
  for (Pool& pool : pools_) {
    pool.owned_begin.assign(ranks_, 0);
    pool.owned_count.assign(ranks_, 0);
  }
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    Pool& pool = pools_[p];
    if (!pool.sharded) continue;
    for (int g = 0; g < ranks_; ++g) pool.owned_begin[g] = owned_bytes[g];
    for (Matrix& matrix : matrices_) {
      if (matrix.pool != int(p)) continue;
      matrix.index = pool.owned_count[matrix.owner]++;
      owned_bytes[matrix.owner] += pool.bytes();
    }
    for (int g = 0; g < ranks_; ++g) owned_bytes[g] = align_up(owned_bytes[g]);
  }
  rows_section_ = align_up(*std::max_element(owned_bytes.begin(), owned_bytes.end()));
  // The rows section: each rank's rows of the matrices others own.
  std::vector<int64_t> rows_bytes(ranks_, 0);
  for (Matrix& matrix : matrices_) {
    matrix.rows_at.assign(ranks_, -1);
    if (!pools_[matrix.pool].sharded) continue;
    for (int g = 0; g < ranks_; ++g) {
      const int64_t count = shard_rows(matrix, g).second;
      if (count == 0 || g == matrix.owner) continue;
      matrix.rows_at[g] = rows_section_ + rows_bytes[g];
      rows_bytes[g] += count * pools_[matrix.pool].cols * 2;
    }
  }
  if (!sharded.empty()) {
    const int64_t total = rows_section_ + *std::max_element(rows_bytes.begin(), rows_bytes.end());
    buffer_ = std::make_shared<fabric::PeerMemory>(*comm_->fabric(), device_.index(), std::max<int64_t>(total, 1));
    auto memory = buffer_;
    bytes_ = at::from_blob(buffer_->local(), {std::max<int64_t>(total, 1)}, [memory](void*) {},
                           at::TensorOptions().dtype(at::kByte).device(device_));
    written_ = std::make_unique<fabric::DeviceSignal>(*comm_->fabric(), device_.index());
    read_ = std::make_unique<fabric::DeviceSignal>(*comm_->fabric(), device_.index());
    for (std::size_t p = 0; p < pools_.size(); ++p)
      solved_.push_back(std::make_unique<fabric::DeviceSignal>(*comm_->fabric(), device_.index()));
  }
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    Pool& pool = pools_[p];
    if (!pool.sharded) {  // this process's own matrices: a private batch
      int64_t count = 0;
      for (Matrix& matrix : matrices_)
        if (matrix.pool == int(p)) matrix.index = count++;
      pool.batch = at::empty({count, pool.rows, pool.cols}, at::TensorOptions().dtype(at::kBFloat16).device(device_));
      continue;
    }
    const int64_t count = pool.owned_count[rank_];
    pool.batch = bytes_.narrow(0, pool.owned_begin[rank_], count * pool.bytes())
                     .view(at::kBFloat16)
                     .view({count, pool.rows, pool.cols});
  }

  // The pulls, planned once: owners pull their matrices' rows from the
  // holders; holders pull their rows of the results from the owners.
  scatter_.resize(pools_.size());
  for (const Matrix& matrix : matrices_) {
    const Pool& pool = pools_[matrix.pool];
    if (!pool.sharded) continue;
    for (int g = 0; g < ranks_; ++g) {
      auto [begin, count] = shard_rows(matrix, g);
      if (count == 0 || g == matrix.owner) continue;
      const int64_t bytes = count * pool.cols * 2;
      if (matrix.owner == rank_ || g == rank_) peer_bytes_ += bytes;
      if (matrix.owner == rank_)
        gather_.add(static_cast<char*>(buffer_->local()) + owned_at(matrix, begin),
                    static_cast<const char*>(buffer_->peer(g)) + matrix.rows_at[g], bytes);
      if (g == rank_)
        scatter_[matrix.pool].add(static_cast<char*>(buffer_->local()) + matrix.rows_at[g],
                                  static_cast<const char*>(buffer_->peer(matrix.owner)) + owned_at(matrix, begin),
                                  bytes);
    }
  }

  // Runs of each parameter's rows in this rank's buffer: a matrix's rows are
  // its slot in a batch (private, or owned here) or its entry in the rows
  // section; consecutive experts in consecutive places make one run.
  runs_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& spec = params_[i];
    if (spec.shape.size() == 2) {
      if (shard_rows(matrices_[matrices_of_[i][0]], rank_).second > 0)
        runs_[i].push_back(Run{0, my_rows(matrices_[matrices_of_[i][0]])});
      continue;
    }
    const int64_t first_expert =
        spec.sharded ? int64_t(comm::chunk(spec.shape[0], int(shards_), rank_).begin) : 0;
    const int64_t rows = spec.shape[1], cols = spec.shape[2], bytes = rows * cols * 2;
    struct Place {
      bool in_batch = false;
      int64_t at = -1;  // batch index, or byte offset in the rows section
    };
    auto place_of = [&](const Matrix& matrix) {
      const bool in_batch = !pools_[matrix.pool].sharded || matrix.owner == rank_;
      return Place{in_batch, in_batch ? matrix.index : matrix.rows_at[rank_]};
    };
    Place start, last;
    int64_t start_expert = -1, count = 0;
    auto flush = [&] {
      if (count == 0) return;
      const Pool& pool = pools_[matrices_[matrices_of_[i][0]].pool];
      at::Tensor view = start.in_batch ? pool.batch.narrow(0, start.at, count)
                                       : bytes_.narrow(0, start.at, count * bytes)
                                             .view(at::kBFloat16)
                                             .view({count, rows, cols});
      runs_[i].push_back(Run{start_expert - first_expert, view});
      count = 0;
    };
    for (int64_t k : matrices_of_[i]) {
      const Matrix& matrix = matrices_[k];
      if (shard_rows(matrix, rank_).second == 0) continue;
      const Place place = place_of(matrix);
      const bool follows = count > 0 && place.in_batch == last.in_batch &&
                           place.at == last.at + (place.in_batch ? 1 : bytes);
      if (!follows) {
        flush();
        start = place;
        start_expert = matrix.expert;
      }
      last = place;
      ++count;
    }
    flush();
  }
}

DeviceMuon::~DeviceMuon() {
  try {
    if (read_ && read_->posted() > 0) {
      c10::DeviceGuard guard(device_);
      const fabric::StreamHandle stream = current_stream(device_);
      read_->wait_all(read_->posted(), stream, "hp.optim.Muon (peers finishing reading before the plan goes)");
      fabric::device::synchronize(stream);
    }
  } catch (...) {
    // A peer died or the runtime is gone (exit): there is no one left to read.
  }
}

std::pair<int64_t, int64_t> DeviceMuon::shard_rows(const Matrix& matrix, int64_t shard) const {
  const auto& shape = params_[matrix.param].shape;
  if (!params_[matrix.param].sharded) return {0, shard == rank_ ? shape[shape.size() - 2] : 0};
  return plan::held_rows(shape, shards_, shard, matrix.expert);
}

int64_t DeviceMuon::owned_at(const Matrix& matrix, int64_t row) const {
  const Pool& pool = pools_[matrix.pool];
  return pool.owned_begin[matrix.owner] + matrix.index * pool.bytes() + row * pool.cols * 2;
}

at::Tensor DeviceMuon::my_rows(const Matrix& matrix) const {
  const Pool& pool = pools_[matrix.pool];
  if (!pool.sharded) return pool.batch.select(0, matrix.index);
  auto [begin, count] = shard_rows(matrix, rank_);
  const int64_t at = matrix.owner == rank_ ? owned_at(matrix, begin) : matrix.rows_at[rank_];
  return bytes_.narrow(0, at, count * pool.cols * 2).view(at::kBFloat16).view({count, pool.cols});
}

void DeviceMuon::step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& momentum, const std::vector<StepOptions>& options) {
  TORCH_CHECK(params.size() == params_.size() && grads.size() == params_.size() &&
                  momentum.size() == params_.size() && options.size() == params_.size(),
              "hp.optim.Muon: step got lists of ", params.size(), ", ", grads.size(), ", ", momentum.size(), " and ",
              options.size(), " for a plan of ", params_.size(), " parameters");
  for (std::size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].device() == device_ && grads[i].device() == device_ && momentum[i].device() == device_,
                "hp.optim.Muon: parameter ", i, " (or its gradient or momentum) is on ", params[i].device(),
                " but the plan on ", device_);
    std::vector<int64_t> expected = params_[i].shape;
    if (params_[i].sharded) expected[0] = comm::chunk(expected[0], int(shards_), rank_).size();
    for (const at::Tensor* t : {&params[i], &grads[i], &momentum[i]})
      TORCH_CHECK(t->sizes() == c10::IntArrayRef(expected), "hp.optim.Muon: parameter ", i, " has local shape ",
                  t->sizes(), " (or its gradient or momentum) but the plan expects ", c10::IntArrayRef(expected),
                  "; were the parameters resharded after the optimizer was built?");
  }
  c10::DeviceGuard guard(device_);
  at::NoGradGuard no_grad;
  const fabric::StreamHandle stream = current_stream(device_);
  // Peers have finished reading this rank's buffer from the last step.
  if (read_ && read_->posted() > 0) read_->wait_all(read_->posted(), stream, "hp.optim.Muon (peers finishing the last step)");

  // torch.optim.Muon's momentum on this rank's rows; the update's rows, in
  // bfloat16, where their owner will read them. The nesterov update is
  // computed in float32 and rounded as it is stored: lerp then copy's bits,
  // without the float32 update in between.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    momentum[i].lerp_(grads[i], 1.0 - o.momentum);
    for (const Run& run : runs_[i]) {
      auto rows_of = [&](const at::Tensor& t) {
        return params_[i].shape.size() == 2 ? t : t.narrow(0, run.first, run.rows.size(0));
      };
      at::Tensor rows = run.rows;
      if (o.nesterov)
        at::lerp_out(rows, rows_of(grads[i]), rows_of(momentum[i]), o.momentum);
      else
        rows.copy_(rows_of(momentum[i]));
    }
  }
  if (written_) {
    const uint64_t round = written_->post(stream);
    written_->wait_all(round, stream, "hp.optim.Muon (waiting for peers' rows)");
    gather_.run(stream);
  }
  // Each pool's results travel on their own stream while the next pool is
  // orthogonalised.
  const fabric::StreamHandle results = results_stream_.native_handle();
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const Pool& pool = pools_[p];
    if (pool.batch.size(0) > 0) newton_schulz_(pool.batch, pool.ns);
    if (!pool.sharded) continue;
    const uint64_t round = solved_[p]->post(stream);
    solved_[p]->wait_all(round, results, "hp.optim.Muon (waiting for owners' results)");
    scatter_[p].run(results);
  }
  plan::add_peer_bytes(uint64_t(peer_bytes_));
  if (read_) {
    read_->post(results);
    results_pulled_.record(results);
    results_pulled_.wait(stream);
  }

  // torch.optim.Muon's update on this rank's rows.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    const auto& shape = params_[i].shape;
    const double alpha = -plan::adjusted_lr(o, shape[shape.size() - 2], shape.back());
    params[i].mul_(1.0 - o.lr * o.weight_decay);
    for (const Run& run : runs_[i])
      (shape.size() == 2 ? params[i] : params[i].narrow(0, run.first, run.rows.size(0))).add_(run.rows, alpha);
  }
}

std::vector<std::pair<int64_t, int64_t>> DeviceMuon::owned() const {
  std::vector<std::pair<int64_t, int64_t>> mine;
  for (const Matrix& matrix : matrices_)
    if (matrix.owner == rank_) mine.emplace_back(matrix.param, matrix.expert);
  return mine;
}

std::shared_ptr<MuonPlan> make_device_muon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
                                           c10::intrusive_ptr<c10d::ProcessGroup>, c10::Device device) {
  return std::make_shared<DeviceMuon>(std::move(params), comm, std::move(mesh), device);
}

const bool registered = (register_muon_factory(c10::DeviceType::CUDA, &make_device_muon), true);

}  // namespace
}  // namespace hp::optim
