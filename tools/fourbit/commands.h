// defines: add_quant_command, add_pretrain_command, add_recipes_command, add_generate_command,
//          add_plot_command, add_summary_command, parse_device
// The subcommands' registration functions and the helpers they share. Where they live: quant.cpp
// (quant), pretrain.cpp (pretrain, recipes, generate: one run's life), plot.cpp, summary.cpp;
// parse_device in main.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

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

// --device cpu|cuda|auto -> a Device; auto picks cuda when a GPU is visible.
Device parse_device(const std::string& name);

}  // namespace fourbit::cli
