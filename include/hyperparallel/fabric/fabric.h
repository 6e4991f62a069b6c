// The fabric: one node's memory as one address space.
//
// Every local rank of a job maps the same POSIX shared-memory segments, so a
// buffer allocated here is readable and writable by all ranks on the node.
// Cross-rank signalling uses per-rank counters in shared memory and futex
// waits; a waiter never sleeps-and-polls on the hot path, and it watches its
// peers while it waits, so a rank that dies or freezes turns into an error on
// every other rank instead of a hang.
//
// This layer knows nothing of torch. Everything that needs to know where
// memory lives asks it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hyperparallel/fabric/bootstrap.h"
#include "hyperparallel/fabric/segment.h"
#include "hyperparallel/fabric/topology.h"

namespace hp::fabric {

// Largest number of ranks one node may hold.
inline constexpr int kMaxLocalRanks = 64;
// Largest blob one rank contributes to Fabric::exchange().
inline constexpr std::size_t kExchangeBytes = 1024;

// Tunables; defaults come from HP_* environment variables (docs/env.md).
struct Options {
  // A peer whose heartbeat is older than this is declared unresponsive
  // (HP_HEARTBEAT_TIMEOUT, seconds).
  std::chrono::milliseconds heartbeat_timeout{10000};
  // A wait that outlasts this while every peer is alive is declared a
  // deadlock (HP_TIMEOUT, seconds).
  std::chrono::milliseconds timeout{600000};
  static Options from_env();
};

class Fabric;

// A channel is one monotonically increasing counter per local rank. A rank
// posts a value on its own counter; others wait until one or all counters
// reach a value. Each channel lives in a small segment of its own and is
// freed with its last handle (copies share it), so a program that builds and
// drops sharded models again and again holds only the channels of the models
// alive.
class Channel {
 public:
  Channel() = default;
  // Sets this rank's counter to `value` and wakes waiters.
  void post(uint64_t value) const;
  // Blocks until every local rank's counter is >= value. `what` names the
  // operation in error messages.
  void wait_all(uint64_t value, const char* what) const;
  // Blocks until local rank `peer`'s counter is >= value.
  void wait(int peer, uint64_t value, const char* what) const;

 private:
  friend class Fabric;
  Channel(Fabric* fabric, char* counters, std::shared_ptr<Segment> memory)
      : fabric_(fabric), counters_(counters), memory_(std::move(memory)) {}
  std::atomic<uint64_t>& counter(int local) const;
  Fabric* fabric_ = nullptr;
  char* counters_ = nullptr;         // one cache line per local rank, so that posts never contend
  std::shared_ptr<Segment> memory_;  // null for the fabric's own channels, which live in its control segment
};

// Raised on every rank when a peer died, froze, left, or a wait timed out,
// and by a wait after shutdown(). The fabric is unusable afterwards.
class FabricError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Fabric {
 public:
  // Collective over the node's local ranks: local rank 0 creates the control
  // segment and publishes its name through `bootstrap`; the others map it.
  Fabric(const Topology& topology, Bootstrap& bootstrap, Options options = Options::from_env());
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  const Topology& topology() const { return topology_; }
  int local_rank() const { return topology_.local_rank; }
  int local_world() const { return topology_.local_world_size; }

  // Collective over local ranks: a new segment of `bytes` mapped by all of
  // them. Its name is unlinked as soon as every rank has mapped it, so nothing
  // stays in /dev/shm even if the job is killed.
  std::shared_ptr<Segment> allocate(std::size_t bytes);

  // Collective over local ranks: a fresh channel, in a segment of its own.
  Channel channel();

  // Not collective: a channel whose counters are the channel_bytes() of
  // `memory` from `offset` (a multiple of 64, zero: a segment of allocate()'s
  // that every local rank builds the same channel in). It keeps `memory`
  // alive. A structure that allocates shared memory anyway (a window) gets
  // its signals so without a second segment.
  Channel channel(std::shared_ptr<Segment> memory, std::size_t offset);
  std::size_t channel_bytes() const;

  // Collective over local ranks.
  void barrier();

  // Collective over local ranks: every rank contributes `mine` (at most
  // kExchangeBytes) and gets every rank's, indexed by local rank. This is how
  // ranks hand each other the handles that map device memory and events.
  std::vector<std::string> exchange(const std::string& mine);

  // Marks the fabric failed with `reason` (the first reason wins), wakes every
  // waiter on every rank so that they raise FabricError naming it, and raises
  // it here too.
  [[noreturn]] void abort(const std::string& reason);

  // This rank leaves the job: joins the heartbeat thread, marks the rank gone
  // (a peer still waiting for it raises at once, naming it, instead of
  // waiting for the process to exit), and unlinks any segment name it still
  // owns. Mappings stay valid for whoever holds them; every later wait
  // raises FabricError. Idempotent; not collective.
  void shutdown();

  // Global rank of local rank `local`.
  int global_rank_of(int local) const;

  // Arms the watchdog, for ranks that wait on the GPU: a stream waiting for a
  // dead peer's event never finishes, and a host blocked on such a stream
  // (a .item(), a synchronize) would hang instead of reaching a fabric wait
  // that raises. Once armed, a peer found dead that no wait on this rank has
  // reported within the heartbeat timeout ends this process with the
  // FabricError's message and exit code 1, as NCCL's watchdog does.
  void arm_watchdog();

 private:
  friend class Channel;
  struct Control;
  Control* control() const;
  void post(const Channel& channel, uint64_t value);
  void wait(const Channel& channel, int first, int last, uint64_t value, const char* what);
  // Called between futex waits: raises if a peer in [first, last) that has not
  // reached `value` is dead or frozen, or if the wait timed out.
  void check_peers(const Channel& channel, int first, int last, uint64_t value, const char* what,
                   std::chrono::steady_clock::time_point started);
  // Raises FabricError with the recorded abort reason.
  [[noreturn]] void fail();
  void heartbeat_loop();
  // The watchdog's look at the peers, from the heartbeat thread.
  void watch(int64_t& dead_since);
  void stop_heartbeat();
  // Raises FabricError after shutdown().
  void check_open() const;

  Topology topology_;
  Options options_;
  std::shared_ptr<Segment> control_;
  Channel barrier_channel_;
  Channel alloc_channel_;
  Channel exchange_channel_;
  uint64_t barrier_epoch_ = 0;
  uint64_t exchange_epoch_ = 0;
  uint64_t alloc_seq_ = 0;
  std::string name_prefix_;
  std::mutex heartbeat_mutex_;
  std::condition_variable heartbeat_wake_;
  bool stop_heartbeat_ = false;
  std::atomic<bool> watchdog_{false};
  std::thread heartbeat_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace hp::fabric
