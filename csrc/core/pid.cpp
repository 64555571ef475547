#include "pid.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace aio {

namespace {

std::atomic<pid_t> g_pid{0};

void refresh() { g_pid.store(getpid(), std::memory_order_relaxed); }

}  // namespace

pid_t current_pid() {
  static const bool registered = [] {
    refresh();
    pthread_atfork(nullptr, nullptr, refresh);
    return true;
  }();
  (void)registered;
  return g_pid.load(std::memory_order_relaxed);
}

}  // namespace aio
