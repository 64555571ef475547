// aio._C: declarations only. Unpack arguments, release the GIL around
// anything that can block, call the core, translate aio::Error. Only
// (pointer, byte count, offset) crosses into the core; Python validates
// buffers, dtypes and devices.
#include <errno.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "../core/alignment.h"
#include "../core/engine.h"
#include "../core/error.h"
#include "../core/fixed_buffers.h"
#include "../core/handle.h"
#include "../core/interrupt.h"
#include "../core/pinned.h"

namespace py = pybind11;
using aio::Op;

void bind_optim(py::module_& m);  // optim.cpp

namespace {

[[noreturn]] void raise_overflow(const std::string& msg) {
  PyErr_SetString(PyExc_OverflowError, msg.c_str());
  throw py::error_already_set();
}

// A Python int (or anything with __index__, e.g. numpy integers) as an
// integer in [lo, hi]. Errors name the argument: TypeError for a non-integer,
// ValueError below lo (sizes, counts and offsets are never negative),
// OverflowError above hi -- never pybind11's "incompatible function arguments".
template <class T>
T int_arg(py::handle o, const char* name, T lo = std::numeric_limits<T>::min(),
          T hi = std::numeric_limits<T>::max()) {
  if (PyFloat_Check(o.ptr()))
    throw py::type_error(std::string(name) + " must be an int, got float");
  py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(o.ptr()));
  if (!idx) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be an int, got " +
                         std::string(py::str(py::type::handle_of(o).attr("__name__"))));
  }
  int over = 0;
  __int128 v = PyLong_AsLongLongAndOverflow(idx.ptr(), &over);
  bool beyond_64 = false;
  if (over > 0) {
    const unsigned long long u = PyLong_AsUnsignedLongLong(idx.ptr());
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      beyond_64 = true;
    } else {
      v = u;
    }
  }
  const std::string got = std::string(py::repr(idx));
  if (over < 0 || v < static_cast<__int128>(lo))
    throw py::value_error(std::string(name) + " must be at least " + std::to_string(lo) + ", got " +
                          got);
  if (beyond_64 || v > static_cast<__int128>(hi))
    raise_overflow(std::string(name) + " must be at most " + std::to_string(hi) + ", got " + got);
  return static_cast<T>(v);
}

// A timeout in seconds: negative or infinite means "no timeout".
double timeout_arg(py::handle o, const char* name) {
  if (o.is_none()) return -1.0;
  const double t = PyFloat_AsDouble(o.ptr());
  if (t == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be a number of seconds");
  }
  if (std::isnan(t)) throw py::value_error(std::string(name) + " must not be NaN");
  return std::isinf(t) ? -1.0 : t;
}

// A timeout in milliseconds for PinnedPool.acquire: ints, or floats where
// inf means forever; negative means forever.
long timeout_ms_arg(py::handle o) {
  if (o.is_none()) return -1;
  if (PyFloat_Check(o.ptr())) {
    const double t = PyFloat_AsDouble(o.ptr());
    if (std::isnan(t)) throw py::value_error("timeout_ms must not be NaN");
    if (std::isinf(t) || t < 0) return -1;
    if (t >= 9.2e18) raise_overflow("timeout_ms is too large");
    return static_cast<long>(t);
  }
  return int_arg<long>(o, "timeout_ms");
}

std::string path_arg(const std::string& path) {
  if (path.find('\0') != std::string::npos)
    throw py::value_error("path contains a NUL byte: " + std::string(py::repr(py::str(path))));
  return path;
}

Op parse_op(py::handle o) {
  const int op = int_arg<int>(o, "op");
  if (op != 0 && op != 1) throw py::value_error("op must be 0 (read) or 1 (write)");
  return op == 0 ? Op::Read : Op::Write;
}

char* as_ptr(uintptr_t p) { return reinterpret_cast<char*>(p); }

py::dict stats_dict(const aio::Stats& s) {
  py::dict d;
  d["engine"] = s.engine;
  d["engine_reason"] = s.engine_reason;
  d["read_requests"] = s.read_requests;
  d["write_requests"] = s.write_requests;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["failed_requests"] = s.failed_requests;
  d["ios"] = s.ios;
  d["submit_calls"] = s.submit_calls;
  d["getevents_calls"] = s.getevents_calls;
  d["retries"] = s.retries;
  d["short_resumed"] = s.short_resumed;
  d["bounce_bytes"] = s.bounce_bytes;
  d["edge_bytes"] = s.edge_bytes;
  d["buffered_bytes"] = s.buffered_bytes;
  d["buffered_fallback"] = s.buffered_fallback;
  d["outstanding"] = s.outstanding;
  d["tasks"] = s.tasks;
  d["max_inflight"] = s.max_inflight;
  d["fixed_ios"] = s.fixed_ios;
  d["fixed_refused"] = s.fixed_refused;
  d["fixed_refused_reason"] = s.fixed_refused_reason;
  d["alignment"] = s.alignment;
  return d;
}

aio::FaultKind parse_fault(const std::string& k) {
  if (k == "error") return aio::FaultKind::Error;
  if (k == "short") return aio::FaultKind::Short;
  if (k == "open_direct") return aio::FaultKind::OpenDirect;
  if (k == "no_direct_statx") return aio::FaultKind::NoDirectStatx;
  if (k == "trickle") return aio::FaultKind::Trickle;
  throw py::value_error(
      "fault kind must be 'error', 'short', 'open_direct', 'no_direct_statx' or 'trickle'");
}

int parse_fault_op(const std::string& op) {
  if (op == "read") return 0;
  if (op == "write") return 1;
  if (op == "any") return 2;
  throw py::value_error("fault op must be 'read', 'write' or 'any'");
}

// Installed as the core's interrupt hook: a blocking call on the submitting
// thread got EINTR. Run the signal handlers; if one raised (KeyboardInterrupt)
// carry that exception out through the core to the caller.
void python_interrupt_hook() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

aio::Handle* make_handle(py::object block_size, py::object queue_depth, bool single_submit,
                         bool overlap_events, py::object thread_count, const std::string& engine) {
  aio::Settings s;
  s.block_size = int_arg<size_t>(block_size, "block_size", 1, size_t{1} << 40);
  s.queue_depth = int_arg<unsigned>(queue_depth, "queue_depth", 1);
  s.single_submit = single_submit;
  s.overlap_events = overlap_events;
  s.thread_count = int_arg<unsigned>(thread_count, "thread_count", 1);
  py::gil_scoped_release nogil;
  return new aio::Handle(s, engine);
}

std::shared_ptr<aio::RequestState> submit(aio::Handle& h, py::object op, py::object ptr,
                                          py::object nbytes, const std::string& path, py::object fd,
                                          py::object offset) {
  const Op o = parse_op(op);
  char* p = as_ptr(int_arg<uintptr_t>(ptr, "ptr"));
  const int64_t n = int_arg<int64_t>(nbytes, "nbytes", 0);
  const int f = int_arg<int>(fd, "fd");
  const int64_t off = int_arg<int64_t>(offset, "offset", 0);
  if (n > INT64_MAX - off)
    raise_overflow("offset + nbytes must be at most 2**63 - 1 (the largest file offset), got " +
                   std::to_string(off) + " + " + std::to_string(n));
  const std::string pth = path_arg(path);
  py::gil_scoped_release nogil;
  return h.submit(o, p, static_cast<uint64_t>(n), pth, f, off);
}

// offsets: `count` int64 file offsets at address offsets_ptr (a numpy array
// the caller keeps alive).
std::shared_ptr<aio::RequestGroup> submit_pieces(aio::Handle& h, py::object op, py::object ptr,
                                                 py::object piece, py::object offsets_ptr,
                                                 py::object count, const std::string& path,
                                                 py::object fd) {
  const Op o = parse_op(op);
  char* p = as_ptr(int_arg<uintptr_t>(ptr, "ptr"));
  const uint64_t n = int_arg<uint64_t>(piece, "piece", 0);
  const auto* offs = reinterpret_cast<const int64_t*>(int_arg<uintptr_t>(offsets_ptr, "offsets"));
  const size_t c = int_arg<size_t>(count, "count", 0);
  const int f = int_arg<int>(fd, "fd");
  const std::string pth = path_arg(path);
  std::vector<int64_t> offsets(offs, offs + c);
  py::gil_scoped_release nogil;
  return h.submit_pieces(o, p, n, offsets, pth, f);
}

void bind_handle(py::module_& m) {
  py::class_<aio::Handle>(m, "Handle")
      .def(py::init(&make_handle), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("thread_count"),
           py::arg("engine"))
      .def("submit", &submit, py::arg("op"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"),
           py::arg("fd"), py::arg("offset"))
      .def("submit_pieces", &submit_pieces, py::arg("op"), py::arg("ptr"), py::arg("piece"),
           py::arg("offsets_ptr"), py::arg("count"), py::arg("path"), py::arg("fd"))
      .def("drain", &aio::Handle::drain, py::call_guard<py::gil_scoped_release>())
      .def("drain_for", &aio::Handle::drain_for, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](aio::Handle& h) { return stats_dict(h.stats()); })
      .def_property_readonly("engine", &aio::Handle::engine_name)
      .def_property_readonly("engine_reason", &aio::Handle::engine_reason)
      .def("alignment", &aio::Handle::alignment)
      .def("take_notices", &aio::Handle::take_notices)
      .def("fixed_refusal", &aio::Handle::fixed_refusal)
      .def("forked", &aio::Handle::forked)
      .def(
          "inject_fault",
          [](aio::Handle& h, const std::string& kind, py::object err, const std::string& op,
             py::object nth, py::object count) {
            h.faults().arm(parse_fault(kind), int_arg<int>(err, "errno", 0), parse_fault_op(op),
                           int_arg<uint64_t>(nth, "nth", 0), int_arg<uint64_t>(count, "count", 0));
          },
          py::arg("kind"), py::arg("errno"), py::arg("op"), py::arg("nth"), py::arg("count"))
      .def("clear_fault", [](aio::Handle& h) { h.faults().disarm(); })
      .def("fault_hits", [](aio::Handle& h) { return h.faults().hits(); });
}

size_t slot_index(aio::PinnedPool& p, py::handle i) {
  const size_t idx = int_arg<size_t>(i, "index", 0);
  if (idx >= p.count())
    throw py::value_error("index must be below the pool's count " + std::to_string(p.count()) +
                          ", got " + std::to_string(idx));
  return idx;
}

aio::PinnedPool* make_pool(py::object count, py::object slot_bytes, bool lock) {
  const size_t c = int_arg<size_t>(count, "count", 1);
  const size_t sb = int_arg<size_t>(slot_bytes, "slot_bytes", 1);
  size_t total;
  if (__builtin_mul_overflow(c, sb, &total) || total > (size_t{1} << 62))
    raise_overflow("count x slot_bytes is too large: " + std::to_string(c) + " x " +
                   std::to_string(sb));
  py::gil_scoped_release nogil;
  return new aio::PinnedPool(c, sb, lock);
}

aio::PinnedBuffer* make_buffer(py::object nbytes, bool lock) {
  const size_t n = int_arg<size_t>(nbytes, "nbytes", 1, size_t{1} << 62);
  py::gil_scoped_release nogil;
  return new aio::PinnedBuffer(n, lock);
}

void bind_pinned(py::module_& m) {
  py::class_<aio::PinnedBuffer>(m, "PinnedBuffer", py::buffer_protocol())
      .def(py::init(&make_buffer), py::arg("nbytes"), py::arg("lock") = true)
      .def_buffer([](aio::PinnedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      })
      .def_property_readonly(
          "ptr", [](aio::PinnedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &aio::PinnedBuffer::size)
      .def_property_readonly("locked", &aio::PinnedBuffer::locked)
      .def("make_fixed", &aio::PinnedBuffer::make_fixed, py::call_guard<py::gil_scoped_release>());

  py::class_<aio::PinnedPool>(m, "PinnedPool")
      .def(py::init(&make_pool), py::arg("count"), py::arg("slot_bytes"), py::arg("lock") = true)
      .def(
          "acquire",
          [](aio::PinnedPool& p, py::object timeout_ms) {
            const long t = timeout_ms_arg(timeout_ms);
            py::gil_scoped_release nogil;
            return p.acquire(t);
          },
          py::arg("timeout_ms") = -1)
      .def(
          "release", [](aio::PinnedPool& p, py::object i) { p.release(slot_index(p, i)); },
          py::arg("index"))
      .def("available", &aio::PinnedPool::available)
      .def("make_fixed", &aio::PinnedPool::make_fixed, py::call_guard<py::gil_scoped_release>())
      .def(
          "slot_ptr",
          [](aio::PinnedPool& p, py::object i) {
            return reinterpret_cast<uintptr_t>(p.slot(slot_index(p, i)));
          },
          py::arg("index"))
      .def_property_readonly("count", &aio::PinnedPool::count)
      .def_property_readonly("slot_bytes", &aio::PinnedPool::slot_bytes)
      .def_property_readonly("total_bytes", &aio::PinnedPool::total_bytes);
}

const aio::Error* error_of(const aio::RequestState& r) { return r.error() ? &*r.error() : nullptr; }
const aio::Error* error_of(const aio::RequestGroup& g) { return g.error(); }

// A request and a group of them (submit_pieces) look the same from Python.
template <class T>
void def_request(py::class_<T, std::shared_ptr<T>>& c) {
  c.def("done", &T::done)
      .def(
          "wait",
          [](T& r, py::object timeout) {
            const double t = timeout_arg(timeout, "timeout");
            py::gil_scoped_release nogil;
            return r.wait(t);
          },
          py::arg("timeout") = -1.0)
      .def("result",
           [](T& r) {
             r.check_owner();
             if (!r.done()) throw py::value_error("request is still in flight");
             if (const aio::Error* e = error_of(r)) throw *e;
             return r.nbytes();
           })
      .def_property_readonly("nbytes", &T::nbytes)
      .def_property_readonly("offset", &T::offset)
      .def_property_readonly("is_write", [](T& r) { return r.op() == Op::Write; });
}

void bind_request(py::module_& m) {
  py::class_<aio::RequestState, std::shared_ptr<aio::RequestState>> request(m, "Request");
  def_request(request);
  py::class_<aio::RequestGroup, std::shared_ptr<aio::RequestGroup>> group(m, "RequestGroup");
  def_request(group);
}

void bind_functions(py::module_& m) {
  m.def(
      "probe_alignment",
      [](py::object fd) {
        aio::Alignment a = aio::probe_alignment(int_arg<int>(fd, "fd"));
        py::dict d;
        d["offset"] = a.offset;
        d["memory"] = a.memory;
        d["direct_supported"] = a.direct_supported;
        d["source"] = a.source;
        return d;
      },
      py::arg("fd"));
  m.def("engines", &aio::engine_names);
  m.def("locked_bytes", &aio::PinnedBuffer::total_locked_bytes);
  m.def(
      "set_lock_fault",
      [](py::object e) { aio::PinnedBuffer::set_lock_fault(int_arg<int>(e, "errno", 0)); },
      py::arg("errno"));
  m.def(
      "set_fixed_fault",
      [](py::object e) { aio::FixedBuffers::set_register_fault(int_arg<int>(e, "errno", 0)); },
      py::arg("errno"));
  m.def("fixed_bytes", &aio::FixedBuffers::bytes);
  m.def("set_fixed_clone", &aio::FixedBuffers::set_clone, py::arg("on"));
  m.def(
      "set_uring_setup_fault",
      [](py::object e) { aio::set_uring_setup_fault(int_arg<int>(e, "errno", 0)); },
      py::arg("errno"));
  m.def(
      "set_kaio_setup_fault",
      [](py::object e) { aio::set_kaio_setup_fault(int_arg<int>(e, "errno", 0)); },
      py::arg("errno"));
  m.def("page_size", &aio::page_size);
  m.def(
      "mapped_size", [](py::object n) { return aio::mapped_size(int_arg<size_t>(n, "nbytes", 1)); },
      py::arg("nbytes"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "aio core: native async file I/O (internal; use the aio package)";

  // The one translator: the Python side picks the OSError subclass.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const aio::Error& e) {
      py::object make = py::module_::import("aio._errors").attr("make_error");
      // OSError appends the filename itself; keep it out of the message.
      const std::string msg =
          aio::format_error(e.err(), e.op(), "", e.offset(), e.length(), e.detail());
      py::object exc = make(e.err(), msg, e.path(), e.op(), e.offset(), e.length(), e.eof());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  aio::set_interrupt_hook(&python_interrupt_hook);

  bind_request(m);
  bind_handle(m);
  bind_pinned(m);
  bind_functions(m);
  bind_optim(m);
}
