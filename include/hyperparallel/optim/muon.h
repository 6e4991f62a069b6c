// Muon with torch.optim.Muon's numerics, distributed without duplicated
// Newton–Schulz: every matrix is orthogonalised exactly once in the job.
//
// A step, for parameters sharded over a data-parallel mesh (FSDP's DTensor
// Shard(0), or HSDP's (Replicate, Shard(0))):
// 1. Each rank updates the momentum of its own rows (elementwise, no
//    communication) and writes its rows of the momentum-updated matrix, in
//    bfloat16 (Newton–Schulz's input precision), into a node-shared buffer
//    that holds every matrix once per node.
// 2. Rows held only on other nodes reach an owner's node over c10d, between
//    each rank and its counterparts (same local rank) on the other nodes.
// 3. Every matrix has one owner in the whole job (all ranks, all replicas),
//    chosen by a cost-balanced assignment (cost ∝ m·n·min(m,n)). The buffer
//    keeps each owner's matrices of one shape contiguous, so the owner
//    orthogonalises them in place as one batch.
// 4. Each owner sends the rows of its results that other nodes hold to its
//    counterparts there, a pool at a time while it orthogonalises the next;
//    each rank applies its own rows of each update to its shard.
// Inside a node nothing is copied between ranks: the buffer is the fabric's
// shared memory and each hand-over is a wait (hp::comm::Window rounds).
// Parameters that are not sharded (plain tensors) are orthogonalised by the
// rank that holds them, in private memory, as torch.optim.Muon would.
//
// On a GPU (muon_cuda.cpp) the same plan runs on device memory: each owner
// pulls its matrices' rows from its peers' device buffers, orthogonalises
// each pool in one batched bfloat16 Newton–Schulz (cuBLAS), and every rank
// pulls its rows of the results (fabric::PeerMemory, copy engines).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "hyperparallel/comm/communicator.h"
#include "hyperparallel/optim/assignment.h"
#include "hyperparallel/optim/newton_schulz.h"

namespace hp::optim {

// torch.optim.Muon's adjust_lr_fn: None and "original" scale the learning
// rate by sqrt(max(1, rows / cols)), "match_rms_adamw" by 0.2 sqrt(max(rows, cols)).
enum class AdjustLr : uint8_t { Original, MatchRmsAdamw };

// A parameter as the plan sees it.
struct ParamSpec {
  // Global shape: [rows, cols], or [experts, rows, cols] for a stack of
  // expert matrices (each expert is one matrix).
  std::vector<int64_t> shape;
  // Split over the mesh's shard dimension on dim 0, torch.chunk-wise (FSDP's
  // Shard(0)); otherwise this rank holds all of it.
  bool sharded = false;
  NsOptions ns;
};

// One step's hyperparameters of a parameter: those of its group.
struct StepOptions {
  double lr = 1e-3, weight_decay = 0.1, momentum = 0.95;
  bool nesterov = true;
  AdjustLr adjust_lr = AdjustLr::Original;
};

// The data-parallel mesh, indexed by global rank: each rank's coordinate on
// the shard dimension and on the replicate dimension (0 on a 1-D mesh).
struct MeshLayout {
  std::vector<int64_t> shard, replica;
};

// What hp.optim.Muon's Python class drives: a plan for one set of parameters.
class MuonPlan {
 public:
  virtual ~MuonPlan() = default;
  // One optimizer step. Each list holds this rank's local tensors (the shard
  // of a sharded parameter), in the order of the ParamSpecs. Updates params
  // and momentum in place. Collective when a parameter is sharded.
  virtual void step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& momentum, const std::vector<StepOptions>& options) = 0;
  // The matrices this rank orthogonalises each step: (parameter, expert).
  virtual std::vector<std::pair<int64_t, int64_t>> owned() const = 0;
  // Largest over mean Newton–Schulz cost of the ranks' sharded matrices.
  virtual double balance() const = 0;

  // A plan for parameters on `device`: the CPU's (Muon, below) or a device
  // backend's. Collective like the constructors.
  static std::shared_ptr<MuonPlan> create(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
                                          c10::intrusive_ptr<c10d::ProcessGroup> counterparts, c10::Device device);
};

// Counted by every Muon step of this process, CPU and device: bytes of bf16
// rows read from the node's other ranks' memory, which is all that Muon moves
// within a node (an owner reads the rows of its matrices that other ranks
// hold; a holder reads its rows of the results other ranks computed). What a
// benchmark sets beside the bytes a c10d Muon sends and receives.
uint64_t muon_peer_bytes();
void reset_muon_peer_bytes();

using MuonFactory = std::shared_ptr<MuonPlan> (*)(std::vector<ParamSpec>, comm::Communicator*, MeshLayout,
                                                  c10::intrusive_ptr<c10d::ProcessGroup>, c10::Device);
// A device backend linked into the extension registers its plan.
void register_muon_factory(c10::DeviceType type, MuonFactory factory);

class Muon : public MuonPlan {
 public:
  // Builds the plan and allocates the node-shared buffer. Collective over
  // every rank of the job when a parameter is sharded; then `comm` is the
  // job's communicator and, on more than one node, `counterparts` is this
  // rank's c10d group with its counterparts, one per node, ordered by node.
  Muon(std::vector<ParamSpec> params, comm::Communicator* comm, MeshLayout mesh,
       c10::intrusive_ptr<c10d::ProcessGroup> counterparts);

  void step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
            const std::vector<at::Tensor>& momentum, const std::vector<StepOptions>& options) override;
  std::vector<std::pair<int64_t, int64_t>> owned() const override;
  double balance() const override { return assignment_.balance(); }

 private:
  // Same-shape matrices with the same Newton–Schulz options, in one buffer.
  struct Pool {
    int64_t rows = 0, cols = 0;
    NsOptions ns;
    bool shared = false;  // in the node-shared buffer (sharded parameters)
    int64_t count = 0;
    int64_t offset = 0;  // bytes into the node-shared buffer
    at::Tensor slots{};  // [count, rows, cols] bfloat16
    int64_t mine_begin = 0, mine_end = 0;  // this rank's slots, contiguous
  };
  struct Matrix {
    int64_t param = 0, expert = 0;
    int pool = 0;
    int owner = 0;
    int64_t slot = 0;
  };
  // Rows of a matrix that this rank holds in its local tensors.
  struct Piece {
    int64_t matrix = 0;
    int64_t local_expert = -1;  // index into a local 3-D tensor; -1: the local tensor is the matrix's rows
    int64_t row_begin = 0, row_count = 0;  // in the matrix
    bool write = false;  // this rank writes these rows into the node's buffer
  };
  // Byte ranges of the node-shared buffer exchanged with each other node.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;  // (offset, bytes)
  struct Transfer {
    std::vector<Ranges> send, recv;  // per node
  };
  // A transfer under way: c10d's work and the bytes it moves.
  struct Pending {
    const Transfer* transfer = nullptr;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor send, recv;
  };

  // The constructor's stages, in order.
  void check_layout();
  void plan_matrices();
  void plan_owners();
  void allocate_slots();
  void plan_pieces();
  void plan_transfers();
  void count_peer_bytes();  // peer_bytes_, from the owners and pieces
  // Rows [begin, begin + count) of `matrix` that mesh shard `shard` holds (count 0: none).
  std::pair<int64_t, int64_t> shard_rows(const Matrix& matrix, int64_t shard) const;
  int64_t byte_offset(const Matrix& matrix, int64_t row) const;
  int64_t writer(int node, int64_t shard) const;  // local rank, or -1
  at::Tensor slot_rows(const Piece& piece) const;
  static at::Tensor local_rows(const at::Tensor& local, const Piece& piece);
  // Packs `transfer`'s ranges and starts the all-to-all between counterparts.
  Pending start(const Transfer& transfer);
  // Waits for it and unpacks what arrived into the node-shared buffer.
  void finish(Pending& pending);
  void check_locals(const std::vector<at::Tensor>& tensors, const char* what) const;
  // Parameter i's shape on this rank.
  std::vector<int64_t> local_shape(std::size_t i) const;

  std::vector<ParamSpec> params_;
  comm::Communicator* comm_ = nullptr;
  MeshLayout mesh_;
  c10::intrusive_ptr<c10d::ProcessGroup> counterparts_;
  int rank_ = 0, world_ = 1, node_ = 0, nodes_ = 1, local_rank_ = 0, local_world_ = 1;
  int64_t shards_ = 1, shard_ = 0;  // shards of the mesh, and this rank's
  std::vector<Pool> pools_;
  std::vector<Matrix> matrices_;
  Assignment assignment_;
  std::vector<std::vector<Piece>> pieces_;  // per parameter
  std::vector<bool> whole_;                 // per parameter: its pieces cover its local tensor
  std::optional<comm::Window> window_;      // the node-shared buffer
  int64_t peer_bytes_ = 0;                  // per step; see muon_peer_bytes()
  Transfer gather_;                // rows an owner's node lacks
  std::vector<Transfer> results_;  // per pool: updates that other nodes hold rows of
};

}  // namespace hp::optim
