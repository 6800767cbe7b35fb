// defines: add_summary_command
// `fourbit summary RUN_DIR...`: one line per run from its summary.json, and each run's final eval
// loss as a ratio of the first run's — how `make demo` compares nvfp4-fwd with mxfp8.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

void add_summary_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("summary", "compare finished runs (their summary.json)");
  auto runs = std::make_shared<std::vector<std::string>>();
  cmd->add_option("runs", *runs, "run directories")->required();
  cmd->callback([runs]() {
    std::printf("%-28s %-13s %6s %11s %11s %9s %12s %14s\n", "run", "recipe", "steps", "train loss",
                "eval loss", "unigram", "eval/unigram", "eval / first");
    double first = 0;
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
      const double eval = j.value("final_eval_loss", 0.0), uni = j.value("unigram_entropy_nats", 0.0);
      if (first == 0) first = eval;
      std::printf("%-28s %-13s %6lld %11.4f %11.4f %9.4f %12.3f %14.4f\n",
                  std::filesystem::path(r).filename().string().c_str(), j.value("recipe", "?").c_str(),
                  (long long)j.value("steps", int64_t(0)), j.value("final_train_loss", 0.0), eval, uni,
                  uni > 0 ? eval / uni : 0.0, first > 0 ? eval / first : 0.0);
    }
  });
}

}  // namespace fourbit::cli
