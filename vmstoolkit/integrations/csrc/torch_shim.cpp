// vmstoolkit's PyTorch shim: PyTorch's pluggable allocator, plus the parts of the allocator
// contract its bare hook drops. Built on first use by torch.utils.cpp_extension (cached); see
// vmstoolkit/integrations/torch_shim.py. Every decision stays in the Python or compiled
// allocator behind the function pointers; this file only forwards and converts.
//
// What it adds to CUDAPluggableAllocator:
// - an allocation the allocator cannot serve raises c10::OutOfMemoryError (torch.OutOfMemoryError
//   in Python, also from inside backward()) with the allocator's own message; a null pointer
//   never reaches a kernel;
// - recordStream reaches the allocator with the block's device and allocation stream;
// - getDeviceStats / resetPeakStats / resetAccumulatedStats / emptyCache / cacheInfo answer
//   from the allocator, so every torch.cuda memory function works unchanged;
// - a Python exception in flight survives a callback into Python (KeepPythonError).
#include <pybind11/pybind11.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// The base class's _AllocationMetadata has no exported constructor (libtorch_cuda keeps it
// hidden), so the shim keeps its own record of each block and frees through it.
struct Meta {
  size_t size;
  int device;
  cudaStream_t stream;
};

typedef void* (*AllocFn)(size_t, int, cudaStream_t);
typedef void (*FreeFn)(void*, size_t, int, cudaStream_t);
typedef void (*RecordFn)(void*, int, cudaStream_t, cudaStream_t);  // ptr, device, its stream, the user
typedef int (*StatsFn)(int, int64_t*, int);                           // device, out, count
typedef void (*ResetFn)(int, int);                                    // device, 0: peaks, 1: totals
typedef void (*EmptyFn)();
typedef int (*ErrorFn)(int, char*, size_t);                           // device, message buffer

// The order of vmstoolkit.integrations.bridge.STAT_KEYS.
enum Stat {
  ALLOC_CUR, ALLOC_PEAK, ALLOC_TOTAL, ALLOC_FREED, RES_CUR, RES_PEAK, ACTIVE_CUR, ACTIVE_PEAK,
  COUNT_ALLOC, COUNT_FREED, OOMS, DEV_ALLOC, DEV_FREE, RETRIES, N_STATS
};

// Whether the entry points are Python callbacks (ctypes: the Python allocators) rather than
// compiled functions (the paged hook); set once by install().
bool g_python_callbacks = false;

// A Python callback must not run while the calling thread's Python exception is in flight.
// PyTorch frees tensors as an exception unwinds a frame (a temporary on the evaluation stack),
// and releases the GIL while it does: the thread state keeps the exception, ctypes takes the GIL
// back for the callback, the callback's Python code sees the exception and clears it, and the
// frame goes on unwinding with none: "SystemError: error return without exception set", or a
// crash where an except clause reads the missing exception (both seen on the H200). So around a
// Python callback the shim takes the GIL itself (ctypes would take it anyway), sets a pending
// exception aside, and puts it back after. Compiled entry points run no Python: no guard.
class KeepPythonError {
 public:
  KeepPythonError() {
    if (!g_python_callbacks || !Py_IsInitialized()) return;
    gil_ = PyGILState_Ensure();
    taken_ = true;
    if (PyErr_Occurred() != nullptr) {
      PyErr_Fetch(&type_, &value_, &tb_);
      held_ = true;
      if (std::getenv("VMSTOOLKIT_SHIM_TRACE") != nullptr)
        std::fprintf(stderr, "shim: a Python exception is in flight; kept across the callback\n"), std::fflush(stderr);
    }
  }
  ~KeepPythonError() {
    if (held_) PyErr_Restore(type_, value_, tb_);
    if (taken_) PyGILState_Release(gil_);
  }
  KeepPythonError(const KeepPythonError&) = delete;
  KeepPythonError& operator=(const KeepPythonError&) = delete;

 private:
  PyGILState_STATE gil_{};
  PyObject* type_ = nullptr;
  PyObject* value_ = nullptr;
  PyObject* tb_ = nullptr;
  bool taken_ = false;
  bool held_ = false;
};

struct VmsAllocator : public Base {
  VmsAllocator(AllocFn a, FreeFn f, RecordFn r, StatsFn s, ResetFn rs, EmptyFn e, ErrorFn er)
      : Base(a, f), record_(r), stats_(s), reset_(rs), error_(er) {
    reset_fn_ = [e]() {
      KeepPythonError keep;
      e();
    };  // what the base's emptyCache calls
    record_stream_fn_ = [this](void* ptr, cudaStream_t stream) { this->record(ptr, stream); };
  }

  void* checked(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* p;
    {
      KeepPythonError keep;
      p = alloc_fn_(size, device, stream);
    }
    if (p == nullptr) {
      if (size == 0) return nullptr;
      const bool trace = std::getenv("VMSTOOLKIT_SHIM_TRACE") != nullptr;
      if (trace) std::fprintf(stderr, "shim: null for %zu bytes on %d; asking why\n", size, (int)device), std::fflush(stderr);
      std::string why(2048, '\0');
      int n;
      {
        KeepPythonError keep;
        n = error_(device, &why[0], why.size() - 1);
      }
      why.resize(n > 0 ? static_cast<size_t>(n) : 0);
      if (trace) std::fprintf(stderr, "shim: %s; throwing\n", why.c_str()), std::fflush(stderr);
      throw c10::OutOfMemoryError(
          c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          "CUDA out of memory (vmstoolkit). Tried to allocate " + std::to_string(size) + " bytes on device " +
              std::to_string(static_cast<int>(device)) + ". " + why);
    }
    {
      const std::lock_guard<std::mutex> lock(allocator_mutex_);
      blocks_[p] = Meta{size, static_cast<int>(device), stream};
    }
    return p;
  }

  void raw_delete(void* ptr) override {
    Meta m;
    {
      const std::lock_guard<std::mutex> lock(allocator_mutex_);
      auto it = blocks_.find(ptr);
      TORCH_CHECK(it != blocks_.end(), "vmstoolkit: free of a pointer it did not allocate: ", ptr);
      m = it->second;
      blocks_.erase(it);
    }
    KeepPythonError keep;
    free_fn_(ptr, m.size, m.device, m.stream);
  }

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    void* r = checked(size, device, stream);
    return {r, r, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device)};
  }

  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return checked(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return checked(nbytes, device, stream);
  }

  void record(void* ptr, cudaStream_t stream) {
    if (ptr == nullptr) return;
    int device;
    cudaStream_t own;
    {
      const std::lock_guard<std::mutex> lock(allocator_mutex_);
      auto it = blocks_.find(ptr);
      if (it == blocks_.end()) return;
      device = it->second.device;
      own = it->second.stream;
    }
    KeepPythonError keep;
    record_(ptr, device, own, stream);
  }

  c10::cuda::CUDACachingAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    int64_t v[N_STATS] = {0};
    {
      KeepPythonError keep;
      stats_(device, v, N_STATS);
    }
    c10::cuda::CUDACachingAllocator::DeviceStats s;
    const size_t all = 0;  // StatType::AGGREGATE
    auto bytes = [&](auto& stat) {
      stat[all].current = v[ALLOC_CUR];
      stat[all].peak = v[ALLOC_PEAK];
      stat[all].allocated = v[ALLOC_TOTAL];
      stat[all].freed = v[ALLOC_FREED];
    };
    bytes(s.allocated_bytes);
    bytes(s.requested_bytes);
    bytes(s.active_bytes);
    s.reserved_bytes[all].current = v[RES_CUR];
    s.reserved_bytes[all].peak = v[RES_PEAK];
    auto counts = [&](auto& stat) {
      stat[all].current = v[ACTIVE_CUR];
      stat[all].peak = v[ACTIVE_PEAK];
      stat[all].allocated = v[COUNT_ALLOC];
      stat[all].freed = v[COUNT_FREED];
    };
    counts(s.allocation);
    counts(s.active);
    s.num_ooms = v[OOMS];
    s.num_device_alloc = v[DEV_ALLOC];
    s.num_device_free = v[DEV_FREE];
    s.num_alloc_retries = v[RETRIES];
    return s;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    KeepPythonError keep;
    reset_(device, 1);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    KeepPythonError keep;
    reset_(device, 0);
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    // cuDNN sizes its workspace by the largest block the allocator could hand out: the device's
    // free memory is what a VMM allocator can map.
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      free_b = 0;
    }
    *largestBlock = free_b;
  }

  std::string name() override { return "vmstoolkit"; }

  std::unordered_map<void*, Meta> blocks_;
  RecordFn record_;
  StatsFn stats_;
  ResetFn reset_;
  ErrorFn error_;
};

void install(uint64_t a, uint64_t f, uint64_t r, uint64_t s, uint64_t rs, uint64_t e, uint64_t er, bool python) {
  g_python_callbacks = python;
  auto alloc = std::make_shared<VmsAllocator>(
      reinterpret_cast<AllocFn>(a), reinterpret_cast<FreeFn>(f), reinterpret_cast<RecordFn>(r),
      reinterpret_cast<StatsFn>(s), reinterpret_cast<ResetFn>(rs), reinterpret_cast<EmptyFn>(e),
      reinterpret_cast<ErrorFn>(er));
  alloc->init(c10::cuda::device_count());
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(alloc);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", [](uint64_t a, uint64_t f, uint64_t r, uint64_t s, uint64_t rs, uint64_t e, uint64_t er,
                      bool python) {
    try {
      install(a, f, r, s, rs, e, er, python);
    } catch (const c10::Error& err) {
      throw std::runtime_error(err.what_without_backtrace());
    }
  });
}
