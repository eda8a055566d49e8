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
// - a Python exception in flight survives a callback into Python (KeepPythonError);
// - CUDA graph private pools with PyTorch's semantics: while a capture (or a thread given to a
//   pool) is active, the allocations it makes come from the pool (beginAllocateToPool's filter
//   decides, as in PyTorch); the shim tags each block with its pool and hands its free to the
//   pool, never to the allocator, until the pool is released. The pools themselves (what is
//   cached, when memory goes back) live in Python: vmstoolkit.pools.graph_pools.PrivatePools.
//   checkPoolLiveAllocations, getCheckpointState and setCheckpointPoolState (cudagraph trees)
//   answer from the tags;
// - setMemoryFraction / getMemoryFraction reach the allocator (a limit on live bytes);
// - the out-of-memory message begins as PyTorch's own ("CUDA out of memory. Tried to allocate
//   1.00 GiB. GPU 0 has a total capacity of ..."), which the ecosystem's OOM handlers match;
// - no call into Python once the interpreter is finalizing: a free then is dropped (the process
//   is ending, the driver takes the memory back) and an allocation raises. The handle behind the
//   entry points is kept alive for the process's life (a reference the shim never drops).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

namespace py = pybind11;
using c10::cuda::MempoolId_t;

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// The base class's _AllocationMetadata has no exported constructor (libtorch_cuda keeps it
// hidden), so the shim keeps its own record of each block and frees through it.
struct Meta {
  size_t size;
  int device;
  cudaStream_t stream;
  bool pooled = false;  // allocated inside a private pool (freed back to it)
  MempoolId_t pool{0, 0};
};

typedef void* (*AllocFn)(size_t, int, cudaStream_t);
typedef void (*FreeFn)(void*, size_t, int, cudaStream_t);
typedef void (*RecordFn)(void*, int, cudaStream_t, cudaStream_t);  // ptr, device, its stream, the user
typedef int (*StatsFn)(int, int64_t*, int);                           // device, out, count
typedef void (*ResetFn)(int, int);                                    // device, 0: peaks, 1: totals
typedef void (*EmptyFn)();
typedef int (*ErrorFn)(int, size_t, char*, size_t);                   // device, request, message buffer
typedef void* (*PoolAllocFn)(size_t, int, cudaStream_t, uint64_t, uint64_t);     // size, device, stream, pool id
typedef void (*PoolFreeFn)(void*, size_t, int, cudaStream_t, uint64_t, uint64_t);
typedef int (*PoolEventFn)(int, uint64_t, uint64_t, int, void*, size_t);  // device, pool id, what, ptr, size
typedef int (*FractionFn)(int, double);                                   // device, fraction (<0: ask) -> 0
typedef double (*GetFractionFn)(int);

// What PoolEventFn is told (the order of vmstoolkit.integrations.abi.POOL_EVENTS).
enum PoolEvent { POOL_USE = 0, POOL_RELEASE = 1, POOL_TAKE_BACK = 2, POOL_USE_COUNT = 3 };

// The order of vmstoolkit.integrations.bridge.STAT_KEYS.
enum Stat {
  ALLOC_CUR, ALLOC_PEAK, ALLOC_TOTAL, ALLOC_FREED, RES_CUR, RES_PEAK, ACTIVE_CUR, ACTIVE_PEAK,
  COUNT_ALLOC, COUNT_FREED, OOMS, DEV_ALLOC, DEV_FREE, RETRIES, N_STATS
};

// Whether the entry points are Python callbacks (ctypes: the Python allocators) rather than
// compiled functions (the paged hook); set once by install().
bool g_python_callbacks = false;

// VMSTOOLKIT_SHIM_CALL_AT_EXIT=1 turns the guard below off (to see what it prevents).
bool g_call_at_exit = false;
std::atomic<long> g_late_calls{0};  // calls that came after Python had begun finalizing

// With VMSTOOLKIT_SHIM_TRACE, says at the very end how many calls came too late for Python.
struct LateCallReport {
  ~LateCallReport() {
    if (std::getenv("VMSTOOLKIT_SHIM_TRACE") != nullptr)
      std::fprintf(stderr, "shim: %ld call(s) after Python began finalizing%s\n", g_late_calls.load(),
                   g_call_at_exit ? " (passed to Python: VMSTOOLKIT_SHIM_CALL_AT_EXIT)" : " (dropped)");
  }
} g_late_call_report;

// True once Python is finalizing or gone: no callback may run then (see the file's head).
bool python_gone() {
  const bool gone = !Py_IsInitialized() ||
#if PY_VERSION_HEX >= 0x030D0000
                    Py_IsFinalizing() != 0;
#else
                    _Py_IsFinalizing() != 0;
#endif
  if (gone) g_late_calls.fetch_add(1);
  return gone && !g_call_at_exit;
}


// PyTorch's format_size: "1.00 GiB", "512.00 KiB", "100 bytes".
std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", size / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", size / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", size / 1073741824.0);
  }
  return buf;
}

// The pool state cudagraph trees checkpoint after each recording: the pool's live blocks.
struct PoolState : public c10::cuda::CUDACachingAllocator::AllocatorState {
  int device;
  MempoolId_t pool;
  std::unordered_map<void*, Meta> live;
};

// One active allocation into a pool: a capture or a thread given to the pool.
struct Capture {
  int device;
  MempoolId_t pool;
  std::function<bool(cudaStream_t)> filter;
};

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

// The entry points, in the order vmstoolkit.integrations.torch.HookBase.shim_pointers gives them.
struct EntryPoints {
  AllocFn alloc;
  FreeFn free;
  RecordFn record;
  StatsFn stats;
  ResetFn reset;
  EmptyFn empty;
  ErrorFn error;
  PoolAllocFn pool_alloc;
  PoolFreeFn pool_free;
  PoolEventFn pool_event;
  FractionFn set_fraction;
  GetFractionFn get_fraction;
};

struct VmsAllocator : public Base {
  explicit VmsAllocator(const EntryPoints& ep) : Base(ep.alloc, ep.free), ep_(ep) {
    EmptyFn e = ep.empty;
    reset_fn_ = [e]() {
      if (python_gone()) return;
      KeepPythonError keep;
      e();
    };  // what the base's emptyCache calls
    record_stream_fn_ = [this](void* ptr, cudaStream_t stream) { this->record(ptr, stream); };
  }

  // The message begins as PyTorch's own ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0
  // has a total capacity of ..."), so that handlers matching it (accelerate's
  // find_executable_batch_size, Lightning's is_oom_error) recognise the error. Python writes it
  // (vmstoolkit.integrations.bridge.oom_message); `why` serves when Python cannot be asked.
  [[noreturn]] void out_of_memory(size_t size, c10::DeviceIndex device, const std::string& why = "") {
    std::string msg = why.empty() ? last_error(device, size) : std::string();
    if (msg.empty()) {
      size_t free_b = 0, total = 0;
      if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) (void)cudaGetLastError();
      msg = "CUDA out of memory. Tried to allocate " + format_size(size) + ". GPU " +
            std::to_string(static_cast<int>(device)) + " has a total capacity of " + format_size(total) + " of which " +
            format_size(free_b) + " is free. vmstoolkit: " + (why.empty() ? "no reason given" : why);
    }
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
  }

  std::string last_error(c10::DeviceIndex device, size_t size = 0) {
    if (python_gone()) return "";
    std::string why(4096, '\0');
    int n;
    {
      KeepPythonError keep;
      n = ep_.error(device, size, &why[0], why.size() - 1);
    }
    why.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return why;
  }

  // The pool this allocation goes to, if a capture or a thread given to a pool asks for it.
  bool pool_for(c10::DeviceIndex device, cudaStream_t stream, MempoolId_t* pool) {
    if (n_captures_.load(std::memory_order_acquire) == 0) return false;
    const std::lock_guard<std::mutex> lock(capture_mutex_);
    for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
      if (it->device == device && it->filter(stream)) {
        *pool = it->pool;
        return true;
      }
    }
    return false;
  }

  void* checked(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (python_gone()) {
      if (size == 0) return nullptr;
      out_of_memory(size, device, "the Python interpreter is shutting down");
    }
    MempoolId_t pool{0, 0};
    const bool pooled = size > 0 && pool_for(device, stream, &pool);
    void* p;
    {
      KeepPythonError keep;
      p = pooled ? ep_.pool_alloc(size, device, stream, pool.first, pool.second) : ep_.alloc(size, device, stream);
    }
    if (p == nullptr) {
      if (size == 0) return nullptr;
      const bool trace = std::getenv("VMSTOOLKIT_SHIM_TRACE") != nullptr;
      if (trace) std::fprintf(stderr, "shim: null for %zu bytes on %d; asking why\n", size, (int)device), std::fflush(stderr);
      out_of_memory(size, device);
    }
    {
      const std::lock_guard<std::mutex> lock(allocator_mutex_);
      Meta m{size, static_cast<int>(device), stream};
      m.pooled = pooled;
      m.pool = pool;
      blocks_[p] = m;
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
    if (python_gone()) return;  // the process is ending: the driver takes the memory back
    KeepPythonError keep;
    if (m.pooled) {
      ep_.pool_free(ptr, m.size, m.device, m.stream, m.pool.first, m.pool.second);
    } else {
      free_fn_(ptr, m.size, m.device, m.stream);
    }
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
    if (ptr == nullptr || python_gone()) return;
    int device;
    cudaStream_t own;
    {
      const std::lock_guard<std::mutex> lock(allocator_mutex_);
      auto it = blocks_.find(ptr);
      if (it == blocks_.end() || it->second.pooled) return;  // a pool's blocks stay in the pool anyway
      device = it->second.device;
      own = it->second.stream;
    }
    KeepPythonError keep;
    ep_.record(ptr, device, own, stream);
  }

  // -- private pools (CUDA graphs, cudagraph trees, MemPool) ---------------------------------
  int pool_event(int device, MempoolId_t pool, PoolEvent what, void* ptr = nullptr, size_t size = 0) {
    if (python_gone()) return 0;
    KeepPythonError keep;
    return ep_.pool_event(device, pool.first, pool.second, static_cast<int>(what), ptr, size);
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t pool, std::function<bool(cudaStream_t)> filter) override {
    pool_event(device, pool, POOL_USE);
    const std::lock_guard<std::mutex> lock(capture_mutex_);
    captures_.push_back(Capture{static_cast<int>(device), pool, std::move(filter)});
    n_captures_.store(static_cast<int>(captures_.size()), std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t pool) override {
    const std::lock_guard<std::mutex> lock(capture_mutex_);
    for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
      if (it->device == device && it->pool == pool) {
        captures_.erase(std::next(it).base());
        break;
      }
    }
    n_captures_.store(static_cast<int>(captures_.size()), std::memory_order_release);
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t pool) override { pool_event(device, pool, POOL_RELEASE); }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t pool,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr,
                "vmstoolkit is installed as PyTorch's allocator: a torch.cuda.MemPool with an allocator of its own "
                "cannot be used beside it (use vmstoolkit.integrations.torch.use_pool without install())");
    pool_event(device, pool, POOL_USE);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t pool) override {
    return pool_event(device, pool, POOL_USE_COUNT);
  }

  std::unordered_map<void*, Meta> pool_blocks(int device, MempoolId_t pool) {
    std::unordered_map<void*, Meta> out;
    const std::lock_guard<std::mutex> lock(allocator_mutex_);
    for (const auto& kv : blocks_)
      if (kv.second.pooled && kv.second.device == device && kv.second.pool == pool) out.emplace(kv.first, kv.second);
    return out;
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t pool,
                                const std::unordered_set<void*>& expected) override {
    auto live = pool_blocks(device, pool);
    if (live.size() != expected.size()) return false;
    for (const auto& kv : live)
      if (expected.count(kv.first) == 0) return false;
    return true;
  }

  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                                                      MempoolId_t pool) override {
    auto state = std::make_shared<PoolState>();
    state->device = device;
    state->pool = pool;
    state->live = pool_blocks(device, pool);
    return state;
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<PoolState>(pps);
    TORCH_CHECK(state != nullptr, "vmstoolkit: setCheckpointPoolState got a state it did not make");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    // As PyTorch's allocator does: every block of the pool allocated now is freed (back to the
    // pool), then every block allocated at the checkpoint is allocated again at its address, with
    // a DataPtr PyTorch hands to the storages that live on (torch._C._cuda_setCheckpointPoolState).
    for (const auto& kv : pool_blocks(device, state->pool)) {
      raw_delete(kv.first);
      delta.ptrs_freed.push_back(kv.first);
    }
    for (const auto& kv : state->live) {
      const int ok = pool_event(device, state->pool, POOL_TAKE_BACK, kv.first, kv.second.size);
      TORCH_CHECK(ok == 1, "vmstoolkit: the pool's block at ", kv.first, " (", kv.second.size,
                  " bytes) is no longer the pool's; the checkpoint cannot be restored (the handle's last_error says why)");
      {
        const std::lock_guard<std::mutex> lock(allocator_mutex_);
        blocks_[kv.first] = kv.second;
      }
      delta.dataptrs_allocd.emplace_back(kv.first, kv.first, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // -- memory fraction --------------------------------------------------------------------------
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    int err;
    {
      KeepPythonError keep;
      err = ep_.set_fraction(device, fraction);
    }
    TORCH_CHECK(err == 0, "vmstoolkit: set_per_process_memory_fraction(", fraction,
                ") failed (the handle's last_error says why)");
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    KeepPythonError keep;
    return ep_.get_fraction(device);
  }

  c10::cuda::CUDACachingAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    int64_t v[N_STATS] = {0};
    {
      KeepPythonError keep;
      ep_.stats(device, v, N_STATS);
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
    ep_.reset(device, 1);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    KeepPythonError keep;
    ep_.reset(device, 0);
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

  // Every live block PyTorch holds: (address, size, device, stream, pool id or (0, 0)).
  std::vector<std::tuple<uint64_t, uint64_t, int, uint64_t, uint64_t, uint64_t>> live_blocks() {
    std::vector<std::tuple<uint64_t, uint64_t, int, uint64_t, uint64_t, uint64_t>> out;
    const std::lock_guard<std::mutex> lock(allocator_mutex_);
    out.reserve(blocks_.size());
    for (const auto& kv : blocks_)
      out.emplace_back(reinterpret_cast<uint64_t>(kv.first), kv.second.size, kv.second.device,
                       reinterpret_cast<uint64_t>(kv.second.stream), kv.second.pooled ? kv.second.pool.first : 0,
                       kv.second.pooled ? kv.second.pool.second : 0);
    return out;
  }

  EntryPoints ep_;
  std::unordered_map<void*, Meta> blocks_;
  std::mutex capture_mutex_;
  std::vector<Capture> captures_;
  std::atomic<int> n_captures_{0};
};

std::shared_ptr<VmsAllocator> g_allocator;  // the installed one (PyTorch holds it too)

void install(const std::vector<uint64_t>& p, bool python, py::object keep_alive) {
  TORCH_CHECK(p.size() == 12, "vmstoolkit shim: 12 entry points expected, got ", p.size());
  EntryPoints ep{reinterpret_cast<AllocFn>(p[0]),      reinterpret_cast<FreeFn>(p[1]),
                 reinterpret_cast<RecordFn>(p[2]),     reinterpret_cast<StatsFn>(p[3]),
                 reinterpret_cast<ResetFn>(p[4]),      reinterpret_cast<EmptyFn>(p[5]),
                 reinterpret_cast<ErrorFn>(p[6]),      reinterpret_cast<PoolAllocFn>(p[7]),
                 reinterpret_cast<PoolFreeFn>(p[8]),   reinterpret_cast<PoolEventFn>(p[9]),
                 reinterpret_cast<FractionFn>(p[10]),  reinterpret_cast<GetFractionFn>(p[11])};
  g_python_callbacks = python;
  g_call_at_exit = std::getenv("VMSTOOLKIT_SHIM_CALL_AT_EXIT") != nullptr;
  auto alloc = std::make_shared<VmsAllocator>(ep);
  alloc->init(c10::cuda::device_count());
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(alloc);
  g_allocator = alloc;
  // The handle owns the callbacks and the compiled entry points: PyTorch may call them until the
  // process ends (tensors freed during finalization), so it must outlive every module teardown.
  new py::object(std::move(keep_alive));  // never released, on purpose
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", [](const std::vector<uint64_t>& p, bool python, py::object keep_alive) {
    try {
      install(p, python, std::move(keep_alive));
    } catch (const c10::Error& err) {
      throw std::runtime_error(err.what_without_backtrace());
    }
  });
  m.def("live_blocks", []() {
    TORCH_CHECK(g_allocator != nullptr, "vmstoolkit shim: nothing installed");
    return g_allocator->live_blocks();
  });
  m.def("format_size", [](uint64_t n) { return format_size(n); });
}
