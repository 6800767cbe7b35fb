// defines: add_quant_command, add_pretrain_command, add_recipes_command, add_generate_command,
//          add_plot_command, add_summary_command, add_export_command, add_import_command,
//          add_score_command, add_sft_command, add_rl_command, config_of_run, parse_device, add_threads_option, invocation, ExitStatus
// The subcommands' registration functions and the helpers they share. Where they live: quant.cpp
// (quant), pretrain.cpp (pretrain, recipes), generate.cpp, plot.cpp, summary.cpp, export.cpp
// (export, import, score), post_train.cpp (sft, rl); parse_device, add_threads_option and invocation in main.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <exception>
#include <string>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::cli {

void add_quant_command(CLI::App& app);
void add_pretrain_command(CLI::App& app);
void add_recipes_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_plot_command(CLI::App& app);
void add_summary_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_import_command(CLI::App& app);
void add_score_command(CLI::App& app);
void add_sft_command(CLI::App& app);
void add_rl_command(CLI::App& app);

// The config a --init run starts from when no --config is given: the one the weights of run (or
// checkpoint) `init` came with (pretrain.cpp).
RunConfig config_of_run(const std::string& init);


// --device cpu|cuda|auto -> a Device; auto picks cuda when a GPU is visible.
Device parse_device(const std::string& name);

// --threads N on `cmd`: the CPU threads of the ops (default: OMP_NUM_THREADS, else one per
// physical core). Applied when parsed, before the command runs.
void add_threads_option(CLI::App* cmd);

// The command line as typed (argv joined with spaces), for run records.
const std::string& invocation();
void set_invocation(int argc, char** argv);

// Thrown by a command to end the process with `status` after printing its own lines (a run
// stopped by SIGINT exits 130, by SIGTERM 143).
struct ExitStatus : std::exception {
  explicit ExitStatus(int s) : status(s) {}
  int status;
};

}  // namespace fourbit::cli
