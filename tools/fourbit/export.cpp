// defines: add_export_command, add_import_command, add_score_command
// `fourbit export` (a run as a Hugging Face qwen2_moe checkpoint, plain or ModelOpt-quantized),
// `fourbit import` (a qwen2_moe checkpoint as a run) and `fourbit score` (one sequence's logits
// and log-probs, for comparisons with other implementations). docs/export.md.
#include <cstdio>
#include <optional>

#include <fmt/format.h>

#include "fourbit/hf/export.h"
#include "fourbit/hf/import.h"
#include "fourbit/hf/score.h"
#include "fourbit/io/npy.h"
#include "fourbit/model/recipe.h"
#include "fourbit/train/tokenizer.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

void add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "write a run as a Hugging Face qwen2_moe checkpoint (hf or modelopt)");
  struct Args {
    std::string run, format, out, dtype = "bf16", mxfp8 = "mxfp8";
    int64_t step = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--run", a->run, "run directory")->required();
  cmd->add_option("--step", a->step, "checkpoint step (default: the latest)");
  cmd->add_option("--format", a->format, "hf (effective weights, unquantized) or modelopt (NVFP4/MXFP8 as trained)")
      ->required();
  cmd->add_option("--out", a->out, "output directory (new or empty)")->required();
  cmd->add_option("--dtype", a->dtype, "hf: bf16 or f32 (f32 is exact)")->capture_default_str();
  cmd->add_option("--mxfp8", a->mxfp8,
                  "modelopt: mxfp8 (as trained) or bf16 (the MXFP8 layers' exact BF16 values, for engines whose "
                  "MIXED_PRECISION loader has no MXFP8)")
      ->capture_default_str();
  cmd->callback([a]() {
    if (a->mxfp8 != "mxfp8" && a->mxfp8 != "bf16") fail("--mxfp8: expected mxfp8 or bf16, got '{}'", a->mxfp8);
    hf::ExportOptions o;
    o.run_dir = a->run;
    if (a->step >= 0) o.step = a->step;
    o.format = a->format;
    o.out_dir = a->out;
    o.dtype = a->dtype;
    o.mxfp8_as_bf16 = a->mxfp8 == "bf16";
    const hf::ExportSummary s = hf::export_run(o);
    std::printf("exported %s as %s to %s: %lld tensors, %.2f MiB", s.checkpoint_dir.c_str(), a->format.c_str(),
                a->out.c_str(), (long long)s.tensors, double(s.bytes) / 1048576.0);
    if (a->format == "modelopt")
      std::printf(", %lld NVFP4 and %lld MXFP8 modules", (long long)s.nvfp4_modules, (long long)s.mxfp8_modules);
    std::printf("%s\n", s.config.tie_embeddings ? "" : ", untied LM head");
  });
}

void add_import_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("import", "read a Hugging Face qwen2_moe checkpoint into a new run directory");
  struct Args {
    std::string hf, out, recipe = "nvfp4-fwd";
    int64_t seed = 1234;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--hf", a->hf, "checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--out", a->out, "new run directory")->required();
  cmd->add_option("--recipe", a->recipe, "the recipe the run trains and generates with")->capture_default_str();
  cmd->add_option("--seed", a->seed, "the run's seed")->capture_default_str();
  cmd->callback([a]() {
    if (a->seed < 0) fail("--seed must be >= 0, got {}", a->seed);
    hf::ImportOptions o{a->hf, a->out, a->recipe, uint64_t(a->seed)};
    const hf::ImportSummary s = hf::import_hf(o);
    for (const std::string& n : s.notes) std::printf("note: %s\n", n.c_str());
    std::printf("imported %s into %s: %lld parameters, %lld layers (%lld dense), %lld experts top-%lld%s, recipe %s\n",
                a->hf.c_str(), s.checkpoint_dir.c_str(), (long long)s.params, (long long)s.config.n_layers,
                (long long)s.config.dense_layers, (long long)s.config.n_experts, (long long)s.config.top_k,
                s.config.n_shared_experts ? " + shared" : "", a->recipe.c_str());
  });
}

void add_score_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("score", "logits and log-probs of one sequence under a run");
  struct Args {
    std::string run, text, tokens, recipe, out, logprobs, device = "cpu";
    int64_t step = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--run", a->run, "run directory")->required();
  auto* text = cmd->add_option("--text", a->text, "text, scored as <bos> + its UTF-8 bytes (the byte tokenizer)");
  auto* toks = cmd->add_option("--tokens", a->tokens, ".npy of token ids (1-D, int32 or int64)");
  text->excludes(toks);
  cmd->add_option("--recipe", a->recipe,
                  "the run's own recipe by default; fp32 = its effective weights in FP32 (what the hf export holds)");
  cmd->add_option("--step", a->step, "checkpoint step (default: the latest)");
  cmd->add_option("--out", a->out, "logits .npy, float32 [T, V]")->required();
  cmd->add_option("--logprobs", a->logprobs, "log-probs .npy, float32 [T-1] (default: OUT with .logprobs.npy)");
  cmd->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str();
  cmd->callback([a]() {
    if (a->text.empty() == a->tokens.empty()) fail("score: give exactly one of --text TEXT and --tokens FILE.npy");
    if (!a->recipe.empty()) recipe_by_name(a->recipe);
    std::vector<int32_t> tokens;
    if (!a->tokens.empty()) {
      const Tensor t = io::read_npy(a->tokens);
      if (t.dim() != 1 || (t.dtype() != DType::I32 && t.dtype() != DType::I64))
        fail("{}: expected a 1-D int32 or int64 array of token ids, got {}", a->tokens, t.str());
      for (int64_t i = 0; i < t.numel(); ++i) {
        const int64_t v = t.dtype() == DType::I32 ? t.data<int32_t>()[i] : t.data<int64_t>()[i];
        if (v < 0 || v > INT32_MAX) fail("{}: token id {} at position {} is out of range", a->tokens, v, i);
        tokens.push_back(int32_t(v));
      }
    } else {
      tokens.push_back(data::kBos);
      for (int32_t t : data::encode(a->text)) tokens.push_back(t);
    }
    const std::optional<int64_t> step = a->step >= 0 ? std::optional<int64_t>(a->step) : std::nullopt;
    auto model = hf::scoring_model(a->run, step, a->recipe, parse_device(a->device));
    const hf::ScoreResult r = hf::score_tokens(*model, tokens);
    std::string lp_path = a->logprobs;
    if (lp_path.empty())
      lp_path = (a->out.size() > 4 && a->out.ends_with(".npy") ? a->out.substr(0, a->out.size() - 4) : a->out) +
                ".logprobs.npy";
    io::write_npy(a->out, r.logits);
    io::write_npy(lp_path, Tensor::from_host(r.logprobs.data(), {int64_t(r.logprobs.size())}, DType::F32));
    std::printf("scored %zu tokens with recipe %s: mean NLL %.6f nats/token; logits %s, log-probs %s\n", tokens.size(),
                model->recipe().name.c_str(), r.mean_nll, a->out.c_str(), lp_path.c_str());
  });
}

}  // namespace fourbit::cli
