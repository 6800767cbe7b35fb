// defines: the Qwen2Moe tests (library level): the config.json mapping both ways and its refusals,
//          the tensor map, Model::forward_weight against the weights forward() actually used, the
//          recorded input amax (values, which inputs, not in eval forwards, JSON round trip),
//          effective weights, a qwen2_moe directory written from a model reading back to the same
//          parameters bit for bit, and the input amax surviving a resume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>

#include "fourbit/hf/effective.h"
#include "fourbit/hf/export.h"
#include "fourbit/hf/import.h"
#include "fourbit/hf/qwen2_moe.h"
#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/trainer.h"
#include "model/model_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using fourbit::testutil::error_of;
namespace fs = std::filesystem;

namespace {

// 3 layers: layer 0 dense, 1 MoE (NVFP4 experts under nvfp4-fwd), 2 MoE in the MXFP8 tail.
ModelConfig three_layer_config() {
  ModelConfig c = tiny_moe_config(3, 32);
  c.max_seq_len = 16;
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.shape() == hb.shape() && ha.dtype() == hb.dtype() &&
         std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
}

bool same_prepared(const Prepared& a, const Prepared& b) {
  if (a.is_quantized() != b.is_quantized()) return false;
  if (!a.is_quantized()) return a.trans == b.trans && same_bits(a.dense, b.dense);
  if (a.q.fmt != b.q.fmt || a.q.outer != b.q.outer || a.q.slices != b.q.slices || a.q.rows != b.q.rows ||
      a.q.cols != b.q.cols)
    return false;
  return same_bits(a.q.codes, b.q.codes) && same_bits(a.q.block_scales, b.q.block_scales) &&
         (!a.q.outer_scales.defined() || same_bits(a.q.outer_scales, b.q.outer_scales));
}

std::unique_ptr<Model> seeded_model(const ModelConfig& c, const std::string& recipe, uint64_t seed = 11) {
  auto m = std::make_unique<Model>(c, recipe_by_name(recipe), Device::CPU);
  init_params(m->params(), c, seed);
  return m;
}

}  // namespace

TEST(Qwen2Moe, ConfigRoundTrips) {
  OmpThreads one(1);
  for (const bool tied : {true, false})
    for (const int64_t dense : {0, 1}) {
      ModelConfig c = three_layer_config();
      c.tie_embeddings = tied;
      c.dense_layers = dense;
      c.rope_theta = 5e5;
      c.norm_eps = 1e-6;
      c.aux_loss_coef = 0.02;
      c.d_shared = c.d_expert;  // the importer names the shared width explicitly
      const nlohmann::json j = hf::qwen2_moe_config(c, "float32");
      EXPECT_EQ(j["model_type"], "qwen2_moe");
      EXPECT_EQ(j["norm_topk_prob"], true);
      EXPECT_EQ(j["mlp_only_layers"].size(), size_t(dense));
      const ModelConfig b = hf::model_config_from_qwen2_moe(j, "config.json");
      RunConfig rb, rc;
      rb.model = b;
      rc.model = c;
      EXPECT_EQ(config_to_json(rb)["model"], config_to_json(rc)["model"]) << "tied " << tied << " dense " << dense;
    }
}

TEST(Qwen2Moe, ConfigRefusesWhatFourbitCannotCompute) {
  const nlohmann::json good = hf::qwen2_moe_config(three_layer_config(), "float32");
  const struct {
    std::function<void(nlohmann::json&)> edit;
    const char* expect;
  } cases[] = {
      {[](nlohmann::json& j) { j["model_type"] = "llama"; }, "unsupported architecture: model_type 'llama'"},
      {[](nlohmann::json& j) { j.erase("model_type"); }, "unsupported architecture"},
      {[](nlohmann::json& j) { j["use_sliding_window"] = true; }, "sliding-window attention is not supported"},
      {[](nlohmann::json& j) { j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"}; },
       "layer_types[1]"},
      {[](nlohmann::json& j) { j["rope_scaling"] = {{"type", "yarn"}}; }, "rope_scaling"},
      {[](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "llama3"; }, "rope_type 'llama3'"},
      {[](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "hidden_act 'gelu'"},
      {[](nlohmann::json& j) { j["norm_topk_prob"] = false; }, "norm_topk_prob is false"},
      {[](nlohmann::json& j) { j["mlp_only_layers"] = {2}; }, "layer 2 is dense but layer 0 before it is MoE"},
      {[](nlohmann::json& j) { j["decoder_sparse_step"] = 2; }, "dense layers must be the first ones"},
      {[](nlohmann::json& j) { j["head_dim"] = 8; }, "head_dim (8) differs"},
      {[](nlohmann::json& j) { j.erase("hidden_size"); }, "missing field 'hidden_size'"},
      {[](nlohmann::json& j) { j["num_experts"] = "4"; }, "field 'num_experts' must be an integer"},
      {[](nlohmann::json& j) { j["num_experts_per_tok"] = 9; }, "top_k (9) cannot exceed"},
      {[](nlohmann::json& j) {
         j.erase("rope_theta");
         j.erase("rope_parameters");
       },
       "missing field 'rope_theta'"},
  };
  for (const auto& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    const std::string msg = error_of([&] { hf::model_config_from_qwen2_moe(j, "dir/config.json"); });
    EXPECT_HAS(msg, c.expect);
    EXPECT_HAS(msg, "dir/config.json");
  }
  ModelConfig odd = three_layer_config();
  odd.head_dim = 8;  // d_model / n_heads = 16
  EXPECT_HAS(error_of([&] { hf::qwen2_moe_config(odd, "float32"); }), "model.head_dim = 8 is not d_model / n_heads = 16");
}

TEST(Qwen2Moe, TensorMapNamesEveryWeightOnce) {
  ModelConfig c = three_layer_config();
  const std::vector<hf::HfTensor> map = hf::hf_tensor_map(c);
  std::set<std::string> names, params;
  for (const auto& t : map) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    if (!t.param.empty()) params.insert(t.param);
  }
  for (const ParamInfo& p : build_param_layout(c)) EXPECT_TRUE(params.count(p.name)) << p.name << " is not exported";
  // embed, final norm; per layer 2 norms + q/k/v (+ biases) + o; dense 3; MoE router + 4x3 experts + 3 shared + gate
  EXPECT_EQ(map.size(), size_t(2 + 3 * 9 + 3 + 2 * (1 + 12 + 3 + 1)));
  for (const auto& t : map) {
    if (t.name == "model.layers.1.mlp.shared_expert.down_proj.weight") {
      EXPECT_EQ(t.factor, 2.0f);
    }
  }
  c.n_shared_experts = 0;  // qwen2_moe has a shared expert in every MoE layer: all zeros then
  for (const auto& t : hf::hf_tensor_map(c)) {
    if (t.name.find("shared_expert") != std::string::npos) {
      EXPECT_TRUE(t.param.empty()) << t.name;
    }
  }
}

// forward_weight must be the operand forward() multiplies by: after a forward, every fprop weight
// in the cache equals a fresh model's forward_weight, and every cached fprop weight is a linear's.
TEST(Qwen2Moe, ForwardWeightIsWhatForwardUses) {
  OmpThreads one(1);
  const ModelConfig c = three_layer_config();
  for (const char* recipe : {"nvfp4-fwd", "mxfp8", "bf16", "nvidia-nvfp4", "fp32"}) {
    auto a = seeded_model(c, recipe), b = seeded_model(c, recipe);
    const Tensor tokens = random_tokens(2, 8, 3);
    a->forward(tokens, shifted_targets(tokens, -1), SrStreams{1, 0, 0}, false);
    std::set<std::string> linears;
    for (const LinearInfo& li : b->linears()) {
      linears.insert(li.name);
      auto it = a->weight_cache().find(li.name + "/fprop");
      ASSERT_NE(it, a->weight_cache().end()) << recipe << ": forward did not prepare " << li.name;
      EXPECT_TRUE(same_prepared(it->second, b->forward_weight(li.name))) << recipe << " " << li.name;
    }
    for (const auto& [key, p] : a->weight_cache()) {
      if (key.ends_with("/fprop")) {
        EXPECT_TRUE(linears.count(key.substr(0, key.size() - 6))) << recipe << ": forward uses " << key;
      }
    }
  }
}

TEST(Qwen2Moe, InputAmaxRecordsNvfp4InputsInTrainingForwardsOnly) {
  OmpThreads one(1);
  const ModelConfig c = three_layer_config();
  const Tensor tokens = random_tokens(2, 8, 5);
  const Tensor targets = shifted_targets(tokens, -1);
  {
    auto m = seeded_model(c, "nvfp4-fwd");
    m->forward(tokens, targets, SrStreams{1, 0, 0}, false);
    EXPECT_TRUE(m->input_amax().empty()) << "an eval forward records nothing";
    m->forward(tokens, targets, SrStreams{1, 0, 0}, true);
    std::set<std::string> keys;
    for (const auto& [k, t] : m->input_amax()) keys.insert(k);
    // Layer 1's experts and shared expert run NVFP4; layer 2 is the MXFP8 tail, layer 0 dense MXFP8.
    EXPECT_EQ(keys, (std::set<std::string>{"layers.1.moe.x", "layers.1.moe.a", "layers.1.moe.shared.x",
                                           "layers.1.moe.shared.a"}));
    EXPECT_EQ(m->input_amax().at("layers.1.moe.x").numel(), c.n_experts);
    const std::vector<double> x = host_doubles(m->input_amax().at("layers.1.moe.x"));
    const double shared_x = host_doubles(m->input_amax().at("layers.1.moe.shared.x"))[0];
    double mx = 0;
    for (double v : x) {
      EXPECT_TRUE(std::isfinite(v) && v >= 0);
      mx = std::max(mx, v);
    }
    EXPECT_EQ(mx, shared_x) << "the routed experts together see every token the shared expert sees";
    const nlohmann::json j = m->input_amax_json();
    auto b = seeded_model(c, "nvfp4-fwd");
    b->load_input_amax(j);
    EXPECT_EQ(b->input_amax_json(), j);
    EXPECT_HAS(error_of([&] { b->load_input_amax({{"layers.1.moe.x", {1.0}}}); }), "'layers.1.moe.x' must hold 4 numbers");
    EXPECT_EQ(Model::input_amax_key("layers.1.moe.w3"), "layers.1.moe.x");
    EXPECT_EQ(Model::input_amax_key("layers.1.moe.shared.w2"), "layers.1.moe.shared.a");
    EXPECT_EQ(Model::input_amax_key("layers.0.attn.wo"), "layers.0.attn.o");
    EXPECT_EQ(Model::input_amax_key("layers.1.moe.router"), "");
  }
  {
    auto m = seeded_model(c, "mxfp8");
    m->forward(tokens, targets, SrStreams{1, 0, 0}, true);
    EXPECT_TRUE(m->input_amax().empty()) << "MXFP8 inputs have no static scale to record";
  }
  {
    // nvidia-nvfp4 quantizes layer 0's attention input to NVFP4: its amax is max |rmsnorm(embed)|.
    auto m = seeded_model(c, "nvidia-nvfp4");
    m->forward(tokens, targets, SrStreams{1, 0, 0}, true);
    const ModelWeights w = m->params().weights();
    Tensor x = Tensor::empty({16, c.d_model}, DType::F32), xn = Tensor::empty({16, c.d_model}, DType::F32),
           rstd = Tensor::empty({16}, DType::F32);
    ops::embedding_forward(tokens.reshape({16}), w.embed, x);
    ops::rmsnorm_forward(x, w.layers[0].attn_norm, float(c.norm_eps), xn, rstd);
    float want = 0;
    for (int64_t i = 0; i < xn.numel(); ++i) want = std::max(want, std::fabs(xn.data<float>()[i]));
    EXPECT_EQ(float(host_doubles(m->input_amax().at("layers.0.attn.x"))[0]), want);
  }
}

TEST(Qwen2Moe, EffectiveWeightsAreTheDequantizedForwardWeights) {
  OmpThreads one(1);
  const ModelConfig c = three_layer_config();
  auto m = seeded_model(c, "nvfp4-fwd");
  const hf::EffectiveWeights w = hf::effective_weights(*m);
  EXPECT_TRUE(w.tied_in_run);
  EXPECT_FALSE(w.config.tie_embeddings) << "a BF16 head over an F32 embedding is its own tensor";
  EXPECT_TRUE(same_bits(w.params.at("layers.1.moe.w1"), ops::dequantize(m->forward_weight("layers.1.moe.w1").q)));
  EXPECT_FALSE(same_bits(w.params.at("layers.1.moe.w1"), m->params().view(m->params().flat(), m->params().info("layers.1.moe.w1"))));
  auto f = seeded_model(c, "fp32");
  const hf::EffectiveWeights wf = hf::effective_weights(*f);
  EXPECT_TRUE(wf.config.tie_embeddings);
  for (const ParamInfo& p : f->params().infos())
    EXPECT_TRUE(same_bits(wf.params.at(p.name), f->params().view(f->params().flat(), p))) << p.name;
}

// A qwen2_moe directory written from effective weights reads back to the same parameters, bit
// for bit (the shared expert's doubled down projection halved again), and a model without a
// shared expert comes back without one.
TEST(Qwen2Moe, WrittenDirectoryReadsBackBitForBit) {
  OmpThreads one(1);
  for (const int64_t shared : {1, 0}) {
    ModelConfig c = three_layer_config();
    c.n_shared_experts = shared;
    auto m = seeded_model(c, "nvfp4-fwd");
    const hf::EffectiveWeights w = hf::effective_weights(*m);
    ModelConfig out_cfg;
    const auto tensors = hf::hf_tensors(w, DType::F32, &out_cfg);
    const std::string dir = fresh_test_dir("hf") + "/ck";
    fs::create_directories(dir);
    io::write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
    io::write_file_atomic(dir + "/config.json", hf::qwen2_moe_config(out_cfg, "float32").dump());
    const hf::HfCheckpoint ck = hf::read_qwen2_moe(dir);
    EXPECT_EQ(ck.config.n_shared_experts, shared);
    EXPECT_EQ(ck.config.tie_embeddings, false);
    EXPECT_EQ(ck.params.size(), w.params.size());
    for (const auto& [name, t] : w.params) EXPECT_TRUE(same_bits(ck.params.at(name), t)) << name;
  }
}

// The recorded input amax is part of the checkpoint: a run resumed at step 1 ends step 2 with the
// same statistics as a run that never stopped, and they grow only in training forwards.
TEST(Qwen2Moe, InputAmaxSurvivesResume) {
  OmpThreads one(1);
  const std::string dir = fresh_test_dir("hf");
  RunConfig cfg = tiny_run_config(3, 32);
  cfg.model.d_expert = 32;
  cfg.train.steps = 2;
  cfg.train.eval_every = 0;
  cfg.train.checkpoint_every = 1;
  PretrainOptions a;
  a.config = cfg;
  a.recipe = "nvfp4-fwd";
  a.out_dir = dir + "/straight";
  a.quiet = true;
  pretrain(a);
  PretrainOptions b = a;
  b.out_dir = dir + "/resumed";
  b.steps = 1;
  pretrain(b);
  b.steps = 2;
  b.resume = true;
  pretrain(b);
  auto amax_at = [](const std::string& run, int step) {
    return read_checkpoint_state(run + "/checkpoints/step-00000" + std::to_string(step)).extra.at("input_amax");
  };
  const nlohmann::json s1 = amax_at(a.out_dir, 1), s2 = amax_at(a.out_dir, 2);
  EXPECT_FALSE(s2.empty());
  EXPECT_EQ(amax_at(b.out_dir, 1), s1);
  EXPECT_EQ(amax_at(b.out_dir, 2), s2);
  for (const auto& [key, v] : s2.items())
    for (size_t i = 0; i < v.size(); ++i) EXPECT_GE(v[i].get<double>(), s1.at(key)[i].get<double>()) << key;
}
