// defines: median_seconds, BenchTable
// Shared helpers for the benchmarks: median wall time of repeated runs, and a table printer
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

  static std::string cell(const nlohmann::json& v) {
    if (v.is_number_float()) return fmt::format("{:.3f}", v.get<double>());
    if (v.is_string()) return v.get<std::string>();
    return v.dump();
  }

  // Columns as wide as their widest cell, so long names never run into the next column.
  void print() const {
    std::printf("\n%s\n", name.c_str());
    std::vector<size_t> width;
    for (const auto& c : columns) {
      size_t w = c.size();
      for (const auto& r : rows) w = std::max(w, cell(r.contains(c) ? r.at(c) : nlohmann::json("")).size());
      width.push_back(w + 2);
    }
    for (size_t i = 0; i < columns.size(); ++i) std::printf("%-*s", int(width[i]), columns[i].c_str());
    std::printf("\n");
    for (const auto& r : rows) {
      for (size_t i = 0; i < columns.size(); ++i)
        std::printf("%-*s", int(width[i]), cell(r.contains(columns[i]) ? r.at(columns[i]) : nlohmann::json("")).c_str());
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
