#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "hyperparallel/fabric/fabric.h"
#include "ranks.h"

using namespace hp;
using hp::testing::check;
using hp::testing::leftover_segments;
using hp::testing::run_ranks;

TEST(Topology, RejectsInconsistentLaunchesWithTheFix) {
  EXPECT_NO_THROW(fabric::Topology::make(3, 4, 1, 2, 1));
  try {
    fabric::Topology::make(0, 5, 0, 2, 0);
    FAIL() << "expected a throw";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("not a multiple of LOCAL_WORLD_SIZE"), std::string::npos);
  }
  EXPECT_THROW(fabric::Topology::make(4, 4, 0, 2, 0), std::invalid_argument);
  EXPECT_THROW(fabric::Topology::make(1, 4, 0, 2, 0), std::invalid_argument);  // not contiguous
}

TEST(Fabric, SegmentsAreSharedAndLeaveNothingInDevShm) {
  auto exits = run_ranks(4, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    auto segment = fab->allocate(4096 * 3 + 5);
    check(segment->size() >= 4096 * 3 + 5, "segment size");
    fab->barrier();  // local rank 0 unlinks once all have mapped: after this barrier
    check(leftover_segments().empty(), "names unlinked once every rank mapped them");
    auto* words = static_cast<std::atomic<int>*>(segment->data());
    words[rank].store(rank + 100);
    fab->barrier();
    for (int peer = 0; peer < 4; ++peer) check(words[peer].load() == peer + 100, "peer's write visible");
    // Many rounds of barriers keep ranks in lock step.
    for (int round = 0; round < 200; ++round) {
      words[4 + rank].store(round);
      fab->barrier();
      for (int peer = 0; peer < 4; ++peer) check(words[4 + peer].load() == round, "lock step");
      fab->barrier();
    }
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, ChannelsSignalOnePeerOrAll) {
  auto exits = run_ranks(3, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    auto segment = fab->allocate(64);
    auto channel = fab->channel();
    auto* value = static_cast<std::atomic<int>*>(segment->data());
    for (uint64_t step = 1; step <= 50; ++step) {
      if (rank == 0) {
        value->store(int(step));
        channel.post(step);
      } else {
        channel.wait(0, step, "test");
        check(value->load() >= int(step), "rank 0's write is visible after its post");
        channel.post(step);
      }
      channel.wait_all(step, "test");
    }
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
}

// What a program that builds and drops models again and again does: every
// channel it drops is unmapped, and there is no cap on how many it makes.
TEST(Fabric, DroppedChannelsAreFreed) {
  auto shm_mappings = [] {
    std::ifstream maps("/proc/self/maps");
    int count = 0;
    for (std::string line; std::getline(maps, line);) count += line.find("/dev/shm/hp-") != std::string::npos;
    return count;
  };
  auto exits = run_ranks(2, [&](int rank, std::shared_ptr<fabric::Fabric> fab) {
    const int before = shm_mappings();
    for (uint64_t round = 1; round <= 5000; ++round) {
      fabric::Channel channel = fab->channel();
      fabric::Channel copy = channel;  // copies share it
      channel.post(1);
      copy.wait(1 - rank, 1, "test");
    }
    check(shm_mappings() == before, "every dropped channel's segment was unmapped");
    fabric::Channel kept = fab->channel();
    check(shm_mappings() == before + 1, "a live channel stays mapped");
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, AChannelCanLiveInASegmentItShares) {
  auto exits = run_ranks(2, [&](int rank, std::shared_ptr<fabric::Fabric> fab) {
    // What a window does: its data, then its channel's counters, one segment.
    std::shared_ptr<fabric::Segment> memory = fab->allocate(4096 + fab->channel_bytes());
    fabric::Channel channel = fab->channel(memory, 4096);
    auto* data = static_cast<int*>(memory->data());
    data[rank] = 10 + rank;
    channel.post(1);
    channel.wait_all(1, "test");
    check(data[1 - rank] == 11 - rank, "the peer's write is seen after its post");
    memory.reset();  // the channel keeps the segment mapped
    channel.post(2);
    channel.wait_all(2, "test");
    bool refused = false;
    try {
      fab->channel(fab->allocate(4096), 4064);  // past the end
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    check(refused, "a channel that does not fit its segment is refused");
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, SweepRemovesSegmentsOfDeadJobsOnly) {
  pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);  // `child` is now a pid nobody uses
  std::string dead = "/hp-" + std::to_string(getuid()) + "-" + std::to_string(child) + "-cafe-0-ctl";
  std::string alive = "/hp-" + std::to_string(getuid()) + "-" + std::to_string(getpid()) + "-cafe-0-ctl";
  // What a killed job leaves: names nobody will unlink.
  for (const std::string& name : {dead, alive}) close(shm_open(name.c_str(), O_CREAT | O_RDWR, 0600));
  EXPECT_EQ(fabric::sweep_stale_segments(), 1);
  auto left = leftover_segments();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ("/" + left[0], alive);
  shm_unlink(alive.c_str());
}

TEST(Fabric, AKilledPeerBecomesAnErrorNamingIt) {
  auto exits = run_ranks(3, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    fab->barrier();
    if (rank == 2) raise(SIGKILL);
    try {
      fab->barrier();
    } catch (const fabric::FabricError& error) {
      std::string message = error.what();
      check(message.find("rank 2") != std::string::npos, "names the rank: " + message);
      check(message.find("died") != std::string::npos, "says it died: " + message);
      return;
    }
    check(false, "barrier with a dead peer returned");
  });
  EXPECT_EQ(exits[0].status, 0) << exits[0].error;
  EXPECT_EQ(exits[1].status, 0) << exits[1].error;
  EXPECT_EQ(exits[2].status, -SIGKILL);
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, AFrozenPeerBecomesAnErrorNamingIt) {
  fabric::Options options;
  options.heartbeat_timeout = std::chrono::milliseconds(1000);
  auto exits = run_ranks(2, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    fab->barrier();
    if (rank == 1) raise(SIGSTOP);
    try {
      fab->barrier();
    } catch (const fabric::FabricError& error) {
      std::string message = error.what();
      auto at = message.find("pid ");
      kill(std::atoi(message.c_str() + at + 4), SIGKILL);  // end the frozen rank
      check(message.find("rank 1") != std::string::npos && message.find("stopped answering") != std::string::npos,
            "names the frozen rank: " + message);
      return;
    }
  }, options);
  EXPECT_EQ(exits[0].status, 0) << exits[0].error;
  EXPECT_EQ(exits[1].status, -SIGKILL);
}

TEST(Fabric, ALivePeerThatNeverArrivesTimesOutOnBothSides) {
  fabric::Options options;
  options.timeout = std::chrono::milliseconds(1000);
  auto exits = run_ranks(2, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    try {
      fab->barrier();
    } catch (const fabric::FabricError& error) {
      std::string message = error.what();
      check(message.find("never arrived") != std::string::npos && message.find("rank 1") != std::string::npos,
            message);
      return;
    }
    check(false, "barrier returned");
  }, options);
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
}

TEST(Fabric, MismatchedAllocationsAreRefused) {
  auto exits = run_ranks(2, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    try {
      fab->allocate(rank == 0 ? 4096 : 8192);
    } catch (const fabric::FabricError& error) {
      check(std::string(error.what()).find("same allocations in the same order") != std::string::npos, error.what());
      return;
    }
    check(false, "mismatch accepted");
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, APeerThatNeverJoinsIsAnErrorNotAnAbort) {
  // The constructor's first barrier raises while the heartbeat thread runs: the
  // thread must be joined before the error leaves, or the process aborts.
  char dir_template[] = "/tmp/hp-test-XXXXXX";
  std::string dir = mkdtemp(dir_template);
  pid_t pid = fork();
  if (pid == 0) {
    int code = 2;
    try {
      fabric::FileBootstrap bootstrap(dir + "/bootstrap");
      fabric::Options options;
      options.timeout = std::chrono::milliseconds(500);
      fabric::Fabric fab(fabric::Topology::make(0, 2, 0, 2, 0), bootstrap, options);  // rank 1 never comes
    } catch (const fabric::FabricError& error) {
      code = std::string(error.what()).find("rank 1 never joined") != std::string::npos ? 0 : 3;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(Fabric, ARankThatShutsDownIsNamedAtOnceByAPeerWaitingForIt) {
  auto exits = run_ranks(2, [](int rank, std::shared_ptr<fabric::Fabric> fab) {
    auto segment = fab->allocate(64);
    auto* peer_saw_it = static_cast<std::atomic<int>*>(segment->data());
    fab->barrier();
    if (rank == 1) {
      fab->shutdown();
      fab->shutdown();  // idempotent
      try {
        fab->barrier();
        check(false, "a barrier after shutdown returned");
      } catch (const fabric::FabricError& error) {
        check(std::string(error.what()).find("after hp.comm.shutdown()") != std::string::npos, error.what());
      }
      try {
        fab->allocate(4096);
        check(false, "an allocation after shutdown returned");
      } catch (const fabric::FabricError& error) {
      }
      // Alive, but gone from the job: rank 0 must raise before this process ends
      // (the mapping outlives shutdown()).
      for (int i = 0; i < 60000 && peer_saw_it->load() == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      check(peer_saw_it->load() == 1, "rank 0 raised only once this rank had ended");
      return;
    }
    try {
      fab->barrier();
    } catch (const fabric::FabricError& error) {
      peer_saw_it->store(1);
      std::string message = error.what();
      check(message.find("rank 1") != std::string::npos && message.find("left the job") != std::string::npos,
            message);
      return;
    }
    check(false, "barrier returned");
  });
  for (auto& exit : exits) EXPECT_EQ(exit.status, 0) << exit.error;
  EXPECT_TRUE(leftover_segments().empty());
}
