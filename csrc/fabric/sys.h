// Thin wrappers over the Linux calls the fabric needs.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace hp::fabric::sys {

// Sleeps until *word != expected, a wake, or the timeout. Works across
// processes on shared memory (no FUTEX_PRIVATE_FLAG).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout);
void futex_wake_all(std::atomic<uint32_t>* word);

// False once `pid` has exited, zombies included.
bool process_alive(pid_t pid);

// CLOCK_MONOTONIC in nanoseconds: one clock for all processes on the host.
int64_t monotonic_ns();

// "<what>: <strerror(errno)>"
std::string errno_message(const std::string& what);

// Reads an environment variable; `fallback` when unset or empty.
std::string env_or(const char* name, const std::string& fallback);

}  // namespace hp::fabric::sys
