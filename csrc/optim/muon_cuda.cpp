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
// Parameters that are not sharded (and every parameter of a one-rank job) are
// orthogonalised by the process that holds them, batched per shape, in memory
// lent by torch's caching allocator for the step only: the step runs when the
// activations are gone, so the next forward reuses that memory and the bf16
// copies raise the peak only where they outgrow the activations. Sharded
// parameters must be sharded within a node (hp.fully_shard's layout): on one
// node, or replicated across nodes (HSDP). There every node holds every shard
// and, after HSDP's all-reduce, the same gradients, so each matrix is
// orthogonalised on one node only and needs no rows from the others: its
// results go to the counterparts (the same local rank) on the other nodes
// over c10d (NCCL), a pool at a time, while the next pool is orthogonalised.
// A mesh whose shards span nodes is refused with a message.
// This file reaches CUDA only through c10's device interfaces and the
// torch-free device layer; it is linked where torch has CUDA.
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "hyperparallel/comm/c10d.h"
#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/fabric/device.h"
#include "hyperparallel/optim/muon.h"
#include "muon_kernels_cuda.h"
#include "muon_plan.h"

namespace hp::optim {
namespace {

constexpr int64_t kAlign = 256;  // sections and pools start where cudaMalloc's own alignment would

// Across nodes, a pool's results travel in rounds whose staging (this rank's
// rows, sent to every other node, and what it receives) stays about this
// size, beside a pool of experts that may be tens of GiB.
constexpr int64_t kExchangeBytes = int64_t(512) << 20;

int64_t align_up(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// A parameter, gradient or momentum the one-pass kernels take.
bool plain_fp32(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous(); }

fabric::StreamHandle current_stream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(device).native_handle();
}

class DeviceMuon : public MuonPlan {
 public:
  DeviceMuon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
             c10::intrusive_ptr<c10d::ProcessGroup> counterparts, c10::Device device);
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
    int owner = 0;                    // global rank
    int64_t index = 0;                // among its owner's matrices of the pool
    std::vector<int64_t> rows_at;     // per local rank: byte offset of its rows in its rows section (-1: none)
  };
  // One round of a pool's results between nodes: this rank's rows of its
  // node's results go to each other node's counterpart, whose rows of its
  // node's results come back, in matrix order on both sides.
  struct Exchange {
    fabric::CopyBatch pack;    // this rank's rows of its node's results into the send staging, once per other node
    fabric::CopyBatch unpack;  // the other nodes' results from the receive staging into the rows section
    std::vector<int64_t> send_sizes, recv_sizes;  // bytes, per node (the counterparts' group is in node order)
  };

  int me() const { return node_ * ranks_ + rank_; }
  // The node whose rank `local` orthogonalises `matrix`, of those that hold
  // it whole: an expert stack's experts in contiguous runs per node, so that
  // a shard's experts stay few runs of rows.
  int home_node(const Matrix& matrix, int local) const;
  void plan_exchanges();
  // Sends this rank's rows of pool `p`'s results to the other nodes and
  // receives its rows of theirs, on the results stream.
  void exchange(std::size_t p);

  // Rows [begin, begin + count) of `matrix` that shard `shard` holds.
  std::pair<int64_t, int64_t> shard_rows(const Matrix& matrix, int64_t shard) const;
  // Byte offset of row `row` of `matrix` in its owner's buffer.
  int64_t owned_at(const Matrix& matrix, int64_t row) const;
  // Byte offset of this rank's rows of sharded `matrix` in its own buffer:
  // in its owned section if it owns the matrix, else in its rows section.
  int64_t my_rows_at(const Matrix& matrix) const;
  // This rank's rows of `matrix` in its own buffer: where it writes them and
  // where it reads the result.
  at::Tensor my_rows(const Matrix& matrix) const;

  std::vector<ParamSpec> params_;
  comm::Communicator* comm_ = nullptr;
  c10::intrusive_ptr<c10d::ProcessGroup> counterparts_;
  c10::Device device_;
  int rank_ = 0, ranks_ = 1;  // within the node
  int node_ = 0, nodes_ = 1;
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
  std::vector<std::unique_ptr<fabric::DeviceSignal>> solved_;  // per pool (null if private): its owners' results are there
  fabric::CopyBatch gather_;                 // owners' pulls of their matrices' rows, planned once
  std::vector<fabric::CopyBatch> scatter_;   // per pool: this rank's pulls of its rows of the results
  // A parameter's rows in this rank's buffer as few tensors as the layout
  // allows: consecutive experts whose rows lie side by side are one run.
  struct Run {
    int64_t first = 0;  // local index along dim 0 (an expert), or 0 for a matrix
    at::Tensor rows;    // [count, rows, cols] for experts, [rows, cols] for a matrix
  };
  std::vector<std::vector<Run>> runs_;  // per parameter
  // The private pools' batches: views of one storage that holds memory only
  // during a step (lend_private, release_private).
  at::Tensor private_;
  int64_t private_bytes_ = 0;
  void lend_private();
  void release_private();
  c10::Stream results_stream_;          // the results' pulls, beside the next pool's Newton-Schulz
  fabric::DeviceEvent rows_pulled_;     // the owners' pulls of the rows, before Newton-Schulz
  fabric::DeviceEvent results_pulled_;
  std::vector<std::vector<Exchange>> exchanges_;  // per pool, its rounds (several nodes only)
  at::Tensor send_, recv_;                        // the rounds' staging
};

DeviceMuon::DeviceMuon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
                       c10::intrusive_ptr<c10d::ProcessGroup> counterparts, c10::Device device)
    : params_(std::move(params)),
      comm_(comm),
      counterparts_(std::move(counterparts)),
      device_(device),
      results_stream_(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, false)),
      rows_pulled_(device.index()),
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
    // One rank's shards are whole parameters: private, like plain ones.
    if (comm_->topology().world_size == 1) {
      for (ParamSpec& spec : params_) spec.sharded = false;
      any_sharded = false;
    }
  }
  if (any_sharded) {
    const fabric::Topology& topology = comm_->topology();
    rank_ = topology.local_rank;
    ranks_ = topology.local_world_size;
    node_ = topology.node;
    nodes_ = topology.num_nodes;
    const int world = topology.world_size;
    TORCH_CHECK(int(mesh.shard.size()) == world && int(mesh.replica.size()) == world,
                "hp.optim.Muon: the parameters' device mesh must hold every rank of the job (", world,
                " ranks), but it holds ", mesh.shard.size(), "; shard them over a mesh of all ranks");
    bool within_nodes = topology.rank == me();
    for (int g = 0; g < world; ++g) within_nodes &= mesh.shard[g] == g % ranks_ && mesh.replica[g] == g / ranks_;
    TORCH_CHECK(within_nodes, "hp.optim.Muon on CUDA: expected the parameters sharded within each node in rank ",
                "order and replicated across nodes (hp.fully_shard on a 1-D mesh over one node, or HSDP's ",
                "(nodes, ranks per node) mesh); a mesh whose shards span nodes runs on the CPU plan only");
    TORCH_CHECK(nodes_ == 1 || counterparts_, "hp.optim.Muon: a job over ", nodes_, " nodes needs each rank's c10d ",
                "group of counterparts (hp.comm.init makes it)");
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
      matrices_.push_back(Matrix{int64_t(i), e, pool, me(), 0, {}});
    }
  }

  // Owners: cost-balanced over the job; a rank that holds a matrix whole
  // (an expert of its shard) is its home, on the node home_node picks.
  // Private matrices stay here.
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
      if (shard_rows(matrices_[k], g).second == pool.rows) home.push_back(home_node(matrices_[k], g) * ranks_ + g);
    homes.push_back(std::move(home));
  }
  assignment_ = assign_owners(costs, homes, nodes_ * ranks_);
  for (std::size_t j = 0; j < sharded.size(); ++j) matrices_[sharded[j]].owner = assignment_.owner[j];

  // The owned section: per pool, each owner's matrices side by side (every
  // rank of the job, so that every node's layout is the same).
  const int world = nodes_ * ranks_;
  std::vector<int64_t> owned_bytes(world, 0);
  for (Pool& pool : pools_) {
    pool.owned_begin.assign(world, 0);
    pool.owned_count.assign(world, 0);
  }
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    Pool& pool = pools_[p];
    if (!pool.sharded) continue;
    for (int g = 0; g < world; ++g) pool.owned_begin[g] = owned_bytes[g];
    for (Matrix& matrix : matrices_) {
      if (matrix.pool != int(p)) continue;
      matrix.index = pool.owned_count[matrix.owner]++;
      owned_bytes[matrix.owner] += pool.bytes();
    }
    for (int g = 0; g < world; ++g) owned_bytes[g] = align_up(owned_bytes[g]);
  }
  rows_section_ = align_up(*std::max_element(owned_bytes.begin(), owned_bytes.end()));
  // The rows section: each rank's rows of the matrices others own (on this
  // node or another).
  std::vector<int64_t> rows_bytes(ranks_, 0);
  for (Matrix& matrix : matrices_) {
    matrix.rows_at.assign(ranks_, -1);
    if (!pools_[matrix.pool].sharded) continue;
    for (int g = 0; g < ranks_; ++g) {
      const int64_t count = shard_rows(matrix, g).second;
      if (count == 0 || matrix.owner == node_ * ranks_ + g) continue;
      matrix.rows_at[g] = rows_section_ + rows_bytes[g];
      // 16-byte starts: the one-pass kernels take their vector path only
      // where every pointer they get is aligned.
      rows_bytes[g] += (count * pools_[matrix.pool].cols * 2 + 15) / 16 * 16;
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
    for (const Pool& pool : pools_)  // collective, and the same pools on every rank
      solved_.push_back(pool.sharded ? std::make_unique<fabric::DeviceSignal>(*comm_->fabric(), device_.index())
                                     : nullptr);
  }
  // This process's own matrices: each private pool a batch in the private
  // storage, allocated here to make the views, and released until a step.
  std::vector<int64_t> private_at(pools_.size(), 0), private_count(pools_.size(), 0);
  for (Matrix& matrix : matrices_)
    if (!pools_[matrix.pool].sharded) matrix.index = private_count[matrix.pool]++;
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    private_at[p] = private_bytes_;
    if (!pools_[p].sharded) private_bytes_ += align_up(private_count[p] * pools_[p].bytes());
  }
  private_ = at::empty({private_bytes_}, at::TensorOptions().dtype(at::kByte).device(device_));
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    Pool& pool = pools_[p];
    if (!pool.sharded) {
      const int64_t count = private_count[p];
      pool.batch =
          private_.narrow(0, private_at[p], count * pool.bytes()).view(at::kBFloat16).view({count, pool.rows, pool.cols});
      continue;
    }
    const int64_t count = pool.owned_count[me()];
    pool.batch = bytes_.narrow(0, pool.owned_begin[me()], count * pool.bytes())
                     .view(at::kBFloat16)
                     .view({count, pool.rows, pool.cols});
  }

  // The pulls, planned once, of the matrices this node orthogonalises:
  // owners pull their matrices' rows from the holders; holders pull their
  // rows of the results from the owners.
  scatter_.resize(pools_.size());
  for (const Matrix& matrix : matrices_) {
    const Pool& pool = pools_[matrix.pool];
    if (!pool.sharded || matrix.owner / ranks_ != node_) continue;
    const int owner = matrix.owner % ranks_;
    for (int g = 0; g < ranks_; ++g) {
      auto [begin, count] = shard_rows(matrix, g);
      if (count == 0 || g == owner) continue;
      const int64_t bytes = count * pool.cols * 2;
      if (owner == rank_ || g == rank_) peer_bytes_ += bytes;
      if (owner == rank_)
        gather_.add(static_cast<char*>(buffer_->local()) + owned_at(matrix, begin),
                    static_cast<const char*>(buffer_->peer(g)) + matrix.rows_at[g], bytes);
      if (g == rank_)
        scatter_[matrix.pool].add(static_cast<char*>(buffer_->local()) + matrix.rows_at[g],
                                  static_cast<const char*>(buffer_->peer(owner)) + owned_at(matrix, begin), bytes);
    }
  }
  if (nodes_ > 1) plan_exchanges();

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
      const bool in_batch = !pools_[matrix.pool].sharded || matrix.owner == me();
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
  release_private();
}

void DeviceMuon::lend_private() {
  if (private_bytes_ == 0) return;
  // From the caching allocator on the current stream, which alone touches
  // the private batches; released back to it on that stream.
  at::Tensor fresh = at::empty({private_bytes_}, at::TensorOptions().dtype(at::kByte).device(device_));
  c10::StorageImpl* storage = private_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(std::move(fresh.storage().unsafeGetStorageImpl()->mutable_data_ptr()));
  storage->set_nbytes(private_bytes_);
}

void DeviceMuon::release_private() {
  c10::StorageImpl* storage = private_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
  storage->set_nbytes(0);
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

int64_t DeviceMuon::my_rows_at(const Matrix& matrix) const {
  return matrix.owner == me() ? owned_at(matrix, shard_rows(matrix, rank_).first) : matrix.rows_at[rank_];
}

at::Tensor DeviceMuon::my_rows(const Matrix& matrix) const {
  const Pool& pool = pools_[matrix.pool];
  if (!pool.sharded) return pool.batch.select(0, matrix.index);
  const int64_t count = shard_rows(matrix, rank_).second;
  return bytes_.narrow(0, my_rows_at(matrix), count * pool.cols * 2).view(at::kBFloat16).view({count, pool.cols});
}

int DeviceMuon::home_node(const Matrix& matrix, int local) const {
  const auto& shape = params_[matrix.param].shape;
  if (shape.size() == 2) return int(matrix.param % nodes_);  // one rank per node: every node holds it whole
  const comm::Range experts = comm::chunk(shape[0], int(shards_), local);
  return int((matrix.expert - int64_t(experts.begin)) * nodes_ / int64_t(experts.size()));
}

void DeviceMuon::plan_exchanges() {
  // A round's pieces: per node, this rank's rows of the results that node
  // computes, in matrix order. Rounds end where this rank's rows of the pool
  // pass the limit: the same cuts on every node, since counterparts hold the
  // same rows.
  struct Piece {
    char* at;  // in this rank's buffer
    int64_t bytes;
  };
  using Round = std::vector<std::vector<Piece>>;  // [node][piece]
  const int64_t limit = std::max<int64_t>(kExchangeBytes / nodes_, 1);
  char* local = static_cast<char*>(buffer_->local());
  std::vector<std::vector<Round>> rounds(pools_.size());
  int64_t send_bytes = 0, recv_bytes = 0;
  exchanges_.resize(pools_.size());
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const Pool& pool = pools_[p];
    if (!pool.sharded) continue;
    int64_t filled = 0;
    for (const Matrix& matrix : matrices_) {
      if (matrix.pool != int(p)) continue;
      const int64_t count = shard_rows(matrix, rank_).second, bytes = count * pool.cols * 2;
      if (count == 0) continue;
      if (rounds[p].empty() || (filled > 0 && filled + bytes > limit)) {
        rounds[p].emplace_back(nodes_);
        filled = 0;
      }
      rounds[p].back()[matrix.owner / ranks_].push_back(Piece{local + my_rows_at(matrix), bytes});
      filled += bytes;
    }
    for (const Round& round : rounds[p]) {
      Exchange& exchange = exchanges_[p].emplace_back();
      exchange.send_sizes.assign(nodes_, 0);
      exchange.recv_sizes.assign(nodes_, 0);
      int64_t mine = 0, theirs = 0;
      for (const Piece& piece : round[node_]) mine += piece.bytes;
      for (int node = 0; node < nodes_; ++node) {
        if (node == node_) continue;
        exchange.send_sizes[node] = mine;
        for (const Piece& piece : round[node]) exchange.recv_sizes[node] += piece.bytes;
        theirs += exchange.recv_sizes[node];
      }
      send_bytes = std::max(send_bytes, mine * (nodes_ - 1));
      recv_bytes = std::max(recv_bytes, theirs);
    }
  }
  const auto staging = at::TensorOptions().dtype(at::kByte).device(device_);
  send_ = at::empty({send_bytes}, staging);
  recv_ = at::empty({recv_bytes}, staging);
  // The copies, now that the staging's addresses are known: the send
  // staging holds this rank's pieces once per other node, in node order,
  // and the receive staging each other node's pieces, in node order.
  char* send = static_cast<char*>(send_.data_ptr());
  char* recv = static_cast<char*>(recv_.data_ptr());
  for (std::size_t p = 0; p < pools_.size(); ++p)
    for (std::size_t r = 0; r < rounds[p].size(); ++r) {
      Exchange& exchange = exchanges_[p][r];
      int64_t sent = 0, received = 0;
      for (int node = 0; node < nodes_; ++node) {
        if (node == node_) continue;
        for (const Piece& piece : rounds[p][r][node_]) {
          exchange.pack.add(send + sent, piece.at, piece.bytes);
          sent += piece.bytes;
        }
        for (const Piece& piece : rounds[p][r][node]) {
          exchange.unpack.add(piece.at, recv + received, piece.bytes);
          received += piece.bytes;
        }
      }
    }
}

void DeviceMuon::exchange(std::size_t p) {
  // The collectives follow the current stream (NCCL's start waits for it,
  // and wait() makes it wait for their end): the results stream, so the
  // rounds overlap the next pool's Newton–Schulz on the compute stream.
  c10::StreamGuard on_results(results_stream_);
  const fabric::StreamHandle results = results_stream_.native_handle();
  for (Exchange& round : exchanges_[p]) {
    round.pack.run(results);
    int64_t sent = 0, received = 0;
    for (int node = 0; node < nodes_; ++node) {
      sent += round.send_sizes[node];
      received += round.recv_sizes[node];
    }
    at::Tensor send = send_.narrow(0, 0, sent), recv = recv_.narrow(0, 0, received);
    comm::c10d_compat::all_to_all_single(*counterparts_, recv, send, round.recv_sizes, round.send_sizes)->wait();
    round.unpack.run(results);
  }
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
  // The private batches' memory, for this step only (given back on a throw too).
  lend_private();
  struct Lent {
    DeviceMuon* plan;
    ~Lent() { plan->release_private(); }
  } lent{this};

  // torch.optim.Muon's momentum on this rank's rows; the update's rows, in
  // bfloat16, where their owner will read them. The nesterov update is
  // computed in float32 and rounded as it is stored: lerp then copy's bits,
  // without the float32 update in between. One pass per run (its rows of the
  // gradient and momentum in, the momentum and the update out) where the
  // tensors are plain; ATen's lerp_ and lerp otherwise, the same bits.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    auto rows_of = [&](const at::Tensor& t, const Run& run) {
      return params_[i].shape.size() == 2 ? t : t.narrow(0, run.first, run.rows.size(0));
    };
    if (plain_fp32(grads[i]) && plain_fp32(momentum[i])) {
      for (const Run& run : runs_[i])
        cuda::momentum(rows_of(momentum[i], run).data_ptr<float>(), rows_of(grads[i], run).const_data_ptr<float>(),
                       static_cast<uint16_t*>(run.rows.data_ptr()), run.rows.numel(), o.momentum, o.nesterov, stream);
      continue;
    }
    momentum[i].lerp_(grads[i], 1.0 - o.momentum);
    for (const Run& run : runs_[i]) {
      at::Tensor rows = run.rows;
      if (o.nesterov)
        at::lerp_out(rows, rows_of(grads[i], run), rows_of(momentum[i], run), o.momentum);
      else
        rows.copy_(rows_of(momentum[i], run));
    }
  }
  const fabric::StreamHandle results = results_stream_.native_handle();
  if (written_) {
    // The owners' pulls go on the results stream, and the compute stream
    // waits for them: torch's default stream is the legacy one, which the
    // copy batch API refuses (a copy call per piece there, thousands of
    // them with many experts).
    const uint64_t round = written_->post(stream);
    written_->wait_all(round, results, "hp.optim.Muon (waiting for peers' rows)");
    gather_.run(results);
    rows_pulled_.record(results);
    rows_pulled_.wait(stream);
  }
  // Each pool's results travel on their own stream while the next pool is
  // orthogonalised.
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const Pool& pool = pools_[p];
    if (pool.batch.size(0) > 0) newton_schulz_(pool.batch, pool.ns);
    if (!pool.sharded) continue;
    const uint64_t round = solved_[p]->post(stream);
    solved_[p]->wait_all(round, results, "hp.optim.Muon (waiting for owners' results)");
    scatter_[p].run(results);
    if (nodes_ > 1) exchange(p);
  }
  plan::add_peer_bytes(uint64_t(peer_bytes_));
  if (read_) {
    read_->post(results);
    results_pulled_.record(results);
    results_pulled_.wait(stream);
  }

  // torch.optim.Muon's update on this rank's rows: one pass per run (the
  // runs cover the local parameter) where it is plain, else mul_ and add_.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const StepOptions& o = options[i];
    const auto& shape = params_[i].shape;
    const double alpha = -plan::adjusted_lr(o, shape[shape.size() - 2], shape.back());
    const double decay = 1.0 - o.lr * o.weight_decay;
    const bool one_pass = plain_fp32(params[i]);
    if (!one_pass) params[i].mul_(decay);
    for (const Run& run : runs_[i]) {
      at::Tensor rows = shape.size() == 2 ? params[i] : params[i].narrow(0, run.first, run.rows.size(0));
      if (one_pass)
        cuda::apply(rows.data_ptr<float>(), static_cast<const uint16_t*>(run.rows.const_data_ptr()), rows.numel(),
                    float(decay), float(alpha), stream);
      else
        rows.add_(run.rows, alpha);
    }
  }
}

std::vector<std::pair<int64_t, int64_t>> DeviceMuon::owned() const {
  std::vector<std::pair<int64_t, int64_t>> mine;
  for (const Matrix& matrix : matrices_)
    if (matrix.owner == me()) mine.emplace_back(matrix.param, matrix.expert);
  return mine;
}

std::shared_ptr<MuonPlan> make_device_muon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
                                           c10::intrusive_ptr<c10d::ProcessGroup> counterparts, c10::Device device) {
  return std::make_shared<DeviceMuon>(std::move(params), comm, std::move(mesh), std::move(counterparts), device);
}

const bool registered = (register_muon_factory(c10::DeviceType::CUDA, &make_device_muon), true);

}  // namespace
}  // namespace hp::optim
