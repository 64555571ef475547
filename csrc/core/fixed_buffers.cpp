#include "fixed_buffers.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

namespace aio {

namespace {

struct Region {
  uint64_t token;
  char* base;
  size_t len;
  unsigned slot;
};

struct Attached {
  FixedBuffers::Holder* holder;
  std::vector<bool> ok;  // per slot: registered on this ring
};

struct Table {
  std::mutex mu;
  std::vector<Region> regions;
  std::vector<bool> used = std::vector<bool>(FixedBuffers::kSlots, false);
  std::vector<Attached> holders;
  uint64_t next_token = 1;
  uint64_t bytes = 0;
};

std::atomic<int> g_register_fault{0};

// fork() while another thread holds the lock would leave the child's copy
// locked forever, so fork waits for it. The child gets the buffers (its
// memory is a copy) but none of the rings: they belong to the parent, and a
// registration from the child would put the child's pages into the parent's
// ring. Buffers the child adds are registered on rings the child makes.
void before_fork();
void after_fork_parent();
void after_fork_child();

// Never destroyed: PinnedBuffers may outlive static destruction order.
Table& table() {
  static Table* t = [] {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    return new Table;
  }();
  return *t;
}

void before_fork() { table().mu.lock(); }
void after_fork_parent() { table().mu.unlock(); }
void after_fork_child() {
  Table& t = table();
  t.holders.clear();
  t.mu.unlock();
}

int register_on(FixedBuffers::Holder* h, const Region& r) {
  const int fault = g_register_fault.load();
  return fault != 0 ? fault : h->register_slot(r.slot, r.base, r.len);
}

Attached* attached(Table& t, const FixedBuffers::Holder* h) {
  for (Attached& a : t.holders)
    if (a.holder == h) return &a;
  return nullptr;
}

}  // namespace

uint64_t FixedBuffers::add(void* base, size_t len) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  const uint64_t token = t.next_token++;
  char* p = static_cast<char*>(base);
  for (size_t done = 0; done < len;) {
    auto free_slot = std::find(t.used.begin(), t.used.end(), false);
    if (free_slot == t.used.end()) break;  // the rest is not fixed
    const unsigned slot = static_cast<unsigned>(free_slot - t.used.begin());
    const Region r{token, p + done, std::min(len - done, kMaxSlotBytes), slot};
    t.used[slot] = true;
    t.regions.push_back(r);
    t.bytes += r.len;
    for (Attached& a : t.holders) a.ok[slot] = register_on(a.holder, r) == 0;
    done += r.len;
  }
  return token;
}

void FixedBuffers::remove(uint64_t token) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  auto gone = [&](const Region& r) {
    if (r.token != token) return false;
    for (Attached& a : t.holders) {
      if (a.ok[r.slot]) a.holder->clear_slot(r.slot);
      a.ok[r.slot] = false;
    }
    t.used[r.slot] = false;
    t.bytes -= r.len;
    return true;
  };
  t.regions.erase(std::remove_if(t.regions.begin(), t.regions.end(), gone), t.regions.end());
}

void FixedBuffers::attach(Holder* h) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  Attached a{h, std::vector<bool>(kSlots, false)};
  for (const Region& r : t.regions) a.ok[r.slot] = register_on(h, r) == 0;
  t.holders.push_back(std::move(a));
}

void FixedBuffers::detach(Holder* h) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  t.holders.erase(std::remove_if(t.holders.begin(), t.holders.end(),
                                 [&](const Attached& a) { return a.holder == h; }),
                  t.holders.end());
}

int FixedBuffers::find(const Holder* h, const void* p, size_t len) {
  Table& t = table();
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> g(t.mu);
  const Attached* a = attached(t, h);
  if (!a) return -1;
  for (const Region& r : t.regions)
    if (c >= r.base && c + len <= r.base + r.len)
      return a->ok[r.slot] ? static_cast<int>(r.slot) : -1;
  return -1;
}

uint64_t FixedBuffers::bytes() {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  return t.bytes;
}

void FixedBuffers::set_register_fault(int err) { g_register_fault.store(err); }

}  // namespace aio
