#include "engine.h"

#include <errno.h>

#include <exception>
#include <string>

namespace aio {

void Engine::run(SliceFeed& feed) {
  while (const Slice* s = feed.next(true)) {
    try {
      transfer(*s);
    } catch (const Error& e) {
      feed.finished(s, &e);
      continue;
    } catch (const std::exception& e) {
      const Error err(EIO, op_name(s->op), s->file->path(), s->off, s->len,
                      std::string("internal error: ") + e.what());
      feed.finished(s, &err);
      continue;
    }
    feed.finished(s, nullptr);
  }
}

}  // namespace aio
