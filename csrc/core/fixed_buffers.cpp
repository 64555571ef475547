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
std::atomic<bool> g_clone{true};

// fork() while another thread holds the lock would leave the child's copy
// locked forever, so fork waits for it. The child gets none of the rings:
// they belong to the parent, and a registration from the child would put the
// child's pages into the parent's ring. Nor does it keep the buffers: their
// memory is wiped in the child (PinnedBuffer), and registering it on a ring
// the child makes would pin (allocate) every page of the parent's pools
// there. Buffers the child adds are registered on rings the child makes.
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
  t.regions.clear();
  t.used.assign(FixedBuffers::kSlots, false);
  t.bytes = 0;
  t.mu.unlock();
}

// Registers `r` on `a`'s ring itself; a refusal is told to the ring.
bool register_on(Attached& a, const Region& r) {
  const int fault = g_register_fault.load();
  const int err = fault != 0 ? fault : a.holder->register_slot(r.slot, r.base, r.len);
  if (err != 0) a.holder->refused(err);
  return err == 0;
}

// Makes `dst`'s table a copy of `src`'s, unless that would drop a buffer
// only `dst` holds (I/O may be about to use it).
bool mirror(Attached& src, Attached& dst) {
  if (!g_clone.load()) return false;
  for (unsigned i = 0; i < FixedBuffers::kSlots; ++i)
    if (dst.ok[i] && !src.ok[i]) return false;
  if (dst.holder->clone_from(*src.holder) != 0) return false;
  dst.ok = src.ok;
  return true;
}

// Registers `r` on every ring: the first that takes it pins it, the others
// copy that ring's table; a ring that cannot copy registers it itself.
void register_everywhere(Table& t, const Region& r) {
  Attached* src = nullptr;
  for (Attached& a : t.holders) {
    if (src && mirror(*src, a)) continue;
    a.ok[r.slot] = register_on(a, r);
    if (!src && a.ok[r.slot]) src = &a;
  }
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
    register_everywhere(t, r);
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
  // A copy of the ring holding the most, then what it lacks one by one.
  Attached* src = nullptr;
  for (Attached& b : t.holders)
    if (!src || std::count(b.ok.begin(), b.ok.end(), true) >
                    std::count(src->ok.begin(), src->ok.end(), true))
      src = &b;
  if (src && !t.regions.empty()) mirror(*src, a);
  for (const Region& r : t.regions)
    if (!a.ok[r.slot]) a.ok[r.slot] = register_on(a, r);
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

void FixedBuffers::set_clone(bool on) { g_clone.store(on); }

}  // namespace aio
