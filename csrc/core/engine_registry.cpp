#include <errno.h>

#include <map>
#include <mutex>

#include "engine.h"
#include "error.h"

namespace aio {

namespace {
std::map<std::string, EngineFactory>& registry() {
  static std::map<std::string, EngineFactory> r;
  return r;
}
std::mutex& registry_mu() {
  static std::mutex m;
  return m;
}
}  // namespace

bool register_engine(const std::string& name, EngineFactory factory) {
  std::lock_guard<std::mutex> g(registry_mu());
  registry()[name] = std::move(factory);
  return true;
}

std::unique_ptr<Engine> make_engine(const std::string& name, const EngineContext& ctx) {
  EngineFactory f;
  {
    std::lock_guard<std::mutex> g(registry_mu());
    auto it = registry().find(name);
    if (it == registry().end()) {
      std::string known;
      for (auto& kv : registry()) known += (known.empty() ? "" : ", ") + kv.first;
      throw Error(EINVAL, "create engine", "", 0, 0,
                  "unknown engine '" + name + "'; known: auto, " + known);
    }
    f = it->second;
  }
  return f(ctx);
}

std::vector<std::string> engine_names() {
  std::lock_guard<std::mutex> g(registry_mu());
  std::vector<std::string> out;
  for (auto& kv : registry()) out.push_back(kv.first);
  return out;
}

}  // namespace aio
