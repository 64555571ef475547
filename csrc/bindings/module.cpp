// aio._C: declarations only. Unpack arguments, release the GIL around
// anything that can block, call the core, translate aio::Error. Only
// (pointer, byte count, offset) crosses into the core; Python validates
// buffers, dtypes and devices.
#include <errno.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../core/alignment.h"
#include "../core/engine.h"
#include "../core/error.h"
#include "../core/handle.h"
#include "../core/pinned.h"

namespace py = pybind11;
using aio::Op;

namespace {

Op parse_op(int op) {
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
  d["alignment"] = s.alignment;
  return d;
}

aio::FaultKind parse_fault(const std::string& k) {
  if (k == "error") return aio::FaultKind::Error;
  if (k == "short") return aio::FaultKind::Short;
  if (k == "open_direct") return aio::FaultKind::OpenDirect;
  throw py::value_error("fault kind must be 'error', 'short' or 'open_direct'");
}

int parse_fault_op(const std::string& op) {
  if (op == "read") return 0;
  if (op == "write") return 1;
  if (op == "any") return 2;
  throw py::value_error("fault op must be 'read', 'write' or 'any'");
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

  py::class_<aio::RequestState, std::shared_ptr<aio::RequestState>>(m, "Request")
      .def("done", &aio::RequestState::done)
      .def("wait", &aio::RequestState::wait, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("result",
           [](aio::RequestState& r) {
             if (!r.done()) throw py::value_error("request is still in flight");
             if (r.error()) throw *r.error();
             return r.nbytes();
           })
      .def_property_readonly("nbytes", &aio::RequestState::nbytes)
      .def_property_readonly("offset", &aio::RequestState::offset)
      .def_property_readonly("is_write", [](aio::RequestState& r) { return r.op() == Op::Write; });

  py::class_<aio::Handle>(m, "Handle")
      .def(py::init([](size_t block_size, unsigned queue_depth, bool single_submit,
                       bool overlap_events, unsigned thread_count, const std::string& engine) {
             aio::Settings s;
             s.block_size = block_size;
             s.queue_depth = queue_depth;
             s.single_submit = single_submit;
             s.overlap_events = overlap_events;
             s.thread_count = thread_count;
             return new aio::Handle(s, engine);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("single_submit"),
           py::arg("overlap_events"), py::arg("thread_count"), py::arg("engine"))
      .def(
          "submit",
          [](aio::Handle& h, int op, uintptr_t ptr, uint64_t nbytes, const std::string& path,
             int fd, int64_t offset) {
            return h.submit(parse_op(op), as_ptr(ptr), nbytes, path, fd, offset);
          },
          py::arg("op"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"), py::arg("fd"),
          py::arg("offset"), py::call_guard<py::gil_scoped_release>())
      .def("drain", &aio::Handle::drain, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](aio::Handle& h) { return stats_dict(h.stats()); })
      .def_property_readonly("engine", &aio::Handle::engine_name)
      .def_property_readonly("engine_reason", &aio::Handle::engine_reason)
      .def("alignment", &aio::Handle::alignment)
      .def("take_notices", &aio::Handle::take_notices)
      .def("forked", &aio::Handle::forked)
      .def(
          "inject_fault",
          [](aio::Handle& h, const std::string& kind, int err, const std::string& op, uint64_t nth,
             uint64_t count) {
            h.faults().arm(parse_fault(kind), err, parse_fault_op(op), nth, count);
          },
          py::arg("kind"), py::arg("errno"), py::arg("op"), py::arg("nth"), py::arg("count"))
      .def("clear_fault", [](aio::Handle& h) { h.faults().disarm(); })
      .def("fault_hits", [](aio::Handle& h) { return h.faults().hits(); });

  py::class_<aio::PinnedBuffer>(m, "PinnedBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool>(), py::arg("nbytes"), py::arg("lock") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_buffer([](aio::PinnedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      })
      .def_property_readonly(
          "ptr", [](aio::PinnedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &aio::PinnedBuffer::size)
      .def_property_readonly("locked", &aio::PinnedBuffer::locked);

  py::class_<aio::PinnedPool>(m, "PinnedPool")
      .def(py::init<size_t, size_t, bool>(), py::arg("count"), py::arg("slot_bytes"),
           py::arg("lock") = true, py::call_guard<py::gil_scoped_release>())
      .def("acquire", &aio::PinnedPool::acquire, py::arg("timeout_ms") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("release", &aio::PinnedPool::release)
      .def("available", &aio::PinnedPool::available)
      .def("slot_ptr",
           [](aio::PinnedPool& p, size_t i) { return reinterpret_cast<uintptr_t>(p.slot(i)); })
      .def_property_readonly("count", &aio::PinnedPool::count)
      .def_property_readonly("slot_bytes", &aio::PinnedPool::slot_bytes)
      .def_property_readonly("total_bytes", &aio::PinnedPool::total_bytes);

  m.def(
      "probe_alignment",
      [](int fd) {
        aio::Alignment a = aio::probe_alignment(fd);
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
  m.def("set_lock_fault", &aio::PinnedBuffer::set_lock_fault, py::arg("errno"));
  m.def("page_size", &aio::page_size);
}
