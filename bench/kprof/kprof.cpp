// A kernel-time profiler for machines without Nsight Systems: a CUDA injection library
// (CUDA_INJECTION64_PATH=libfourbit_kprof.so ./program) that records every kernel and memcpy
// through CUPTI's activity API and, at exit, prints the GPU time per kernel name, the launch
// count, and how much of the wall-clock span between the first and the last GPU activity the GPU
// was busy (the rest is launch overhead and host work the GPU waited for), and which activities
// the GPU waited before: every idle gap shorter than 1 ms is charged to the activity that ends it,
// so a host read-back or a stretch of launches the host cannot issue fast enough shows up under
// the first kernel issued after it.
// KPROF_OUT=FILE also writes both tables as JSON; KPROF_TOP=N limits the printed rows (default 40).
// KPROF_TRACE=FILE also records the CUDA runtime and driver API calls (more overhead) and writes
// the last KPROF_TRACE_MS milliseconds (default 120) as a timeline: every activity with its GPU
// time, the idle gap before it and how long before its start the host had issued it ("lead"; a
// lead shorter than the gap means the GPU waited for that launch), plus the host's synchronizing
// calls. The summary then splits the short idle gaps into those where the host issued the next
// activity only after the GPU had gone idle ("host late") and the rest.
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Entry {
  uint64_t ns = 0, count = 0;
};

struct State {
  std::mutex mu;
  std::map<std::string, Entry> by_name;
  struct Span {
    uint64_t start, end;
    const std::string* name;  // the by_name key (std::map keys do not move)
    uint32_t corr = 0;        // the correlation id of the API call that issued it
    bool operator<(const Span& o) const { return start < o.start; }
  };
  std::vector<Span> spans;  // every record
  // with KPROF_TRACE: the API call that issued each activity (by correlation id), and host calls
  // that wait for the GPU
  struct Api {
    uint64_t start, end;
  };
  std::map<uint32_t, Api> api_by_corr;
  struct HostWait {
    uint64_t start, end;
    std::string name;
  };
  std::vector<HostWait> waits;
};
State& state() {
  static State* s = new State;  // never destroyed: CUPTI may flush during exit
  return *s;
}

std::string short_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  // keep "ns::kernel<template args>" readable: drop "(anonymous namespace)::" and the parameters
  for (size_t at; (at = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(at, 23);
  const size_t paren = s.find('(');
  if (paren != std::string::npos) s.resize(paren);
  if (s.size() > 150) s = s.substr(0, 147) + "...";
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      const auto it = st.by_name.try_emplace(short_name(k->name)).first;
      it->second.ns += k->end - k->start;
      it->second.count += 1;
      st.spans.push_back({k->start, k->end, &it->first, k->correlationId});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      const auto it = st.by_name
                          .try_emplace(m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "[memcpy HtoD]"
                                       : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "[memcpy DtoH]"
                                                                                          : "[memcpy other]")
                          .first;
      it->second.ns += m->end - m->start;
      it->second.count += 1;
      st.spans.push_back({m->start, m->end, &it->first, m->correlationId});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      const auto it = st.by_name.try_emplace("[memset]").first;
      it->second.ns += m->end - m->start;
      it->second.count += 1;
      st.spans.push_back({m->start, m->end, &it->first, m->correlationId});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME || rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      // the runtime's record wins over the driver call it makes under the same correlation id
      auto [at, fresh] = st.api_by_corr.try_emplace(a->correlationId, State::Api{a->start, a->end});
      if (!fresh && rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) at->second = State::Api{a->start, a->end};
      const char* name = nullptr;
      cuptiGetCallbackName(rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                     : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      if (name && a->end - a->start >= 5000 &&
          (std::strstr(name, "Synchronize") || std::strstr(name, "cudaMemcpy_") ||
           std::strcmp(name, "cudaMemcpy") == 0 || std::strstr(name, "cuMemcpyDtoH") ||
           std::strstr(name, "cuStreamSynchronize") || std::strstr(name, "cuEventSynchronize")))
        st.waits.push_back({a->start, a->end, name});
    }
  }
  std::free(buffer);
}

// The timeline of the last KPROF_TRACE_MS ms (see the header); st.spans is sorted by start.
void write_trace(const char* path, uint64_t last) {
  State& st = state();
  const char* ms_env = std::getenv("KPROF_TRACE_MS");
  const uint64_t window = uint64_t((ms_env ? std::atof(ms_env) : 120.0) * 1e6);
  const uint64_t from = last > window ? last - window : 0;
  // Host lateness over the whole run: a short gap whose ending activity was issued after the GPU
  // had gone idle.
  uint64_t late_ns = 0, late_gaps = 0, other_ns = 0, other_gaps = 0, prev_end = 0;
  FILE* f = std::fopen(path, "w");
  if (!f) return;
  std::fprintf(f, "# t_ms\tgpu_us\tgap_us\tlead_us\tname   (t from the window's start; lead: start - issuing call's start)\n");
  size_t w = 0;
  std::sort(st.waits.begin(), st.waits.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
  for (const State::Span& sp : st.spans) {
    const auto api = st.api_by_corr.find(sp.corr);
    const bool has_api = api != st.api_by_corr.end();
    const uint64_t gap = prev_end && sp.start > prev_end ? sp.start - prev_end : 0;
    if (gap > 0 && gap < 1000000) {
      if (has_api && api->second.end > prev_end) {
        late_ns += gap;
        ++late_gaps;
      } else {
        other_ns += gap;
        ++other_gaps;
      }
    }
    if (sp.start >= from) {
      for (; w < st.waits.size() && st.waits[w].start < sp.start; ++w)
        if (st.waits[w].start >= from)
          std::fprintf(f, "%.3f\t%.1f\t\t\t[host waits: %s]\n", (st.waits[w].start - from) * 1e-6,
                       (st.waits[w].end - st.waits[w].start) * 1e-3, st.waits[w].name.c_str());
      std::fprintf(f, "%.3f\t%.1f\t%.1f\t", (sp.start - from) * 1e-6, (sp.end - sp.start) * 1e-3, gap * 1e-3);
      if (has_api)
        std::fprintf(f, "%.1f", (double(sp.start) - double(api->second.start)) * 1e-3);
      std::fprintf(f, "\t%s\n", sp.name->c_str());
    }
    prev_end = std::max(prev_end, sp.end);
  }
  std::fclose(f);
  uint64_t wait_ns = 0;
  for (const auto& hw : st.waits) wait_ns += hw.end - hw.start;
  std::fprintf(stderr,
               "kprof: short idle gaps where the host issued the next activity after the GPU went idle: %.1f ms in "
               "%llu gaps; other short gaps %.1f ms in %llu; host calls waiting for the GPU: %.1f ms in %zu\n",
               late_ns * 1e-6, static_cast<unsigned long long>(late_gaps), other_ns * 1e-6,
               static_cast<unsigned long long>(other_gaps), wait_ns * 1e-6, st.waits.size());
}

void report() {
  cuptiActivityFlushAll(1);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.spans.empty()) return;
  // Busy time = union of the activity intervals (kernels on one stream do not overlap anyway).
  std::sort(st.spans.begin(), st.spans.end());
  // Idle gaps shorter than 1 ms are the GPU waiting for the host to issue work (launch overhead);
  // longer ones are host phases (setup, data, logging) and not counted as such.
  uint64_t busy = 0, cur_s = st.spans[0].start, cur_e = st.spans[0].end, last = 0;
  uint64_t short_idle = 0, short_gaps = 0;
  std::map<std::string, Entry> waited_before;  // short gaps by the activity that ended them
  for (const State::Span& sp : st.spans) {
    if (sp.start > cur_e) {
      if (sp.start - cur_e < 1000000) {
        short_idle += sp.start - cur_e;
        ++short_gaps;
        Entry& w = waited_before[*sp.name];
        w.ns += sp.start - cur_e;
        w.count += 1;
      }
      busy += cur_e - cur_s;
      cur_s = sp.start;
      cur_e = sp.end;
    } else {
      cur_e = std::max(cur_e, sp.end);
    }
    last = std::max(last, sp.end);
  }
  busy += cur_e - cur_s;
  const uint64_t span = last - st.spans[0].start;
  if (const char* trace_path = std::getenv("KPROF_TRACE")) write_trace(trace_path, last);
  std::vector<std::pair<std::string, Entry>> rows(st.by_name.begin(), st.by_name.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  uint64_t total = 0, launches = 0;
  for (const auto& r : rows) {
    total += r.second.ns;
    launches += r.second.count;
  }
  std::fprintf(stderr, "kprof: %.1f ms idle in %llu gaps shorter than 1 ms (the GPU waiting for launches)\n",
               short_idle * 1e-6, static_cast<unsigned long long>(short_gaps));
  const char* top_env = std::getenv("KPROF_TOP");
  const size_t top = top_env ? size_t(std::atol(top_env)) : 40;
  std::fprintf(stderr, "\nkprof: GPU busy %.1f ms of a %.1f ms span (%.1f%%), %llu activities, %.1f ms summed\n",
               busy * 1e-6, span * 1e-6, 100.0 * double(busy) / double(span),
               static_cast<unsigned long long>(launches), total * 1e-6);
  std::fprintf(stderr, "%10s %8s %9s %6s  %s\n", "ms", "count", "us/call", "share", "name");
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const Entry& e = rows[i].second;
    std::fprintf(stderr, "%10.2f %8llu %9.1f %5.1f%%  %s\n", e.ns * 1e-6, static_cast<unsigned long long>(e.count),
                 e.ns * 1e-3 / double(e.count), 100.0 * double(e.ns) / double(total), rows[i].first.c_str());
  }
  std::vector<std::pair<std::string, Entry>> waits(waited_before.begin(), waited_before.end());
  std::sort(waits.begin(), waits.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  std::fprintf(stderr, "\nkprof: idle gaps (< 1 ms) by the activity that ended them\n%10s %8s %9s  %s\n", "ms", "gaps",
               "us/gap", "name");
  for (size_t i = 0; i < waits.size() && i < top; ++i) {
    const Entry& e = waits[i].second;
    std::fprintf(stderr, "%10.2f %8llu %9.1f  %s\n", e.ns * 1e-6, static_cast<unsigned long long>(e.count),
                 e.ns * 1e-3 / double(e.count), waits[i].first.c_str());
  }
  const auto json_rows = [](FILE* f, const std::vector<std::pair<std::string, Entry>>& rs) {
    for (size_t i = 0; i < rs.size(); ++i) {
      std::string n;
      for (char c : rs[i].first) n += (c == '"' || c == '\\') ? '_' : c;
      std::fprintf(f, "%s\n  {\"name\": \"%s\", \"ms\": %.4f, \"count\": %llu}", i ? "," : "", n.c_str(),
                   rs[i].second.ns * 1e-6, static_cast<unsigned long long>(rs[i].second.count));
    }
  };
  if (const char* path = std::getenv("KPROF_OUT")) {
    if (FILE* f = std::fopen(path, "w")) {
      std::fprintf(f, "{\"busy_ms\": %.4f, \"span_ms\": %.4f, \"short_idle_ms\": %.4f, \"kernels\": [", busy * 1e-6,
                   span * 1e-6, short_idle * 1e-6);
      json_rows(f, rows);
      std::fprintf(f, "\n], \"idle_before\": [");
      json_rows(f, waits);
      std::fprintf(f, "\n]}\n");
      std::fclose(f);
    }
  }
}

}  // namespace

extern "C" int InitializeInjection() {
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  if (std::getenv("KPROF_TRACE")) {
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
  }
  std::atexit(report);
  return 1;
}
