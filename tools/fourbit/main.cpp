// defines: main, parse_device, add_threads_option, invocation (commands.h)
// The `fourbit` command line: one subcommand per job. Every user error ends as one line
// "fourbit: error: ..." on stderr and exit status 1.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "fourbit/ops/threads.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "tools/fourbit/commands.h"
#include "tools/fourbit/omp_env.h"

namespace fourbit::cli {

namespace {
std::string g_invocation;
}

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

void add_threads_option(CLI::App* cmd) {
  cmd->add_option_function<int>(
         "--threads", [](const int& n) { set_threads(n); },
         "CPU threads (default: OMP_NUM_THREADS, else one per physical core)")
      ->type_name("N");
}

const std::string& invocation() { return g_invocation; }

void set_invocation(int argc, char** argv) {
  g_invocation.clear();
  for (int i = 0; i < argc; ++i) {
    if (i) g_invocation += ' ';
    g_invocation += i == 0 ? "fourbit" : argv[i];
  }
}

}  // namespace fourbit::cli

int main(int argc, char** argv) {
  // Before anything starts a thread: OpenMP's waiting policy is read once, at start-up.
  fourbit::cli::prepare_openmp_environment(argc, argv);
  fourbit::cli::set_invocation(argc, argv);
  fourbit::set_threads(fourbit::default_threads());
  CLI::App app{"fourbit: MoE training with a native NVFP4 forward pass"};
  app.require_subcommand(1);
  fourbit::cli::add_pretrain_command(app);
  fourbit::cli::add_recipes_command(app);
  fourbit::cli::add_sft_command(app);
  fourbit::cli::add_rl_command(app);
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
  } catch (const fourbit::cli::ExitStatus& e) {
    return e.status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
