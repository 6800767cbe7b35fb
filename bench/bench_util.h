// defines: median_seconds, BenchTable
// Shared helpers for the CPU benchmarks: median wall time of repeated runs, and a table printer
// that also writes the rows as JSON (bench/results/). Ratios are always against a baseline
// measured in the same process, because these machines are noisy.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace fourbit::bench {

inline double median_seconds(const std::function<void()>& fn, int reps, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct BenchTable {
  std::string name;
  std::vector<std::string> columns;
  nlohmann::json rows = nlohmann::json::array();
  nlohmann::json meta = nlohmann::json::object();

  void add(const nlohmann::json& row) { rows.push_back(row); }

  void print() const {
    std::printf("\n%s\n", name.c_str());
    for (const auto& c : columns) std::printf("%-22s", c.c_str());
    std::printf("\n");
    for (const auto& r : rows) {
      for (const auto& c : columns) {
        const auto& v = r.contains(c) ? r.at(c) : nlohmann::json("");
        if (v.is_number_float()) std::printf("%-22s", fmt::format("{:.3f}", v.get<double>()).c_str());
        else if (v.is_string()) std::printf("%-22s", v.get<std::string>().c_str());
        else std::printf("%-22s", v.dump().c_str());
      }
      std::printf("\n");
    }
  }

  void write_json(const std::string& path) const {
    if (path.empty()) return;
    std::ofstream out(path);
    out << nlohmann::json{{"bench", name}, {"meta", meta}, {"rows", rows}}.dump(2) << "\n";
    std::printf("wrote %s\n", path.c_str());
  }
};

inline std::string json_path_arg(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--json") return argv[i + 1];
  return "";
}

}  // namespace fourbit::bench
