// defines: add_plot_command
// `fourbit plot RUN_DIR... --out loss.png`: loss curves of several runs in one PNG; for RL runs
// (metrics with `reward`) the mean reward per step and the greedy held-out accuracy (from the
// initial policy's at step 0) instead. The drawing is
// gnuplot's (installed by scripts/install-deps.sh); this command reads each run's metrics.jsonl,
// writes the series beside the PNG (NAME.data/) with the gnuplot script, and runs it.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fourbit/io/atomic_file.h"
#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {
namespace fs = std::filesystem;

namespace {

struct Series {
  std::string label;
  std::string train_file, eval_file;
  int64_t n_train = 0, n_eval = 0;
  bool rl = false;  // an RL run: train = reward, eval = eval_accuracy
};

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

Series read_run(const std::string& run, const fs::path& data_dir, int index) {
  const fs::path metrics = fs::path(run) / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in) fail("{}: cannot open (is {} a fourbit run directory?)", metrics.string(), run);
  Series s;
  s.label = fs::path(run).filename().string();
  if (s.label.empty()) s.label = fs::path(run).parent_path().filename().string();
  const fs::path cfg = fs::path(run) / "config.json";
  if (fs::exists(cfg)) {
    try {
      std::ifstream c(cfg);
      const auto j = nlohmann::json::parse(c);
      const std::string recipe = j.value("recipe", std::string("?"));
      if (recipe != s.label) s.label += " (" + recipe + ")";
    } catch (const nlohmann::json::exception&) {
    }
  }
  std::string train, eval, reward, accuracy, line;
  int64_t lineno = 0, n_reward = 0, n_accuracy = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: not a JSON line: {}", metrics.string(), lineno, e.what());
    }
    if (!j.contains("step")) fail("{}:{}: line has no 'step'", metrics.string(), lineno);
    if (j.contains("loss")) {
      train += fmt::format("{} {}\n", j["step"].get<int64_t>(), j["loss"].get<double>());
      ++s.n_train;
    }
    if (j.contains("eval_loss") && j["eval_loss"].is_number()) {
      eval += fmt::format("{} {}\n", j["step"].get<int64_t>(), j["eval_loss"].get<double>());
      ++s.n_eval;
    }
    if (j.contains("reward")) {
      reward += fmt::format("{} {}\n", j["step"].get<int64_t>(), j["reward"].get<double>());
      ++n_reward;
    }
    if (j.contains("init_eval_accuracy")) {
      accuracy += fmt::format("0 {}\n", j["init_eval_accuracy"].get<double>());
      ++n_accuracy;
    }
    if (j.contains("eval_accuracy") && j["eval_accuracy"].is_number()) {
      accuracy += fmt::format("{} {}\n", j["step"].get<int64_t>(), j["eval_accuracy"].get<double>());
      ++n_accuracy;
    }
  }
  if (n_reward) {
    s.rl = true;
    train = reward;
    eval = accuracy;
    s.n_train = n_reward;
    s.n_eval = n_accuracy;
  }
  if (!s.n_train) fail("{}: no loss values to plot", metrics.string());
  s.train_file = (data_dir / fmt::format("run{}.train.dat", index)).string();
  s.eval_file = (data_dir / fmt::format("run{}.eval.dat", index)).string();
  io::write_file_atomic(s.train_file, train);
  io::write_file_atomic(s.eval_file, eval);
  return s;
}

}  // namespace

void add_plot_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("plot", "write a PNG of the loss curves of one or more runs");
  auto runs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>("loss.png");
  auto title = std::make_shared<std::string>("fourbit: loss");
  cmd->add_option("runs", *runs, "run directories")->required();
  cmd->add_option("--out", *out, "PNG to write")->capture_default_str();
  cmd->add_option("--title", *title, "plot title");
  add_threads_option(cmd);
  cmd->callback([runs, out, title]() {
    const fs::path png = fs::absolute(*out);
    const fs::path data_dir = png.parent_path() / (png.stem().string() + ".data");
    std::error_code ec;
    if (png.filename().empty() || fs::is_directory(png, ec))
      fail("--out {}: expected the name of a PNG file to write", *out);
    if (!fs::is_directory(png.parent_path(), ec))
      fail("--out {}: the directory {} does not exist", *out, png.parent_path().string());
    fs::create_directories(data_dir, ec);
    if (ec) fail("--out {}: cannot create {} for the plot's data: {}", *out, data_dir.string(), ec.message());
    if (::access(png.parent_path().c_str(), W_OK) != 0)
      fail("--out {}: the directory {} is not writable", *out, png.parent_path().string());
    if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
      fail("fourbit plot needs gnuplot (scripts/install-deps.sh installs gnuplot-nox)");
    std::vector<Series> series;
    for (size_t i = 0; i < runs->size(); ++i) series.push_back(read_run((*runs)[i], data_dir, int(i)));
    const bool rl = series[0].rl;
    for (const Series& s : series)
      if (s.rl != rl)
        fail("plot: {} and {} cannot share a plot: one is an RL run (reward, accuracy), the other is not (loss)",
             series[0].label, s.label);
    std::ostringstream gp;
    gp << "set terminal pngcairo size 1100,650 font 'sans,11'\n"
       << "set output " << quote(png.string()) << "\n"
       << "set title " << quote(*title) << "\n"
       << "set xlabel 'optimizer step'\n"
       << (rl ? "set ylabel 'mean reward / held-out accuracy'\nset yrange [0:1]\nset key bottom right\n"
              : "set ylabel 'cross-entropy (nats/token)'\nset logscale y\nset key top right\n")
       << "set grid\n";
    std::string plots;
    for (size_t i = 0; i < series.size(); ++i) {
      const Series& s = series[i];
      const int color = int(i) + 1;
      plots += fmt::format("{}{} using 1:2 with lines lw 1 lc {} dt 3 title {}", plots.empty() ? "" : ", ",
                           quote(s.train_file), color, quote(s.label + (rl ? " reward" : " train")));
      if (s.n_eval)
        plots += fmt::format(", {} using 1:2 with linespoints lw 2 pt 7 ps 0.8 lc {} title {}",
                             quote(s.eval_file), color, quote(s.label + (rl ? " held-out accuracy" : " eval")));
    }
    gp << "plot " << plots << "\n";
    const fs::path script = data_dir / "plot.gp";
    io::write_file_atomic(script.string(), gp.str());
    const std::string cmdline = "gnuplot " + quote(script.string()) + " 2>&1";
    std::FILE* p = ::popen(cmdline.c_str(), "r");
    if (!p) fail("could not run gnuplot");
    std::string msg;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p)) msg += buf;
    const int rc = ::pclose(p);
    if (rc != 0 || !fs::exists(png)) fail("--out {}: gnuplot failed to write it (script {}): {}", *out, script.string(), msg);
    std::printf("wrote %s (%zu runs; data and script in %s)\n", png.string().c_str(), series.size(),
                data_dir.string().c_str());
  });
}

}  // namespace fourbit::cli
