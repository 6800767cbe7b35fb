// defines: the add_*_command functions, one per subcommand file, and shared CLI helpers.
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
