#include "tools/fourbit/commands.h"
namespace fourbit::cli {
void add_quant_command(CLI::App& app) { app.add_subcommand("quant", "quantize a tensor"); }
}
