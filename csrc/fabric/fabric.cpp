#include "hyperparallel/fabric/fabric.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "sys.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HP_CPU_RELAX() _mm_pause()
#else
#define HP_CPU_RELAX() asm volatile("" ::: "memory")
#endif

namespace hp::fabric {
namespace {

constexpr uint64_t kMagic = 0x68702d6661627231ull;  // "hp-fabr1"
constexpr std::size_t kLine = 64;
// The fabric's own channels, in its control segment (every other channel has
// a segment of its own, which allocate() needs these to hand out).
constexpr int kBarrierChannel = 0;  // also carries the start-up handshake (value 1)
constexpr int kAllocChannel = 1;
constexpr int kExchangeChannel = 2;
constexpr int kOwnChannels = 3;
// How long a waiter sleeps between looks at its peers' health.
constexpr std::chrono::milliseconds kWatchInterval{100};
// Spins before the first futex wait: short, since ranks may share cores.
constexpr int kSpins = 2000;

std::chrono::milliseconds env_seconds(const char* name, std::chrono::milliseconds fallback) {
  std::string text = sys::env_or(name, "");
  if (text.empty()) return fallback;
  try {
    std::size_t used = 0;
    double seconds = std::stod(text, &used);
    if (used == text.size() && seconds > 0)
      return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(std::string(name) + "='" + text + "' must be a positive number of seconds");
}

struct alignas(kLine) RankSlot {
  std::atomic<int64_t> heartbeat_ns;
  std::atomic<int32_t> pid;  // non-zero: joined; written last, so a peer that sees it sees the rest
  int32_t global_rank;
  std::atomic<uint32_t> left;  // set by shutdown(): the rank will post nothing more
};

std::atomic<int> fabric_instances{0};

}  // namespace

Options Options::from_env() {
  Options options;
  options.heartbeat_timeout = env_seconds("HP_HEARTBEAT_TIMEOUT", options.heartbeat_timeout);
  options.timeout = env_seconds("HP_TIMEOUT", options.timeout);
  return options;
}

// The control segment: one per node and job. The fabric's own channels'
// counters follow the struct.
struct Fabric::Control {
  uint64_t magic;
  uint32_t local_world;
  alignas(kLine) std::atomic<uint32_t> generation;  // the futex word: bumped by every post
  std::atomic<uint32_t> sleepers;
  alignas(kLine) std::atomic<uint32_t> abort_state;  // 0 fine, 1 writing reason, 2 reason ready
  char abort_reason[1024];
  alignas(kLine) char alloc_name[256];  // the segment being handed out by local rank 0
  uint64_t alloc_bytes;
  RankSlot slots[kMaxLocalRanks];
  struct Blob {
    uint32_t bytes;
    char data[kExchangeBytes];
  } exchange[kMaxLocalRanks];

  static std::size_t bytes(int local_world) { return sizeof(Control) + std::size_t(kOwnChannels) * local_world * kLine; }
};

Fabric::Control* Fabric::control() const { return static_cast<Control*>(control_->data()); }

std::atomic<uint64_t>& Channel::counter(int local) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(counters_ + std::size_t(local) * kLine);
}

Fabric::Fabric(const Topology& topology, Bootstrap& bootstrap, Options options)
    : topology_(topology), options_(options) {
  if (topology.local_world_size > kMaxLocalRanks)
    throw std::invalid_argument("hyperparallel: " + std::to_string(topology.local_world_size) +
                                " ranks on one node; the fabric supports at most " + std::to_string(kMaxLocalRanks));
  const int instance = fabric_instances.fetch_add(1);
  const std::string key = "hp/fabric/node" + std::to_string(topology.node) + "/" + std::to_string(instance);
  const std::size_t control_bytes = Control::bytes(topology.local_world_size);
  if (topology.local_rank == 0) {
    sweep_stale_segments();
    name_prefix_ = segment_prefix() + "-" + std::to_string(instance);
    control_ = std::make_shared<Segment>(Segment::create(name_prefix_ + "-ctl", control_bytes));
    Control* c = control();  // fresh tmpfs pages are zero: atomics start at 0
    c->local_world = static_cast<uint32_t>(topology.local_world_size);
    c->magic = kMagic;
    bootstrap.set(key, control_->name() + "\n" + std::to_string(control_bytes));
  } else {
    std::string value = bootstrap.get(key, options_.timeout);
    auto newline = value.find('\n');
    std::string name = value.substr(0, newline);
    std::size_t published_bytes = std::stoull(value.substr(newline + 1));
    if (published_bytes != control_bytes)
      throw std::runtime_error("hyperparallel: local rank 0 made a control segment of " + std::to_string(published_bytes) +
                               " bytes, this rank expects " + std::to_string(control_bytes) +
                               "; every rank of a node must see the same LOCAL_WORLD_SIZE");
    control_ = std::make_shared<Segment>(Segment::open(name, control_bytes));
    if (control()->magic != kMagic || control()->local_world != uint32_t(topology.local_world_size))
      throw std::runtime_error("hyperparallel: control segment " + name + " does not belong to this job");
  }
  RankSlot& slot = control()->slots[topology.local_rank];
  // The pid last: a peer that sees it checks the heartbeat (one read before
  // it was written looked 'silent' since boot: a false "stopped answering").
  slot.global_rank = topology.rank;
  slot.heartbeat_ns.store(sys::monotonic_ns());
  slot.pid.store(getpid());
  auto own = [&](int channel) {
    char* counters = static_cast<char*>(control_->data()) + sizeof(Control);
    return Channel(this, counters + std::size_t(channel) * topology.local_world_size * kLine, nullptr);
  };
  barrier_channel_ = own(kBarrierChannel);
  alloc_channel_ = own(kAllocChannel);
  exchange_channel_ = own(kExchangeChannel);
  heartbeat_ = std::thread([this] { heartbeat_loop(); });

  // Everyone has mapped the control segment once every rank posted: its name
  // can go.
  try {
    barrier();
  } catch (...) {
    // A peer that never joined: no destructor runs, and a joinable thread
    // destroyed with this object would terminate the process.
    stop_heartbeat();
    control_->unlink();
    throw;
  }
  if (topology.local_rank == 0) control_->unlink();
}

Fabric::~Fabric() { shutdown(); }

void Fabric::shutdown() {
  if (shut_down_.exchange(true)) return;
  stop_heartbeat();
  Control* c = control();
  c->slots[topology_.local_rank].left.store(1);
  // Peers asleep waiting for this rank look again, see it gone, and raise.
  c->generation.fetch_add(1);
  sys::futex_wake_all(&c->generation);
  control_->unlink();
}

void Fabric::stop_heartbeat() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mutex_);
    stop_heartbeat_ = true;
  }
  heartbeat_wake_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

void Fabric::heartbeat_loop() {
  pthread_setname_np(pthread_self(), "hp-heartbeat");  // in top, gdb, /proc/<pid>/task
  RankSlot& slot = control()->slots[topology_.local_rank];
  std::unique_lock<std::mutex> lock(heartbeat_mutex_);
  int64_t dead_since = 0;  // when the watchdog first saw a dead peer nobody reported
  while (!stop_heartbeat_) {
    slot.heartbeat_ns.store(sys::monotonic_ns(), std::memory_order_relaxed);
    if (watchdog_.load(std::memory_order_relaxed)) watch(dead_since);
    heartbeat_wake_.wait_for(lock, std::chrono::milliseconds(200));
  }
}

void Fabric::arm_watchdog() { watchdog_.store(true); }

void Fabric::watch(int64_t& dead_since) {
  Control* c = control();
  if (c->abort_state.load() != 0) return;  // a wait saw it and raised: the program decides
  int dead = -1;
  for (int p = 0; p < local_world(); ++p) {
    const RankSlot& peer = c->slots[p];
    if (p != local_rank() && peer.pid != 0 && peer.left.load() == 0 && !sys::process_alive(peer.pid)) {
      dead = p;
      break;
    }
  }
  if (dead < 0) {
    dead_since = 0;
    return;
  }
  const int64_t now = sys::monotonic_ns();
  if (dead_since == 0) dead_since = now;
  if (now - dead_since < int64_t(options_.heartbeat_timeout.count()) * 1000000) return;
  const RankSlot& peer = c->slots[dead];
  std::string message = "hyperparallel.FabricError: rank " + std::to_string(peer.global_rank) + " (local rank " +
                        std::to_string(dead) + ", pid " + std::to_string(peer.pid) + ") died while rank " +
                        std::to_string(topology_.rank) + " was blocked outside the fabric (on the GPU, waiting for "
                        "work of that rank that will never finish); ending this rank. See that rank's log for the cause.\n";
  uint32_t expected = 0;
  if (c->abort_state.compare_exchange_strong(expected, 1)) {
    std::strncpy(c->abort_reason, message.c_str(), sizeof(c->abort_reason) - 1);
    c->abort_state.store(2);
  }
  c->generation.fetch_add(1);
  sys::futex_wake_all(&c->generation);
  (void)!write(2, message.data(), message.size());
  _exit(1);
}

int Fabric::global_rank_of(int local) const {
  return topology_.node * topology_.local_world_size + local;
}

Channel Fabric::channel() {
  // Fresh pages are zero: every counter starts at 0.
  return channel(allocate(channel_bytes()), 0);
}

Channel Fabric::channel(std::shared_ptr<Segment> memory, std::size_t offset) {
  if (!memory || offset % kLine != 0 || offset + channel_bytes() > memory->size())
    throw std::invalid_argument("hyperparallel: a channel needs " + std::to_string(channel_bytes()) +
                                " bytes at a multiple of 64 inside its segment, got offset " + std::to_string(offset) +
                                " in " + std::to_string(memory ? memory->size() : 0) + " bytes");
  char* counters = static_cast<char*>(memory->data()) + offset;
  return Channel(this, counters, std::move(memory));
}

std::size_t Fabric::channel_bytes() const { return std::size_t(local_world()) * kLine; }

void Fabric::post(const Channel& channel, uint64_t value) {
  check_open();  // a rank that left must not look as if it took part
  Control* c = control();
  channel.counter(local_rank()).store(value, std::memory_order_seq_cst);
  c->generation.fetch_add(1, std::memory_order_seq_cst);
  if (c->sleepers.load(std::memory_order_seq_cst) > 0) sys::futex_wake_all(&c->generation);
}

void Fabric::check_open() const {
  if (shut_down_.load(std::memory_order_relaxed))
    throw FabricError("hyperparallel: rank " + std::to_string(topology_.rank) +
                      " used the fabric after hp.comm.shutdown(); collectives and sharded modules cannot be used "
                      "after it (hp.comm.init() starts afresh)");
}

void Fabric::wait(const Channel& channel, int first, int last, uint64_t value, const char* what) {
  check_open();
  auto reached = [&] {
    for (int p = first; p < last; ++p)
      if (channel.counter(p).load(std::memory_order_acquire) < value) return false;
    return true;
  };
  Control* c = control();
  // Peers that aborted may have posted before they did: don't trust the counters.
  if (c->abort_state.load(std::memory_order_relaxed) != 0) fail();
  for (int spin = 0; spin < kSpins; ++spin) {
    if (reached()) return;
    HP_CPU_RELAX();
  }
  const auto started = std::chrono::steady_clock::now();
  while (true) {
    if (c->abort_state.load() != 0) fail();
    // Announce the sleep before the last look: a poster either sees us or
    // changes `generation` before we sleep on it.
    c->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t generation = c->generation.load(std::memory_order_seq_cst);
    bool done = reached();
    if (!done) sys::futex_wait(&c->generation, generation, kWatchInterval);
    c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done || reached()) return;
    check_peers(channel, first, last, value, what, started);
  }
}

void Fabric::check_peers(const Channel& channel, int first, int last, uint64_t value, const char* what,
                         std::chrono::steady_clock::time_point started) {
  const int64_t now = sys::monotonic_ns();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (int p = first; p < last; ++p) {
    if (channel.counter(p).load() >= value) continue;
    const RankSlot& slot = control()->slots[p];
    if (slot.pid == 0) {  // has not joined yet
      if (waited * 1000 > options_.timeout.count())
        abort("hyperparallel: rank " + std::to_string(global_rank_of(p)) + " never joined the fabric; rank " +
              std::to_string(topology_.rank) + " gave up after " + std::to_string(int(waited)) + " s in " + what);
      continue;
    }
    std::ostringstream who;
    who << "rank " << slot.global_rank << " (local rank " << p << ", pid " << slot.pid << ")";
    if (slot.left.load() != 0)
      abort("hyperparallel: " + who.str() + " left the job (hp.comm.shutdown() or the end of its program) while rank " +
            std::to_string(topology_.rank) + " waited for it in " + what +
            "; every rank must make the same collective calls before it exits");
    if (!sys::process_alive(slot.pid))
      abort("hyperparallel: " + who.str() + " died while rank " + std::to_string(topology_.rank) + " waited for it in " +
            what + "; see that rank's log for the cause");
    double silent = double(now - slot.heartbeat_ns.load()) / 1e9;
    if (silent * 1000 > double(options_.heartbeat_timeout.count())) {
      std::ostringstream message;
      message.precision(1);
      message << std::fixed << "hyperparallel: " << who.str() << " stopped answering (no heartbeat for " << silent
              << " s) while rank " << topology_.rank << " waited for it in " << what
              << "; it is stopped or starved (HP_HEARTBEAT_TIMEOUT sets the limit)";
      abort(message.str());
    }
    if (waited * 1000 > double(options_.timeout.count())) {
      std::ostringstream message;
      message.precision(1);
      message << std::fixed << "hyperparallel: rank " << topology_.rank << " waited " << waited << " s in " << what
              << " for " << who.str()
              << ", which is alive but never arrived: the ranks probably call collectives in different orders "
                 "(HP_TIMEOUT sets the limit)";
      abort(message.str());
    }
  }
}

void Fabric::abort(const std::string& reason) {
  Control* c = control();
  uint32_t expected = 0;
  if (c->abort_state.compare_exchange_strong(expected, 1)) {
    std::strncpy(c->abort_reason, reason.c_str(), sizeof(c->abort_reason) - 1);
    c->abort_state.store(2);
  }
  // A segment caught between creation and hand-out would outlive the job.
  if (c->alloc_name[0] != 0) shm_unlink(c->alloc_name);
  c->generation.fetch_add(1);
  sys::futex_wake_all(&c->generation);
  fail();
}

void Fabric::fail() {
  Control* c = control();
  while (c->abort_state.load() == 1) HP_CPU_RELAX();
  std::string reason(c->abort_reason);
  if (c->alloc_name[0] != 0) shm_unlink(c->alloc_name);
  throw FabricError(reason);
}

void Fabric::barrier() {
  ++barrier_epoch_;
  barrier_channel_.post(barrier_epoch_);
  barrier_channel_.wait_all(barrier_epoch_, "barrier");
}

std::vector<std::string> Fabric::exchange(const std::string& mine) {
  check_open();
  if (mine.size() > kExchangeBytes)
    throw std::logic_error("hyperparallel: exchange of " + std::to_string(mine.size()) + " bytes; at most " +
                           std::to_string(kExchangeBytes) + " fit");
  // Epoch e: written at 2e+1, read by everyone at 2e+2; the next write waits
  // for that, so a slow reader never sees the next round's bytes.
  const uint64_t written = 2 * exchange_epoch_ + 1, read = 2 * exchange_epoch_ + 2;
  ++exchange_epoch_;
  Control::Blob& blob = control()->exchange[local_rank()];
  blob.bytes = static_cast<uint32_t>(mine.size());
  std::memcpy(blob.data, mine.data(), mine.size());
  exchange_channel_.post(written);
  exchange_channel_.wait_all(written, "exchange");
  std::vector<std::string> all;
  for (int r = 0; r < local_world(); ++r) {
    const Control::Blob& theirs = control()->exchange[r];
    all.emplace_back(theirs.data, theirs.bytes);
  }
  exchange_channel_.post(read);
  exchange_channel_.wait_all(read, "exchange");
  return all;
}

std::shared_ptr<Segment> Fabric::allocate(std::size_t bytes) {
  check_open();
  Control* c = control();
  const uint64_t published = 2 * alloc_seq_ + 1, mapped = 2 * alloc_seq_ + 2;
  std::shared_ptr<Segment> segment;
  if (local_rank() == 0) {
    std::string name = name_prefix_ + "-" + std::to_string(alloc_seq_);
    if (name.size() >= sizeof(c->alloc_name)) throw std::logic_error("segment name too long: " + name);
    std::strcpy(c->alloc_name, name.c_str());  // before creation, so an abort can unlink it
    c->alloc_bytes = bytes;
    try {
      segment = std::make_shared<Segment>(Segment::create(name, bytes));
    } catch (const std::exception& error) {
      abort(error.what());  // the peers waiting for this segment raise too
    }
    alloc_channel_.post(published);
    alloc_channel_.post(mapped);
    alloc_channel_.wait_all(mapped, "allocate");
    segment->unlink();
    c->alloc_name[0] = 0;
  } else {
    alloc_channel_.wait(0, published, "allocate");
    if (c->alloc_bytes != bytes) {
      abort("hyperparallel: local rank 0 allocated " + std::to_string(c->alloc_bytes) + " bytes where rank " +
            std::to_string(topology_.rank) + " asked for " + std::to_string(bytes) +
            "; every rank must make the same allocations in the same order");
    }
    segment = std::make_shared<Segment>(Segment::open(c->alloc_name, bytes));
    alloc_channel_.post(mapped);
  }
  ++alloc_seq_;
  return segment;
}

void Channel::post(uint64_t value) const { fabric_->post(*this, value); }

void Channel::wait_all(uint64_t value, const char* what) const {
  fabric_->wait(*this, 0, fabric_->local_world(), value, what);
}

void Channel::wait(int peer, uint64_t value, const char* what) const {
  fabric_->wait(*this, peer, peer + 1, value, what);
}

}  // namespace hp::fabric
