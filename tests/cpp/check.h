// A minimal test harness (no framework to install): TEST(name) registers a
// test, CHECK* record a failure with file:line and go on, REQUIRE* stop the
// test. run_all() prints one line per failure and closes with
// "N passed, M failed[, K skipped]"; its result is the process exit status.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) {
    cases().push_back({name, std::move(fn)});
  }
};

// Failures of the running test; reset per test.
inline int& failures() {
  static int n = 0;
  return n;
}

// Thrown by REQUIRE* and SKIP to leave the running test.
struct Abort {};
struct Skip {
  std::string why;
};

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "  FAIL %s:%d: %s\n", file, line, what.c_str());
}

template <class A, class B>
std::string describe_eq(const char* ea, const char* eb, const A& a, const B& b) {
  std::ostringstream os;
  os << ea << " == " << eb << " (" << a << " vs " << b << ")";
  return os.str();
}

inline int run_all() {
  int passed = 0, failed = 0, skipped = 0;
  for (const Case& c : cases()) {
    failures() = 0;
    bool skip = false;
    try {
      c.fn();
    } catch (const Abort&) {
    } catch (const Skip& s) {
      skip = true;
      std::printf("SKIP %s: %s\n", c.name, s.why.c_str());
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
    } catch (...) {
      fail(__FILE__, __LINE__, "unexpected non-standard exception");
    }
    if (skip) {
      ++skipped;
    } else if (failures() == 0) {
      ++passed;
      std::printf("ok   %s\n", c.name);
    } else {
      ++failed;
      std::printf("FAIL %s (%d checks)\n", c.name, failures());
    }
    std::fflush(stdout);
  }
  if (skipped)
    std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  else
    std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace check

#define CHECK_CAT2(a, b) a##b
#define CHECK_CAT(a, b) CHECK_CAT2(a, b)

#define TEST(name)                                                     \
  static void name();                                                  \
  static ::check::Registrar CHECK_CAT(check_reg_, name)(#name, &name); \
  static void name()

#define CHECK(cond)                                        \
  do {                                                     \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, #cond); \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    const auto& check_a_ = (a);                                                            \
    const auto& check_b_ = (b);                                                            \
    if (!(check_a_ == check_b_))                                                           \
      ::check::fail(__FILE__, __LINE__, ::check::describe_eq(#a, #b, check_a_, check_b_)); \
  } while (0)

#define REQUIRE(cond)                           \
  do {                                          \
    if (!(cond)) {                              \
      ::check::fail(__FILE__, __LINE__, #cond); \
      throw ::check::Abort{};                   \
    }                                           \
  } while (0)

#define SKIP(why) \
  throw ::check::Skip { why }
