// A kernel-time profiler for machines without Nsight Systems: a CUDA injection library
// (CUDA_INJECTION64_PATH=libfourbit_kprof.so ./program) that records every kernel and memcpy
// through CUPTI's activity API and, at exit, prints the GPU time per kernel name, the launch
// count, and how much of the wall-clock span between the first and the last GPU activity the GPU
// was busy (the rest is launch overhead and host work the GPU waited for), and which activities
// the GPU waited before: every idle gap shorter than 1 ms is charged to the activity that ends it,
// so a host read-back or a stretch of launches the host cannot issue fast enough shows up under
// the first kernel issued after it.
// KPROF_OUT=FILE also writes both tables as JSON; KPROF_TOP=N limits the printed rows (default 40).
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
    bool operator<(const Span& o) const { return start < o.start; }
  };
  std::vector<Span> spans;  // every record
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
      st.spans.push_back({k->start, k->end, &it->first});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      const auto it = st.by_name
                          .try_emplace(m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "[memcpy HtoD]"
                                       : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "[memcpy DtoH]"
                                                                                          : "[memcpy other]")
                          .first;
      it->second.ns += m->end - m->start;
      it->second.count += 1;
      st.spans.push_back({m->start, m->end, &it->first});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      const auto it = st.by_name.try_emplace("[memset]").first;
      it->second.ns += m->end - m->start;
      it->second.count += 1;
      st.spans.push_back({m->start, m->end, &it->first});
    }
  }
  std::free(buffer);
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
  std::atexit(report);
  return 1;
}
