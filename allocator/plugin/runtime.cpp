// runtime.cpp: configuration, per-device allocators, timing and recording for the plugin.
#include "runtime.h"

#include "log.h"
#include "recording_backend.h"

#include <cachealloc/cuda/factory.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/trace/snapshot.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace cachealloc::plugin {
namespace {

std::atomic<Runtime*> g_runtime{nullptr};

/// Serialises the runtime's creation with configure(); holds what configure() set.
struct PendingStart {
  std::mutex mutex;
  std::optional<std::string> conf_text;  ///< instead of the environment variable
  RuntimeHooks hooks;
};

PendingStart& pending_start() {
  static auto* pending = new PendingStart();  // NOLINT(cppcoreguidelines-owning-memory): leaked like the runtime
  return *pending;
}

std::string registered_policy_names() {
  std::string names;
  for (const PolicyInfo& p : registered_policies()) {
    names += names.empty() ? "" : ", ";
    names += p.name;
  }
  return names;
}

/// Takes the front end's keys from `config` into `out`; throws ConfigError for a bad value.
void take_front_end(Config& config, FrontEndSettings& out) {
  if (auto v = config.take_string("policy")) {
    out.policy = *v;
  }
  if (auto v = config.take_bool("timing")) {
    out.timing = *v;
  }
  if (auto v = config.take_string("record")) {
    out.record_path = *v;
  }
  if (auto v = config.take_int("record_max_entries", 0, std::int64_t{1} << 40)) {
    out.record_max_entries = static_cast<std::size_t>(*v);
  }
  if (auto v = config.take_bool("full")) {
    out.full = *v;
  }
  if (auto v = config.take_string("log_level")) {
    LogLevel level{};
    if (!parse_log_level(*v, level)) {
      throw ConfigError("CACHEALLOC_CONF: 'log_level' expects trace, debug, info, warn, error or off, got '" +
                        *v + "'");
    }
    out.log_level = *v;
  }
}

std::vector<std::string_view> valid_keys(const PolicyInfo& policy) {
  std::vector<std::string_view> keys = front_end_config_keys();
  for (std::string_view k : policy.config_keys()) {
    keys.push_back(k);
  }
  for (std::string_view k : cuda_backend_config_keys(backend_kind(policy.backend))) {
    keys.push_back(k);
  }
  return keys;
}

bool sim_requested() {
  const char* v = std::getenv("CACHEALLOC_PLUGIN_BACKEND");
  return v != nullptr && std::string_view(v) == "sim";
}

std::size_t env_size(const char* name, std::size_t fallback, std::size_t min, std::size_t max) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0' || n < min || n > max) {
    throw ConfigError(std::string(name) + " must be an integer between " + std::to_string(min) + " and " +
                      std::to_string(max) + ", got '" + v + "'");
  }
  return static_cast<std::size_t>(n);
}

SimOptions sim_options(int device) {
  SimOptions o;
  o.device = device;
  o.capacity = env_size("CACHEALLOC_PLUGIN_SIM_CAPACITY_MB", 143771, 1, std::size_t{1} << 30) * kMiB;
  o.auto_complete_events = true;
  return o;
}

std::string substitute_pid(std::string path) {
  const std::string pid = std::to_string(static_cast<long long>(::getpid()));
  for (std::size_t pos = path.find("%p"); pos != std::string::npos; pos = path.find("%p", pos + pid.size())) {
    path.replace(pos, 2, pid);
  }
  return path;
}

trace::Action to_action(AllocatorEvent event) noexcept {
  switch (event) {
    case AllocatorEvent::alloc: return trace::Action::alloc;
    case AllocatorEvent::free_requested: return trace::Action::free_requested;
    case AllocatorEvent::free_completed: return trace::Action::free_completed;
    case AllocatorEvent::oom: return trace::Action::oom;
  }
  return trace::Action::other;
}

void write_recording_hook() noexcept {
  if (Runtime* rt = Runtime::existing()) {
    rt->write_recording_at_exit();
  }
}

/// Adds the time since `start` to `counter` when the scope ends, exception or not.
class ChargeTicks {
 public:
  ChargeTicks(const TickClock& clock, std::atomic<std::uint64_t>& counter) noexcept
      : clock_(clock), counter_(counter), start_(clock.now()) {}
  ~ChargeTicks() { counter_.fetch_add(clock_.now() - start_, std::memory_order_relaxed); }
  ChargeTicks(const ChargeTicks&) = delete;
  ChargeTicks& operator=(const ChargeTicks&) = delete;

 private:
  const TickClock& clock_;
  std::atomic<std::uint64_t>& counter_;
  std::uint64_t start_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Validation (Note [Config validation])

FrontEndSettings validate_config(std::string_view text) {
  Config names = Config::parse(text);
  FrontEndSettings settings;
  take_front_end(names, settings);
  const PolicyInfo* policy = find_policy(settings.policy);
  if (policy == nullptr) {
    throw ConfigError("CACHEALLOC_CONF: unknown policy '" + settings.policy +
                      "'; registered policies: " + registered_policy_names());
  }
  settings.backend_kind = std::string(backend_kind(policy->backend));

  // 1. Key names.
  const std::vector<std::string_view> keys = valid_keys(*policy);
  for (std::string_view k : keys) {
    (void)names.take_string(k);
  }
  names.finish("policy " + settings.policy, keys);

  // 2. Values, by building the policy over a simulated device.
  Config values = Config::parse(text);
  FrontEndSettings scratch;
  take_front_end(values, scratch);
  check_cuda_backend_config(settings.backend_kind, values);  // the backend's keys, by value
  if (policy->backend == BackendNeed::stream_ordered) {
    return settings;
  }
  try {
    auto probe = make_allocator(settings.policy, std::make_unique<SimBackend>(SimOptions{}), values);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    // Not a configuration problem (the policy may want a real device): the real start reports it.
    log_debug(std::string("config validation: the policy could not be built on the simulated device: ") +
              e.what());
  }
  return settings;
}

std::string out_of_memory_advice(const FrontEndSettings& settings, const std::string& conf_text) {
  std::string advice = " [cachealloc is PyTorch's CUDA allocator here, CACHEALLOC_CONF='" + conf_text +
                       "' (policy " + settings.policy + ").";
  std::string others;
  for (const PolicyInfo& p : registered_policies()) {
    if (p.name == settings.policy || p.replay_only) {
      continue;
    }
    others += others.empty() ? "" : "; ";
    others += "policy:" + std::string(p.name) + " (" + std::string(p.summary) + ")";
  }
  if (!others.empty()) {
    advice += " Other policies may fit this workload: " + others + ".";
  }
  advice += " Check torch.cuda.set_per_process_memory_fraction() if you set one; unset CACHEALLOC_CONF "
            "to compare with PyTorch's own allocator.]";
  return advice;
}

// ---------------------------------------------------------------------------------------------
// Runtime

Runtime& Runtime::get() {
  if (Runtime* rt = g_runtime.load(std::memory_order_acquire)) {
    return *rt;
  }
  // A mutex, not a function-local static: a creation that throws (bad CACHEALLOC_CONF) leaves
  // nothing behind, so that a later call tries again.
  PendingStart& pending = pending_start();
  std::lock_guard lock(pending.mutex);
  if (Runtime* rt = g_runtime.load(std::memory_order_acquire)) {
    return *rt;
  }
  std::string text;
  FrontEndSettings settings;
  if (pending.conf_text) {
    text = *pending.conf_text;
    settings = validate_config(text);  // checked by configure() already
  } else {
    const char* env = std::getenv("CACHEALLOC_CONF");
    text = env != nullptr ? env : "";
    try {
      settings = validate_config(text);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string(e.what()) + " (from the environment variable CACHEALLOC_CONF)");
    }
  }
  // Leaked on purpose: see runtime.h.
  auto* rt = new Runtime(std::move(text), std::move(settings), pending.hooks);  // NOLINT(cppcoreguidelines-owning-memory)
  g_runtime.store(rt, std::memory_order_release);
  return *rt;
}

void Runtime::configure(std::string conf_text, RuntimeHooks hooks) {
  (void)validate_config(conf_text);
  PendingStart& pending = pending_start();
  std::lock_guard lock(pending.mutex);
  if (g_runtime.load(std::memory_order_acquire) != nullptr) {
    throw UsageError("cachealloc: the allocator runtime of this process already started (with CACHEALLOC_CONF='" +
                     g_runtime.load()->conf_text() + "'); it cannot be configured again");
  }
  pending.conf_text = std::move(conf_text);
  pending.hooks = std::move(hooks);
}

Runtime* Runtime::existing() noexcept { return g_runtime.load(std::memory_order_acquire); }

Runtime::Runtime(std::string conf_text, FrontEndSettings settings, RuntimeHooks hooks)
    : conf_text_(std::move(conf_text)), settings_(std::move(settings)), hooks_(std::move(hooks)) {
  LogLevel level = LogLevel::warn;
  (void)parse_log_level(settings_.log_level, level);
  set_log_level(level);
  if (sim_requested()) {
    device_count_ = static_cast<int>(env_size("CACHEALLOC_PLUGIN_SIM_DEVICES", 1, 1, 64));
    log_warn("CACHEALLOC_PLUGIN_BACKEND=sim: allocations come from a SIMULATED device (tests only)");
  } else {
    device_count_ = cuda_device_count();
  }
  slots_ = std::make_unique<DeviceSlot[]>(static_cast<std::size_t>(std::max(device_count_, 0)));
  if (settings_.record_path) {
    record_path_ = substitute_pid(*settings_.record_path);
    recorder_ = std::make_unique<Recorder>(static_cast<std::size_t>(std::max(device_count_, 0)),
                                           settings_.record_max_entries);
    std::atexit(&write_recording_hook);
    log_info("recording allocator events to " + record_path_ + " (written at exit and by dump_snapshot)");
  }
  log_info("policy " + settings_.policy + " on backend kind " + settings_.backend_kind + ", " +
           std::to_string(device_count_) + " device(s), timing " + (settings_.timing ? "on" : "off") +
           (clock_.uses_tsc() ? " (TSC)" : " (clock_gettime)"));
}

Runtime::DeviceSlot& Runtime::slot(int device) const {
  if (device < 0 || device >= device_count_) {
    if (device_count_ == 0) {
      throw DeviceError("cachealloc: no CUDA device is visible to this process (device " +
                        std::to_string(device) + " requested)");
    }
    throw UsageError("cachealloc: device " + std::to_string(device) + " does not exist; this process sees " +
                     std::to_string(device_count_) + " device(s)");
  }
  return slots_[static_cast<std::size_t>(device)];
}

DeviceAllocator& Runtime::allocator(int device) {
  DeviceSlot& s = slot(device);
  if (DeviceAllocator* a = s.allocator.load(std::memory_order_acquire)) {
    return *a;
  }
  // A mutex, not std::call_once: a creation that throws (no device, bad value) must leave the
  // slot empty so that the next call tries again, and call_once's exception path has had
  // implementation bugs.
  std::lock_guard lock(s.create_mutex);
  if (DeviceAllocator* a = s.allocator.load(std::memory_order_acquire)) {
    return *a;
  }
  s.owner = create_allocator(device);
  s.allocator.store(s.owner.get(), std::memory_order_release);
  return *s.owner;
}

DeviceAllocator* Runtime::allocator_if_created(int device) const noexcept {
  if (device < 0 || device >= device_count_) {
    return nullptr;
  }
  return slots_[static_cast<std::size_t>(device)].allocator.load(std::memory_order_acquire);
}

std::unique_ptr<DeviceAllocator> Runtime::create_allocator(int device) {
  (void)slot(device);  // a bad index throws
  Config config = Config::parse(conf_text_);
  FrontEndSettings ignored;
  take_front_end(config, ignored);
  const PolicyInfo* policy = find_policy(settings_.policy);  // validated in get()
  std::unique_ptr<DeviceBackend> backend;
  if (sim_requested()) {
    for (std::string_view k : cuda_backend_config_keys(settings_.backend_kind)) {
      (void)config.take_string(k);
    }
    backend = std::make_unique<SimBackend>(sim_options(device));
  } else {
    backend = make_cuda_backend(settings_.backend_kind, device, config);
  }
  if (hooks_.wrap_backend && policy->backend != BackendNeed::stream_ordered) {
    backend = hooks_.wrap_backend(std::move(backend));
  }
  if (recorder_ && policy->backend != BackendNeed::stream_ordered) {
    backend = std::make_unique<RecordingBackend>(std::move(backend), *recorder_);
  }
  std::unique_ptr<DeviceAllocator> alloc = make_allocator(settings_.policy, std::move(backend), config);
  config.finish("policy " + settings_.policy, valid_keys(*policy));
  if (recorder_ || hooks_.observer) {
    Recorder* rec = recorder_.get();
    DeviceAllocator* raw = alloc.get();
    auto hook = hooks_.observer;
    alloc->set_observer([rec, raw, hook, device](AllocatorEvent event, std::uintptr_t addr, std::size_t size,
                                                 StreamId stream) {
      if (hook) {
        hook(device, event, addr, size, stream);
      }
      if (rec == nullptr) {
        return;
      }
      std::uint64_t a = addr;
      if (event == AllocatorEvent::oom) {  // PyTorch's oom entry carries the device's free bytes
        try {
          a = raw->backend().free_memory();
        } catch (...) {  // NOLINT(bugprone-empty-catch): the entry keeps addr 0
        }
      }
      rec->record(to_action(event), device, a, size, stream);
    });
  }
  log_info("device " + std::to_string(device) + ": policy " + std::string(alloc->policy_name()) +
           " on backend " + std::string(alloc->backend().name()));
  return alloc;
}

void* Runtime::allocate(std::size_t bytes, int device, StreamId stream) {
  DeviceSlot& s = slot(device);
  DeviceAllocator* a = s.allocator.load(std::memory_order_acquire);
  if (a == nullptr) {
    a = &allocator(device);
  }
  if (!settings_.timing) {
    return a->allocate(bytes, stream);
  }
  ChargeTicks charge(clock_, s.alloc_ticks);
  return a->allocate(bytes, stream);
}

void Runtime::deallocate(void* ptr, int device) {
  if (ptr == nullptr) {
    return;
  }
  DeviceSlot& s = slot(device);
  DeviceAllocator* a = s.allocator.load(std::memory_order_acquire);
  if (a == nullptr) {
    throw UsageError(unknown_pointer_text(ptr, "free", device, settings_.policy));
  }
  if (!settings_.timing) {
    a->deallocate(ptr);
    return;
  }
  ChargeTicks charge(clock_, s.free_ticks);
  a->deallocate(ptr);
}

DeviceAllocator* Runtime::owner_of(const void* ptr) const noexcept {
  for (int d = 0; d < device_count_; ++d) {
    DeviceAllocator* a = allocator_if_created(d);
    try {
      if (a != nullptr && a->find(ptr)) {
        return a;
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): find() does not throw in practice
    }
  }
  return nullptr;
}

void Runtime::record_stream(void* ptr, StreamId stream) {
  if (ptr == nullptr) {
    return;
  }
  DeviceAllocator* a = owner_of(ptr);
  if (a == nullptr) {
    throw UsageError(unknown_pointer_text(ptr, "record_stream", -1, settings_.policy));
  }
  a->record_stream(ptr, stream);
}

void* find_base_allocation(const DeviceAllocator& allocator, const void* ptr, std::size_t* size) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  for (const SegmentView& seg : allocator.segments()) {
    if (addr >= seg.address && addr - seg.address < seg.size) {
      if (size != nullptr) {
        *size = seg.size;
      }
      return reinterpret_cast<void*>(seg.address);
    }
  }
  if (auto info = allocator.find(ptr)) {  // a policy without visit_segments: the block itself
    if (size != nullptr) {
      *size = info->block_size;
    }
    return info->ptr;
  }
  return nullptr;
}

void* Runtime::base_allocation(void* ptr, std::size_t* size) {
  for (int d = 0; d < device_count_; ++d) {
    if (const DeviceAllocator* a = allocator_if_created(d)) {
      if (void* base = find_base_allocation(*a, ptr, size)) {
        return base;
      }
    }
  }
  throw UsageError(unknown_pointer_text(ptr, "getBaseAllocation", -1, settings_.policy));
}

void Runtime::set_memory_fraction(double fraction, int device) { allocator(device).set_memory_fraction(fraction); }

void Runtime::empty_cache(int device) {
  if (device >= 0) {
    if (DeviceAllocator* a = allocator_if_created(device)) {
      a->empty_cache();
    } else {
      (void)slot(device);  // a bad index still throws
    }
    return;
  }
  for (int d = 0; d < device_count_; ++d) {
    if (DeviceAllocator* a = allocator_if_created(d)) {
      a->empty_cache();
    }
  }
}

void Runtime::reset_peak(int device) {
  for (int d = 0; d < device_count_; ++d) {
    if (device >= 0 && d != device) {
      continue;
    }
    if (DeviceAllocator* a = allocator_if_created(d)) {
      a->reset_peak_stats();
    }
  }
}

void Runtime::reset_accumulated(int device) {
  for (int d = 0; d < device_count_; ++d) {
    if (device >= 0 && d != device) {
      continue;
    }
    if (DeviceAllocator* a = allocator_if_created(d)) {
      a->reset_accumulated_stats();
      slots_[static_cast<std::size_t>(d)].alloc_ticks.store(0, std::memory_order_relaxed);
      slots_[static_cast<std::size_t>(d)].free_ticks.store(0, std::memory_order_relaxed);
    }
  }
}

void Runtime::check_invariants(int device) {
  for (int d = 0; d < device_count_; ++d) {
    if (device >= 0 && d != device) {
      continue;
    }
    if (DeviceAllocator* a = allocator_if_created(d)) {
      a->check_invariants();
    }
  }
}

std::map<std::string, std::int64_t> Runtime::stats_map(int device) {
  DeviceSlot& s = slot(device);
  DeviceAllocator* a = s.allocator.load(std::memory_order_acquire);
  std::map<std::string, std::int64_t> m = a != nullptr ? a->stats().to_map() : Stats{}.to_map();
  const auto alloc_ns = static_cast<std::int64_t>(clock_.to_ns(s.alloc_ticks.load(std::memory_order_relaxed)));
  const auto free_ns = static_cast<std::int64_t>(clock_.to_ns(s.free_ticks.load(std::memory_order_relaxed)));
  m["alloc_ns"] = alloc_ns;
  m["free_ns"] = free_ns;
  m["allocator_ns"] = alloc_ns + free_ns;
  m["num_pending_frees"] = a != nullptr ? static_cast<std::int64_t>(a->pending_frees()) : 0;
  return m;
}

std::uint64_t Runtime::allocator_ns(int device) {
  const DeviceSlot& s = slot(device);
  return clock_.to_ns(s.alloc_ticks.load(std::memory_order_relaxed) +
                      s.free_ticks.load(std::memory_order_relaxed));
}

void Runtime::dump_snapshot(const std::string& path) {
  std::lock_guard lock(dump_mutex_);
  trace::Snapshot snap;
  snap.device_count = static_cast<std::size_t>(std::max(device_count_, 0));
  // Segments first, then events: an allocation racing with the dump shows up in the trace only.
  for (int d = 0; d < device_count_; ++d) {
    DeviceAllocator* a = allocator_if_created(d);
    if (a == nullptr) {
      continue;
    }
    const bool expandable = settings_.backend_kind == "virtual_memory";
    for (const SegmentView& seg : a->segments()) {
      trace::SegmentInfo info;
      info.device = d;
      info.address = seg.address;
      info.total_size = seg.size;
      for (const BlockView& b : seg.blocks) {
        info.allocated_size += b.allocated ? b.size : 0;
      }
      info.stream = seg.stream;
      info.segment_type = seg.small_pool ? "small" : "large";
      info.is_expandable = expandable;
      snap.segments.push_back(std::move(info));
    }
  }
  if (recorder_) {
    snap.events = recorder_->events();
  }
  trace::write_snapshot(path, snap);
}

void Runtime::write_recording_at_exit() noexcept {
  if (!recorder_) {
    return;
  }
  try {
    dump_snapshot(record_path_);
    const std::uint64_t dropped = recorder_->dropped();
    log_info("wrote the allocator trace to " + record_path_ +
             (dropped != 0 ? " (" + std::to_string(dropped) + " older events dropped)" : ""));
  } catch (const std::exception& e) {
    log_error(std::string("could not write the allocator trace at exit: ") + e.what());
  }
}

}  // namespace cachealloc::plugin
