// defines: add_summary_command
// `fourbit summary RUN_DIR...`: one line per run from its summary.json, and each run's final eval
// loss as a ratio of the first run's — how `make demo` compares nvfp4-fwd with mxfp8.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

void add_summary_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("summary", "compare finished runs (their summary.json)");
  auto runs = std::make_shared<std::vector<std::string>>();
  cmd->add_option("runs", *runs, "run directories")->required();
  add_threads_option(cmd);
  cmd->callback([runs]() {
    std::printf("%-28s %-13s %6s %11s %11s %9s %12s %14s\n", "run", "recipe", "steps", "train loss",
                "eval loss", "unigram", "eval/unigram", "eval / first");
    // A number the run did not measure (no eval batches, no steps) prints as "-", never as 0.
    auto num = [](const nlohmann::json& j, const char* key) -> std::optional<double> {
      if (!j.contains(key) || !j[key].is_number()) return std::nullopt;
      return j[key].get<double>();
    };
    auto cell = [](std::optional<double> v, int width, int decimals) {
      return v ? fmt::format("{:>{}.{}f}", *v, width, decimals) : fmt::format("{:>{}}", "-", width);
    };
    std::optional<double> first;
    for (const std::string& r : *runs) {
      const std::string path = (std::filesystem::path(r) / "summary.json").string();
      std::ifstream in(path);
      if (!in) fail("{}: cannot open (has the run finished?)", path);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        fail("{}: not valid JSON: {}", path, e.what());
      }
      const auto eval = num(j, "final_eval_loss"), uni = num(j, "unigram_entropy_nats");
      if (!first && r == runs->front()) first = eval;
      const std::optional<double> ratio = eval && uni && *uni > 0 ? std::optional<double>(*eval / *uni) : std::nullopt;
      const std::optional<double> rel = eval && first && *first > 0 ? std::optional<double>(*eval / *first) : std::nullopt;
      std::printf("%-28s %-13s %6lld %s %s %s %s %s\n", std::filesystem::path(r).filename().string().c_str(),
                  j.value("recipe", "?").c_str(), (long long)j.value("steps", int64_t(0)),
                  cell(num(j, "final_train_loss"), 11, 4).c_str(), cell(eval, 11, 4).c_str(), cell(uni, 9, 4).c_str(),
                  cell(ratio, 12, 3).c_str(), cell(rel, 14, 4).c_str());
    }
  });
}

}  // namespace fourbit::cli
