// The calling process's id without a system call each time (glibc stopped
// caching getpid() in 2.25, and the core asks on every request to tell a
// forked child from its parent): read once, refreshed in a child by a
// pthread_atfork handler, which fork() (and so os.fork()) runs.
#pragma once

#include <sys/types.h>

namespace aio {

pid_t current_pid();

}  // namespace aio
