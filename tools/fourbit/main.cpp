// defines: main, parse_device
// The `fourbit` command line: one subcommand per job. Every user error ends as one line
// "fourbit: error: ..." on stderr and exit status 1.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::CPU;
  if (name == "cuda") {
    if (cuda_device_count() == 0)
      fail("no CUDA device: {}", cuda_built() ? "none is visible to this process" : "this fourbit was built without CUDA");
    return Device::CUDA;
  }
  if (name == "auto") return cuda_device_count() > 0 ? Device::CUDA : Device::CPU;
  fail("--device: expected cpu, cuda or auto, got '{}'", name);
}

}  // namespace fourbit::cli

int main(int argc, char** argv) {
  CLI::App app{"fourbit: MoE training with a native NVFP4 forward pass"};
  app.require_subcommand(1);
  fourbit::cli::add_pretrain_command(app);
  fourbit::cli::add_recipes_command(app);
  fourbit::cli::add_generate_command(app);
  fourbit::cli::add_plot_command(app);
  fourbit::cli::add_summary_command(app);
  fourbit::cli::add_quant_command(app);
  fourbit::cli::add_export_command(app);
  fourbit::cli::add_import_command(app);
  fourbit::cli::add_score_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // one line, like every other user error (CLI11 would add "Run with --help" and its own code)
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
