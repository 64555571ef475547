#include "interrupt.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <initializer_list>

namespace aio {

static std::atomic<InterruptHook> g_hook{nullptr};

void set_interrupt_hook(InterruptHook hook) { g_hook.store(hook); }

void check_interrupt() {
  InterruptHook h = g_hook.load();
  if (h) h();
}

static_assert(sizeof(sigset_t) <= 128, "sigset_t larger than the saved buffer");

AsyncSignalBlock::AsyncSignalBlock() {
  sigset_t all;
  sigfillset(&all);
  // Faults raised by the thread's own execution must stay deliverable.
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS}) sigdelset(&all, s);
  sigset_t old;
  ok_ = pthread_sigmask(SIG_BLOCK, &all, &old) == 0;
  if (ok_) std::memcpy(saved_, &old, sizeof(old));
}

AsyncSignalBlock::~AsyncSignalBlock() {
  if (!ok_) return;
  sigset_t old;
  std::memcpy(&old, saved_, sizeof(old));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

}  // namespace aio
