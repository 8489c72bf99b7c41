"""The bytes torch's CPU allocator holds, counted on every thread: the CPU counterpart of
`torch.cuda.memory_allocated` / `max_memory_allocated` where other threads allocate or free tensors (gloo's worker
threads on 2 CPU ranks).

Why not torch's profiler: with `profile_memory=True` the CPU allocator reports an allocation or a free only on a thread
where the profiler is enabled (`c10::ProfiledCPUMemoryReporter` checks a thread-local flag). gloo runs each collective
on a worker thread that frees its tensors once the caller has dropped them, so the profiler's running sum only grows
(+20 MiB on one DDP rank, +3-20 MiB per step under FSDP2, while RSS stays flat). On one process the two agree.

`CountingAllocator()` (one per process, made before the model exists) puts a counting allocator in front of the CPU
allocator (`c10::SetCPUAllocator`): it passes every allocation on, adds the bytes to an atomic counter and its
high-water mark, and subtracts them in the deleter, on whichever thread that runs. Storages allocated before it is
installed count neither way. The C++ below is built once per torch version with `torch.utils.cpp_extension.load` (a
C++ compiler is needed) and called through ctypes; tests/test_thread_memory.py shows its use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

SOURCE = r"""
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {
std::atomic<long long> current_bytes{0};
std::atomic<long long> peak_bytes{0};
// Never destroyed: storages may be freed during interpreter teardown, after static destructors have run.
std::mutex& table_mutex = *new std::mutex;
std::unordered_map<void*, size_t>& sizes = *new std::unordered_map<void*, size_t>;  // data pointer -> bytes
c10::Allocator* inner = nullptr;
c10::DeleterFnPtr inner_deleter = nullptr;

void count_free(void* ptr) {
  size_t n = 0;
  {
    std::lock_guard<std::mutex> guard(table_mutex);
    auto it = sizes.find(ptr);
    if (it != sizes.end()) {
      n = it->second;
      sizes.erase(it);
    }
  }
  current_bytes.fetch_sub(static_cast<long long>(n));
  inner_deleter(ptr);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr data = inner->allocate(n);
    void* ptr = data.get();
    if (ptr == nullptr || data.get_context() != ptr || data.get_deleter() != inner_deleter) {
      return data;  // not the simple form this wrapper counts (never seen from the default CPU allocator)
    }
    data.release_context();
    {
      std::lock_guard<std::mutex> guard(table_mutex);
      sizes[ptr] = n;
    }
    long long now = current_bytes.fetch_add(static_cast<long long>(n)) + static_cast<long long>(n);
    long long high = peak_bytes.load();
    while (now > high && !peak_bytes.compare_exchange_weak(high, now)) {
    }
    return {ptr, ptr, &count_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &count_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator& counting = *new CountingAllocator;
}  // namespace

extern "C" {
int thread_memory_install() {  // 1: installed, 0: already, < 0: failed
  if (inner != nullptr) return 0;
  inner = c10::GetCPUAllocator();
  inner_deleter = inner->raw_deleter();
  if (inner_deleter == nullptr) return -1;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  return c10::GetCPUAllocator() == &counting ? 1 : -2;
}
long long thread_memory_current() { return current_bytes.load(); }
long long thread_memory_peak() { return peak_bytes.load(); }
void thread_memory_reset_peak() { peak_bytes.store(current_bytes.load()); }
}
"""


def _library() -> ctypes.CDLL:
    """Build (once per torch version and source) and load the counting allocator."""
    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha1((SOURCE + torch.__version__).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build = cache / "layerwise_hf" / f"thread_memory_{digest}"
    build.mkdir(parents=True, exist_ok=True)
    source = build / "thread_memory.cpp"
    if not source.is_file():
        tmp = source.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(SOURCE)
        tmp.replace(source)  # atomic: ranks building side by side never read half a file
    # The `.so` path; the library is loaded into the process as well (torch.ops.load_library), once.
    path = cpp_extension.load(name=f"thread_memory_{digest}", sources=[str(source)], build_directory=str(build),
                              is_python_module=False, extra_cflags=["-O2"])  # fmt: skip
    lib = ctypes.CDLL(path)
    for name in ("thread_memory_current", "thread_memory_peak"):
        getattr(lib, name).restype = ctypes.c_longlong
    return lib


class CountingAllocator:
    """The process's CPU allocator, counted on every thread (see the module docstring). One per process."""

    _lib: ctypes.CDLL | None = None

    def __init__(self) -> None:
        if CountingAllocator._lib is None:
            lib = _library()
            code = lib.thread_memory_install()
            if code < 0:
                raise RuntimeError(f"the counting CPU allocator could not be installed (code {code})")
            CountingAllocator._lib = lib
        self.lib = CountingAllocator._lib

    def current(self) -> int:
        """Bytes allocated since `install` and not freed yet."""
        return int(self.lib.thread_memory_current())

    def peak(self) -> int:
        """The highest `current()` since the last `reset_peak()`."""
        return int(self.lib.thread_memory_peak())

    def reset_peak(self) -> None:
        self.lib.thread_memory_reset_peak()


def build() -> None:
    """Compile the library now (the parent of launched ranks calls this, so that ranks do not compile side by side)."""
    _library()
