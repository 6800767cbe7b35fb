// defines: the ExportCli tests: `fourbit export`, `fourbit import` and `fourbit score` run as a user
//          would. A trained nvfp4-fwd run exported as hf --dtype f32, imported and exported again
//          gives the same tensors bit for bit, and `score --recipe fp32` the same logits on both
//          runs; an imported run is accepted by generate, pretrain --resume and export; sharded,
//          BF16 and fused-expert (transformers 5) checkpoints import to the same parameters; every
//          bad input (truncated or corrupted safetensors, config.json with a missing or wrong
//          field, shapes that disagree, another architecture, non-zero biases, a gated shared
//          expert, unknown or missing tensors) ends in exactly one "fourbit: error:" line.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "fourbit/hf/effective.h"
#include "fourbit/hf/export.h"
#include "fourbit/hf/qwen2_moe.h"
#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/numerics/bf16.h"
#include "model/model_test_util.h"
#include "tools/cli_test_util.h"

using namespace fourbit;
using namespace fourbit::clitest;
using namespace fourbit::modeltest;
namespace fs = std::filesystem;

namespace {

// 3 layers: dense, MoE with NVFP4 experts, MoE in nvfp4-fwd's MXFP8 tail; a shared expert; tied.
const char* kConfig =
    "[model]\n"
    "vocab_size = 260\nd_model = 32\nn_layers = 3\nn_heads = 2\nn_kv_heads = 1\nmax_seq_len = 32\n"
    "n_experts = 4\ntop_k = 2\nd_expert = 32\nn_shared_experts = 1\nd_shared = 32\ndense_layers = 1\n"
    "d_dense = 64\n"
    "[train]\n"
    "batch_size = 2\nseq_len = 16\nsteps = 2\nwarmup_steps = 1\neval_every = 0\neval_batches = 1\n"
    "log_every = 1\ncheckpoint_every = 1\nseed = 7\n"
    "[data]\nsource = \"synthetic\"\n";

void write_text(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

// The error contract: exit status 1 and exactly one "fourbit: error:" line, the last one.
std::string expect_one_error(const CliRun& r) {
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  const std::vector<std::string> lines = lines_of(r.err);
  int n = 0;
  for (const auto& l : lines) n += l.rfind("fourbit: error:", 0) == 0;
  EXPECT_EQ(n, 1) << "stderr:\n" << r.err;
  EXPECT_EQ(lines.size(), 1u) << "stderr:\n" << r.err;
  return lines.empty() ? "" : lines.back();
}

void expect_ok(const CliRun& r, const std::string& what) { ASSERT_EQ(r.status, 0) << what << "\n" << r.out << r.err; }

std::map<std::string, std::string> tensor_bytes(const std::string& path) {
  std::map<std::string, std::string> out;
  const io::SafetensorsFile f = io::read_safetensors(path);
  for (const auto& [name, t] : f.tensors)
    out[name] = f.dtype_names.at(name) + std::string(static_cast<const char*>(t.raw()), size_t(t.nbytes()));
  return out;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(file_bytes(path)); }

// A trained 2-step nvfp4-fwd run under dir/run.
std::string trained_run(const std::string& dir) {
  write_text(dir + "/cfg.toml", kConfig);
  const std::string run = dir + "/run";
  expect_ok(run_cli(dir, "pretrain --config '" + dir + "/cfg.toml' --recipe nvfp4-fwd --out '" + run + "' --device cpu"),
            "pretrain");
  return run;
}

// A qwen2_moe directory written from a seeded model (no training), F32 unless bf16.
std::string hf_dir(const std::string& dir, bool bf16 = false) {
  ModelConfig c = tiny_moe_config(3, 32);
  c.d_shared = 32;
  Model m(c, recipe_by_name("fp32"), Device::CPU);
  init_params(m.params(), c, 5);
  ModelConfig out_cfg;
  const auto tensors = hf::hf_tensors(hf::effective_weights(m), bf16 ? DType::BF16 : DType::F32, &out_cfg);
  const std::string ck = dir + "/hf";
  fs::create_directories(ck);
  io::write_safetensors(ck + "/model.safetensors", tensors, {{"format", "pt"}});
  io::write_file_atomic(ck + "/config.json", hf::qwen2_moe_config(out_cfg, bf16 ? "bfloat16" : "float32").dump(2));
  return ck;
}

// Rewrites ck/model.safetensors through `edit` on its (name, tensor) list.
void edit_tensors(const std::string& ck, const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  io::SafetensorsFile f = io::read_safetensors(ck + "/model.safetensors");
  edit(f.tensors);
  io::write_safetensors(ck + "/model.safetensors", f.tensors, f.metadata);
}

void edit_config(const std::string& ck, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = read_json(ck + "/config.json");
  edit(j);
  io::write_file_atomic(ck + "/config.json", j.dump(2));
}

Tensor& tensor_named(std::vector<std::pair<std::string, Tensor>>& ts, const std::string& name) {
  for (auto& [n, t] : ts)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

}  // namespace

TEST(ExportCli, HfF32RoundTripIsBitwiseAndScoresAgree) {
  const std::string dir = fresh_test_dir("hf_cli");
  const std::string run = trained_run(dir);
  expect_ok(run_cli(dir, "export --run '" + run + "' --format hf --dtype f32 --out '" + dir + "/h1'"), "export h1");
  expect_ok(run_cli(dir, "import --hf '" + dir + "/h1' --out '" + dir + "/run2' --recipe fp32"), "import");
  expect_ok(run_cli(dir, "export --run '" + dir + "/run2' --format hf --dtype f32 --out '" + dir + "/h2'"), "export h2");
  const auto a = tensor_bytes(dir + "/h1/model.safetensors"), b = tensor_bytes(dir + "/h2/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, bytes] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(bytes == b.at(name)) << name << " differs after export -> import -> export";
  }
  EXPECT_EQ(read_json(dir + "/h1/config.json"), read_json(dir + "/h2/config.json"));
  EXPECT_EQ(read_json(dir + "/h1/config.json")["tie_word_embeddings"], false) << "the BF16 LM head is its own tensor";

  const std::string text = " --text '12+35=47 and the cat sat' ";
  expect_ok(run_cli(dir, "score --run '" + run + "' --recipe fp32" + text + "--out '" + dir + "/s1.npy'"), "score 1");
  expect_ok(run_cli(dir, "score --run '" + dir + "/run2' --recipe fp32" + text + "--out '" + dir + "/s2.npy'"), "score 2");
  expect_ok(run_cli(dir, "score --run '" + dir + "/run2'" + text + "--out '" + dir + "/s3.npy'"), "score 3");
  EXPECT_TRUE(file_bytes(dir + "/s1.npy") == file_bytes(dir + "/s2.npy")) << "fp32 logits differ";
  EXPECT_TRUE(file_bytes(dir + "/s1.logprobs.npy") == file_bytes(dir + "/s2.logprobs.npy"));
  EXPECT_TRUE(file_bytes(dir + "/s2.npy") == file_bytes(dir + "/s3.npy")) << "run2 trains in fp32: its own recipe";
  // The run's own nvfp4-fwd forward quantizes activations: other logits.
  const CliRun own = run_cli(dir, "score --run '" + run + "'" + text + "--out '" + dir + "/s4.npy'");
  expect_ok(own, "score 4");
  EXPECT_HAS(own.out, "recipe nvfp4-fwd");
  EXPECT_FALSE(file_bytes(dir + "/s1.npy") == file_bytes(dir + "/s4.npy"));

  const CliRun mo = run_cli(dir, "export --run '" + run + "' --format modelopt --out '" + dir + "/m1'");
  expect_ok(mo, "export modelopt");
  // layer 1: 4 experts x 3 + shared 3 in NVFP4; attention (3 x 4), the dense FFN (3) and layer
  // 2's experts and shared expert (15) in MXFP8.
  EXPECT_HAS(mo.out, "15 NVFP4 and 30 MXFP8 modules");
  const nlohmann::json q = read_json(dir + "/m1/hf_quant_config.json");
  EXPECT_EQ(q["quantization"]["quant_algo"], "MIXED_PRECISION");
  EXPECT_EQ(read_json(dir + "/m1/config.json")["quantization_config"]["quant_method"], "modelopt");
}

TEST(ExportCli, ImportedRunIsAcceptedEverywhere) {
  const std::string dir = fresh_test_dir("hf_cli");
  const std::string ck = hf_dir(dir), run = dir + "/run";
  const CliRun imp = run_cli(dir, "import --hf '" + ck + "' --out '" + run + "'");
  expect_ok(imp, "import");
  EXPECT_HAS(imp.out, "recipe nvfp4-fwd");
  expect_ok(run_cli(dir, "generate --run '" + run + "' --prompt '1+1=' --max-new 3 --device cpu"), "generate");
  // No training yet: no activation statistics for NVFP4 input scales.
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + run + "' --format modelopt --out '" + dir + "/m0'")),
             "no activation statistics for 'model.layers.1.mlp.experts.0.gate_proj'");
  expect_ok(run_cli(dir, "pretrain --resume '" + run + "' --steps 1 --device cpu"),
            "pretrain --resume");
  EXPECT_TRUE(fs::is_directory(run + "/checkpoints/step-000001"));
  expect_ok(run_cli(dir, "export --run '" + run + "' --format modelopt --out '" + dir + "/m1'"), "export modelopt");
  expect_ok(run_cli(dir, "export --run '" + run + "' --step 0 --format hf --out '" + dir + "/h0'"), "export step 0");
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + run + "' --step 5 --format hf --out '" + dir + "/h5'")),
             "no checkpoint for step 5 (checkpoints: ");
}

TEST(ExportCli, ShardedBf16AndFusedCheckpointsImportToTheSameParameters) {
  const std::string dir = fresh_test_dir("hf_cli");
  const std::string ck = hf_dir(dir);
  expect_ok(run_cli(dir, "import --hf '" + ck + "' --out '" + dir + "/single' --recipe fp32"), "single");
  const auto want = tensor_bytes(dir + "/single/checkpoints/step-000000/model.safetensors");

  // Sharded: two files and an index.
  const std::string sh = dir + "/sharded";
  fs::create_directories(sh);
  fs::copy_file(ck + "/config.json", sh + "/config.json");
  io::SafetensorsFile f = io::read_safetensors(ck + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> a(f.tensors.begin(), f.tensors.begin() + 10), b(f.tensors.begin() + 10, f.tensors.end());
  nlohmann::json map = nlohmann::json::object();
  for (const auto& [n, t] : a) map[n] = "model-00001-of-00002.safetensors";
  for (const auto& [n, t] : b) map[n] = "model-00002-of-00002.safetensors";
  io::write_safetensors(sh + "/model-00001-of-00002.safetensors", a, {{"format", "pt"}});
  io::write_safetensors(sh + "/model-00002-of-00002.safetensors", b, {{"format", "pt"}});
  io::write_file_atomic(sh + "/model.safetensors.index.json", nlohmann::json{{"metadata", {}}, {"weight_map", map}}.dump());
  expect_ok(run_cli(dir, "import --hf '" + sh + "' --out '" + dir + "/r_sharded' --recipe fp32"), "sharded");
  EXPECT_TRUE(tensor_bytes(dir + "/r_sharded/checkpoints/step-000000/model.safetensors") == want);

  // transformers 5's fused experts: experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F].
  const std::string fu = dir + "/fused";
  fs::create_directories(fu);
  fs::copy_file(ck + "/config.json", fu + "/config.json");
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& [n, t] : f.tensors)
    if (n.find(".mlp.experts.") == std::string::npos) ts.emplace_back(n, t);
  for (int l : {1, 2}) {
    Tensor gu = Tensor::empty({4, 64, 32}, DType::F32), dn = Tensor::empty({4, 32, 32}, DType::F32);
    for (int e = 0; e < 4; ++e) {
      const std::string x = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      std::memcpy(gu.data<float>() + e * 2048, f.get(x + "gate_proj.weight").raw(), 4096);
      std::memcpy(gu.data<float>() + e * 2048 + 1024, f.get(x + "up_proj.weight").raw(), 4096);
      std::memcpy(dn.data<float>() + e * 1024, f.get(x + "down_proj.weight").raw(), 4096);
    }
    ts.emplace_back("model.layers." + std::to_string(l) + ".mlp.experts.gate_up_proj", gu);
    ts.emplace_back("model.layers." + std::to_string(l) + ".mlp.experts.down_proj", dn);
  }
  io::write_safetensors(fu + "/model.safetensors", ts, {{"format", "pt"}});
  expect_ok(run_cli(dir, "import --hf '" + fu + "' --out '" + dir + "/r_fused' --recipe fp32"), "fused");
  EXPECT_TRUE(tensor_bytes(dir + "/r_fused/checkpoints/step-000000/model.safetensors") == want);

  // BF16: the same parameters rounded to BF16, read back exactly.
  const std::string bdir = dir + "/b";
  fs::create_directories(bdir);
  const std::string bck = hf_dir(bdir, true);
  expect_ok(run_cli(dir, "import --hf '" + bck + "' --out '" + dir + "/r_bf16' --recipe fp32"), "bf16");
  const io::SafetensorsFile got = io::read_safetensors(dir + "/r_bf16/checkpoints/step-000000/model.safetensors");
  const io::SafetensorsFile src = io::read_safetensors(bck + "/model.safetensors");
  const Tensor& e_src = src.get("model.embed_tokens.weight");
  const Tensor& e_got = got.get("embed");
  for (int64_t i = 0; i < e_src.numel(); ++i)
    ASSERT_EQ(e_got.data<float>()[i], num::bf16_decode(e_src.data<uint16_t>()[i])) << i;
}

TEST(ExportCli, BadCheckpointsFailWithOneClearError) {
  const std::string dir = fresh_test_dir("hf_cli");
  int n = 0;
  // Each case: a fresh checkpoint, one defect, one error naming it.
  auto check = [&](const std::function<void(const std::string&)>& defect, const std::string& expect) {
    const std::string d = dir + "/c" + std::to_string(n++);
    fs::create_directories(d);
    const std::string ck = hf_dir(d);
    defect(ck);
    const std::string msg = expect_one_error(run_cli(d, "import --hf '" + ck + "' --out '" + d + "/run'"));
    EXPECT_HAS(msg, expect);
    EXPECT_FALSE(fs::exists(d + "/run/checkpoints")) << "a failed import left a run behind: " << msg;
  };
  check([](const std::string& ck) { fs::resize_file(ck + "/model.safetensors", fs::file_size(ck + "/model.safetensors") - 9); },
        "run past the end of the data buffer");
  check([](const std::string& ck) {
          std::fstream f(ck + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
          f.seekp(12);
          f.write("\x01\x02", 2);
        },
        "header is not valid JSON");
  check([](const std::string& ck) { fs::remove(ck + "/model.safetensors"); }, "no model.safetensors or model.safetensors.index.json");
  check([](const std::string& ck) { write_text(ck + "/config.json", "{\"model_type\": "); }, "config.json: not valid JSON");
  check([](const std::string& ck) { edit_config(ck, [](nlohmann::json& j) { j.erase("num_experts"); }); },
        "config.json: missing field 'num_experts'");
  check([](const std::string& ck) { edit_config(ck, [](nlohmann::json& j) { j["hidden_size"] = "32"; }); },
        "field 'hidden_size' must be an integer");
  check([](const std::string& ck) { edit_config(ck, [](nlohmann::json& j) { j["moe_intermediate_size"] = 16; }); },
        "tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' has shape [32, 32], config.json implies [16, 32]");
  check([](const std::string& ck) { edit_config(ck, [](nlohmann::json& j) { j["model_type"] = "mixtral"; }); },
        "unsupported architecture: model_type 'mixtral'");
  check([](const std::string& ck) { edit_config(ck, [](nlohmann::json& j) { j["use_sliding_window"] = true; }); },
        "sliding-window attention is not supported");
  check([](const std::string& ck) {
          edit_tensors(ck, [](auto& ts) { tensor_named(ts, "model.layers.2.self_attn.k_proj.bias").template data<float>()[3] = 0.5f; });
        },
        "tensor 'model.layers.2.self_attn.k_proj.bias' is not zero: non-zero q/k/v biases are not supported");
  check([](const std::string& ck) {
          edit_tensors(ck, [](auto& ts) { tensor_named(ts, "model.layers.1.mlp.shared_expert_gate.weight").template data<float>()[0] = 1.0f; });
        },
        "a non-constant shared-expert gate is not supported");
  check([](const std::string& ck) {
          edit_tensors(ck, [](auto& ts) { ts.emplace_back("model.layers.0.self_attn.o_proj.bias", Tensor::zeros({32}, DType::F32)); });
        },
        "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'");
  check([](const std::string& ck) {
          edit_tensors(ck, [](auto& ts) { std::erase_if(ts, [](const auto& kv) { return kv.first == "model.norm.weight"; }); });
        },
        "missing tensor 'model.norm.weight'");
  check([](const std::string& ck) {
          io::write_file_atomic(ck + "/model.safetensors.index.json",
                                R"({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})");
        },
        "model-00002-of-00002.safetensors");
}

TEST(ExportCli, BadArgumentsFailWithOneClearError) {
  const std::string dir = fresh_test_dir("hf_cli");
  const std::string ck = hf_dir(dir), run = dir + "/run";
  expect_ok(run_cli(dir, "import --hf '" + ck + "' --out '" + run + "' --recipe fp32"), "import");
  EXPECT_HAS(expect_one_error(run_cli(dir, "import --hf '" + ck + "' --out '" + run + "'")), "already holds a run");
  EXPECT_HAS(expect_one_error(run_cli(dir, "import --hf '" + ck + "' --out '" + dir + "/r2' --recipe fp4")),
             "unknown recipe 'fp4'");
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + run + "' --format onnx --out '" + dir + "/o'")),
             "--format: expected hf or modelopt, got 'onnx'");
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + run + "' --format hf --out '" + ck + "'")),
             "is not empty");
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + run + "' --format modelopt --out '" + dir + "/m'")),
             "has no NVFP4 or MXFP8 linear layer");
  EXPECT_HAS(expect_one_error(run_cli(dir, "score --run '" + run + "' --text abc --tokens t.npy --out s.npy")),
             "excludes");
  EXPECT_HAS(expect_one_error(run_cli(dir, "score --run '" + run + "' --text '" + std::string(40, 'x') + "' --out '" +
                                               dir + "/s.npy'")),
             "41 tokens exceed the model's max_seq_len 16");
  // A head_dim other than d_model / n_heads has no qwen2_moe form.
  std::string cfg = kConfig;
  cfg.replace(cfg.find("n_kv_heads = 1"), 14, "n_kv_heads = 1\nhead_dim = 8");
  cfg.replace(cfg.find("steps = 2"), 9, "steps = 1");
  write_text(dir + "/odd.toml", cfg);
  expect_ok(run_cli(dir, "pretrain --config '" + dir + "/odd.toml' --recipe bf16 --out '" + dir + "/odd' --device cpu"),
            "pretrain odd");
  EXPECT_HAS(expect_one_error(run_cli(dir, "export --run '" + dir + "/odd' --format hf --out '" + dir + "/o2'")),
             "model.head_dim = 8 is not d_model / n_heads = 16");
}
