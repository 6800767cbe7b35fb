// defines: the add_*_command functions, one per subcommand file.
#pragma once
#include <CLI/CLI.hpp>

namespace fourbit::cli {
void add_quant_command(CLI::App& app);
}
