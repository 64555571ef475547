// Lets a blocking system call made on the caller's thread be interrupted.
// A call such as open() on a FIFO can block forever; the core retries EINTR,
// and without this hook a signal (Ctrl-C) would be swallowed by the retry.
// The bindings install a hook that runs the interpreter's signal handlers and
// throws if one of them raised, so the caller's KeyboardInterrupt gets out.
#pragma once

namespace aio {

using InterruptHook = void (*)();

// Installs the hook (nullptr removes it). Not thread-safe against concurrent
// check_interrupt(); install once at start-up.
void set_interrupt_hook(InterruptHook hook);

// Called after a blocking call on the submitting thread returned EINTR and
// before it is retried. May throw whatever the hook throws.
void check_interrupt();

// Blocks the asynchronous signals (SIGINT, SIGTERM, ...) in the calling
// thread for its lifetime and restores the previous mask on destruction, so
// that threads started in between inherit a mask that leaves signal delivery
// to the application's own threads.
class AsyncSignalBlock {
 public:
  AsyncSignalBlock();
  ~AsyncSignalBlock();
  AsyncSignalBlock(const AsyncSignalBlock&) = delete;
  AsyncSignalBlock& operator=(const AsyncSignalBlock&) = delete;

 private:
  unsigned char saved_[128];  // sigset_t, kept opaque to keep <signal.h> out
  bool ok_ = false;
};

}  // namespace aio
