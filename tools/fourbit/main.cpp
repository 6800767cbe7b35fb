// The `fourbit` command line: one subcommand per job (quant now; pretrain, plot, recipes ... as
// they land). Every user error ends as one line "fourbit: error: ..." and exit status 1.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"fourbit: MoE training with a native NVFP4 forward pass"};
  app.require_subcommand(1);
  fourbit::cli::add_quant_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fourbit::Error& e) {
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
