// defines: tests of set_training_producer_quantizers, set_dy_decodes_only, set_weight_forms_batched,
//          Model::set_saved_x_decodes and set_moe_backward_device_offsets:
//          the experts' gathered tokens, an FFN's SwiGLU output and its dh1 and dh3 quantized where
//          they are computed, the backward's dY pairs written as their BF16 decodes alone, and the
//          forward's X^T (and the experts' X) kept as their decodes alone, and the MXFP8 weights'
//          forms made in one launch for all the weights, give the bits of the ops followed by
//          quantizer passes writing codes and decodes, a weight at a time — loss and every
//          gradient, every recipe, FFN interiors kept or recomputed, on the CPU and (when there is
//          one) the GPU; and the same record of the NVFP4 inputs' amax (Model::input_amax). The bf16
//          and mxfp8 recipes' MoE backward on the GPU's routing offsets gives the bits of the host's,
//          and so does that path run on the CPU (set_moe_device_offsets_on_cpu).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "model/model_test_util.h"
#include "test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

struct Switches {
  bool fused, decodes_only, saved_decodes;
};

// Restores the process-wide switches to what they were when the test ends, failed or not.
struct DefaultsAfter {
  const bool producers = set_training_producer_quantizers(false), decodes = set_dy_decodes_only(false);
  const bool batched = set_weight_forms_batched(false);
  ~DefaultsAfter() {
    set_training_producer_quantizers(producers);
    set_dy_decodes_only(decodes);
    set_weight_forms_batched(batched);
  }
};

struct Pass {
  ForwardStats st;
  std::vector<float> grad;
  std::map<std::string, std::vector<float>> input_amax;
};

Pass run(const ModelConfig& c, const std::string& recipe, Device dev, Switches sw, bool keep, const Tensor& tokens,
         const Tensor& targets) {
  set_training_producer_quantizers(sw.fused);
  set_dy_decodes_only(sw.decodes_only);
  set_weight_forms_batched(sw.fused);  // the MXFP8 weights' forms in one launch, or one a weight
  Model m(c, recipe_by_name(recipe), dev);
  m.set_keep_ffn_activations(keep);
  m.set_saved_x_decodes(sw.saved_decodes);
  init_params(m.params(), c, 5);
  m.params().zero_grad();
  Pass p;
  // SR streams of step 7: the recipes that round stochastically draw the same bits every time
  p.st = m.forward(tokens.to(dev), targets.to(dev), SrStreams{11, 7, 0}, true);
  m.backward();
  const Tensor g = m.params().flat_grad().to(Device::CPU);
  p.grad.assign(g.data<float>(), g.data<float>() + g.numel());
  for (const auto& [key, amax] : m.input_amax()) {
    const Tensor h = amax.to(Device::CPU);
    p.input_amax[key].assign(h.data<float>(), h.data<float>() + h.numel());
  }
  return p;
}

void expect_same(const ModelConfig& c, Device dev) {
  const DefaultsAfter restore;
  const Tensor tokens = random_tokens(2, 12, 6);
  const Tensor targets = shifted_targets(tokens, 258);
  for (const char* recipe : {"bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"})
    for (bool keep : {false, true}) {
      SCOPED_TRACE(std::string(recipe) + (keep ? ", FFN interiors kept" : ""));
      const Pass apart = run(c, recipe, dev, {false, false, false}, keep, tokens, targets);
      if (std::string(recipe) == "nvfp4-fwd") {  // the experts' and the shared expert's a among them
        const auto has = [&](const std::string& tail) {
          for (const auto& kv : apart.input_amax)
            if (kv.first.size() > tail.size() && kv.first.compare(kv.first.size() - tail.size(), tail.size(), tail) == 0)
              return true;
          return false;
        };
        EXPECT_TRUE(has(".moe.a"));
        EXPECT_TRUE(has(".moe.shared.a"));
      }
      for (const Switches sw : {Switches{true, false, false}, Switches{false, true, false}, Switches{true, true, false},
                                Switches{false, false, true}, Switches{true, true, true}}) {
        SCOPED_TRACE(std::string("fused ") + (sw.fused ? "on" : "off") + ", decodes only " +
                     (sw.decodes_only ? "on" : "off") + ", saved X^T decodes " + (sw.saved_decodes ? "on" : "off"));
        const Pass p = run(c, recipe, dev, sw, keep, tokens, targets);
        EXPECT_EQ(apart.st.loss, p.st.loss);
        EXPECT_EQ(apart.st.aux_loss, p.st.aux_loss);
        ASSERT_EQ(apart.grad.size(), p.grad.size());
        EXPECT_EQ(std::memcmp(apart.grad.data(), p.grad.data(), p.grad.size() * 4), 0) << "gradients differ";
        EXPECT_EQ(apart.input_amax, p.input_amax);
      }
    }
}

}  // namespace

TEST(GradQuantizers, SameBitsEitherWayOnTheCpu) {
  const OmpThreads threads(2);
  expect_same(tiny_moe_config(3), Device::CPU);  // three layers: nvfp4-fwd's first MoE layer is not in its tail
}

TEST(CudaGradQuantizers, SameBitsEitherWay) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = gpu_test_config();
  expect_same(c, Device::CUDA);
}

// Sets set_moe_pairs_on_device_offsets for a test's scope.
struct PairsOnDeviceOffsets {
  const bool before;
  explicit PairsOnDeviceOffsets(bool on) : before(set_moe_pairs_on_device_offsets(on)) {}
  ~PairsOnDeviceOffsets() { set_moe_pairs_on_device_offsets(before); }
};

// set_moe_device_offsets_on_cpu: the CPU runs the training MoE layers' device-offset path (the
// ops' read-back fallbacks reading the offsets tensor) with the loss and every gradient of the
// host-offset path, two micro-batches (the second accumulating), and it ran: two device-offset
// weight-gradient calls a MoE layer whose experts take it (bf16 always; with
// set_moe_pairs_on_device_offsets, mxfp8 and nvfp4-fwd's MXFP8 tail layers where the FFN
// interiors are recomputed), none elsewhere. 8 x 14 tokens, so that an expert's tokens span a
// block of 32 and a partial one.
TEST(MoeBackward, DeviceOffsetPathOnTheCpuGivesTheHostOffsetsBits) {
  const OmpThreads threads(2);
  PairsOnDeviceOffsets pairs(true);
  const ModelConfig c = tiny_moe_config(3);
  const Tensor tokens = random_tokens(8, 14, 6);
  const Tensor targets = shifted_targets(tokens, 258);
  struct Pass {
    double loss, aux;
    std::vector<float> grad;
    int64_t calls;
  };
  const auto run = [&](const std::string& recipe, bool device_path, bool keep) {
    const bool before = set_moe_device_offsets_on_cpu(device_path);
    Model m(c, recipe_by_name(recipe), Device::CPU);
    m.set_keep_ffn_activations(keep);
    init_params(m.params(), c, 5);
    m.params().zero_grad();
    const int64_t calls = ops::grouped_wgrad_device_offsets_calls();
    Pass p{};
    for (int micro = 0; micro < 2; ++micro) {
      const ForwardStats st = m.forward(tokens, targets, SrStreams{11, 7, uint64_t(micro)}, true, 0.5f);
      m.backward();
      p.loss = st.loss;
      p.aux = st.aux_loss;
    }
    p.calls = ops::grouped_wgrad_device_offsets_calls() - calls;
    const Tensor g = m.params().flat_grad();
    p.grad.assign(g.data<float>(), g.data<float>() + g.numel());
    set_moe_device_offsets_on_cpu(before);
    return p;
  };
  for (const std::string recipe : {"bf16", "mxfp8", "nvfp4-fwd"})
    for (bool keep : {false, true}) {
      SCOPED_TRACE(recipe + (keep ? ", FFN interiors kept" : ", FFN interiors recomputed"));
      int64_t layers = 0;  // MoE layers whose experts take the device-offset path
      for (int64_t l = 0; l < c.n_layers; ++l) {
        const LayerRecipe& r = recipe_by_name(recipe).layer(LayerClass::Expert, l, c.n_layers);
        const bool takes = r.fprop.a.fmt == Format::BF16 || (r.fprop.a.fmt == Format::MXFP8_E4M3 && !keep);
        layers += c.is_moe_layer(l) && takes;
      }
      if (recipe != "nvfp4-fwd") {
        EXPECT_EQ(layers, recipe == "bf16" || !keep ? 2 : 0);
      } else {
        EXPECT_EQ(layers, keep ? 0 : 1);  // its last MoE layer is in its MXFP8 tail
      }
      const Pass host = run(recipe, false, keep), dev = run(recipe, true, keep);
      EXPECT_EQ(host.calls, 0);
      EXPECT_EQ(dev.calls, 2 * 2 * layers) << "the MoE layers did not take the device-offset path";
      EXPECT_EQ(host.loss, dev.loss);
      EXPECT_EQ(host.aux, dev.aux);
      ASSERT_EQ(host.grad.size(), dev.grad.size());
      EXPECT_EQ(std::memcmp(host.grad.data(), dev.grad.data(), dev.grad.size() * 4), 0) << "gradients differ";
    }
  // without set_moe_pairs_on_device_offsets the mxfp8 experts keep the host's offsets
  set_moe_pairs_on_device_offsets(false);
  EXPECT_EQ(run("mxfp8", true, false).calls, 0);
}

// set_moe_backward_device_offsets: the MoE backward with its experts' GEMMs on the routing's
// offsets where the GPU made them gives the loss and every gradient of the host's offsets, a fresh
// gradient and an accumulated one (the second micro-batch of a step), and it ran (two
// device-offset weight-gradient calls a MoE layer, no counts read back): the bf16 recipe (dense
// BF16 operands read in place), FFN interiors kept or recomputed, and the mxfp8 recipe (its pairs
// made on the device offsets, the weight gradients reading their Col forms' decodes in the rows'
// layout, set_moe_pairs_on_device_offsets; FFN interiors recomputed). 8 x 14 tokens: each
// expert's ~56 slots span a block of 32 tokens and a partial one, so the Col forms' blocks start
// at each expert's first row.
TEST(CudaMoeBackward, DeviceOffsetsGiveTheHostOffsetsBits) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
#if FOURBIT_HAS_CUDA
  PairsOnDeviceOffsets pairs(true);
  const ModelConfig c = gpu_test_config();
  const Tensor tokens = random_tokens(8, 14, 6).to(Device::CUDA);
  const Tensor targets = shifted_targets(random_tokens(8, 14, 6), 258).to(Device::CUDA);
  const bool before = set_moe_backward_device_offsets(false);
  struct Pass {
    double loss, aux;
    int64_t tokens;
    std::vector<float> grad;
    int64_t device_calls, read_backs;
  };
  const auto run = [&](const char* recipe, bool on_gpu_offsets, bool keep) {
    set_moe_backward_device_offsets(on_gpu_offsets);
    Model m(c, recipe_by_name(recipe), Device::CUDA);
    m.set_keep_ffn_activations(keep);
    init_params(m.params(), c, 5);
    m.params().zero_grad();
    const int64_t calls = ops::cuda::grouped_wgrad_device_calls(), reads = ops::cuda::route_plan_read_backs();
    Pass p{};
    for (int micro = 0; micro < 2; ++micro) {  // the second accumulates onto the first's gradients
      // the trainer's order: the backward queued before the stats are read
      PendingForwardStats pending = m.forward_queued(tokens, targets, SrStreams{11, 7, uint64_t(micro)}, true, 0.5f);
      m.backward();
      const ForwardStats& st = pending.stats();
      p.loss = st.loss;
      p.aux = st.aux_loss;
      p.tokens = st.tokens;
    }
    const Tensor g = m.params().flat_grad().to(Device::CPU);
    p.grad.assign(g.data<float>(), g.data<float>() + g.numel());
    p.device_calls = ops::cuda::grouped_wgrad_device_calls() - calls;
    p.read_backs = ops::cuda::route_plan_read_backs() - reads;
    return p;
  };
  const int64_t moe_layers = c.n_layers - c.dense_layers;
  struct Case {
    const char* recipe;
    bool keep;
  };
  for (const Case k : {Case{"bf16", false}, Case{"bf16", true}, Case{"mxfp8", false}}) {
    SCOPED_TRACE(std::string(k.recipe) + (k.keep ? ", FFN interiors kept" : ", FFN interiors recomputed"));
    const Pass host = run(k.recipe, false, k.keep), dev = run(k.recipe, true, k.keep);
    EXPECT_EQ(host.device_calls, 0);
    EXPECT_EQ(dev.device_calls, 2 * 2 * moe_layers) << "the backward did not take the device offsets";
    EXPECT_EQ(host.read_backs, 2 * moe_layers);
    EXPECT_EQ(dev.read_backs, 0) << "a MoE layer read its counts back";
    EXPECT_EQ(host.loss, dev.loss);
    EXPECT_GT(dev.aux, 0.0);
    EXPECT_EQ(host.aux, dev.aux);
    EXPECT_EQ(host.tokens, dev.tokens);
    ASSERT_EQ(host.grad.size(), dev.grad.size());
    size_t differ = 0, first = 0;
    for (size_t i = 0; i < dev.grad.size(); ++i)
      if (std::memcmp(&host.grad[i], &dev.grad[i], 4) != 0 && differ++ == 0) first = i;
    EXPECT_EQ(differ, 0u) << "gradients differ, the first at " << first << ": " << host.grad[first] << " on the host's "
                          << "offsets, " << dev.grad[first] << " on the device's";
  }
  set_moe_backward_device_offsets(before);
#endif
}

// A training forward on the GPU checks its indices once it is queued: a bad token id (or target)
// leaves forward_queued and the backward queued without a failure, and stats() fails with the
// op's own message before anything reads the gradients; the record is clear afterwards, so the
// next micro-batch runs. The same with the MoE layers reading their counts back (the host's
// offsets), whose first read-back reports it.
TEST(CudaMoeBackward, TrainingForwardReportsABadTokenAtItsStats) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = tiny_moe_config(3, 64);
  Tensor bad = random_tokens(2, 12, 6);
  bad.data<int32_t>()[5] = int32_t(c.vocab_size) + 3;
  const Tensor good = random_tokens(2, 12, 6).to(Device::CUDA);
  const Tensor targets = shifted_targets(random_tokens(2, 12, 6), 258).to(Device::CUDA);
  const std::string message = "embedding_forward: tokens[5] = 263 is outside [0, V=260)";
  for (bool device_offsets : {true, false}) {
    SCOPED_TRACE(device_offsets ? "device offsets" : "host offsets");
    const bool before = set_moe_backward_device_offsets(device_offsets);
    Model m(c, recipe_by_name("bf16"), Device::CUDA);
    init_params(m.params(), c, 5);
    m.params().zero_grad();
    try {
      PendingForwardStats pending = m.forward_queued(bad.to(Device::CUDA), targets, SrStreams{11, 7, 0}, true, 1.0f);
      if (!device_offsets) ADD_FAILURE() << "the first MoE layer's read-back did not report the token";
      m.backward();
      pending.stats();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    PendingForwardStats next = m.forward_queued(good, targets, SrStreams{11, 7, 1}, true, 1.0f);
    m.backward();
    EXPECT_TRUE(std::isfinite(next.stats().loss));
    set_moe_backward_device_offsets(before);
  }
}

// With the device-offset backward (the default, set here; for mxfp8 with its pairs on the device
// offsets) a bf16 or mxfp8 micro-batch's forward and backward read nothing back, so they record
// into one CUDA graph: a replay gives the eager run's loss, aux loss, token count and every
// gradient bit for bit, twice (the replay stores the gradients as the captured backward did, after
// zero_grad).
TEST(CudaMoeBackward, MicroBatchRecordsAsOneCudaGraph) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  PairsOnDeviceOffsets pairs(true);  // the mxfp8 experts' pairs too
  const ModelConfig c = gpu_test_config();
  const bool before = set_moe_backward_device_offsets(true);
  const Tensor tokens = random_tokens(2, 12, 6).to(Device::CUDA);
  const Tensor targets = shifted_targets(random_tokens(2, 12, 6), 258).to(Device::CUDA);
  for (const char* recipe : {"bf16", "mxfp8"}) {
    SCOPED_TRACE(recipe);
    Model m(c, recipe_by_name(recipe), Device::CUDA);
    ASSERT_TRUE(m.training_step_capturable());
    init_params(m.params(), c, 5);
    const SrStreams sr{11, 7, 0};
    m.params().zero_grad();
    PendingForwardStats eager = m.forward_queued(tokens, targets, sr, true, 0.5f);
    m.backward();
    const ForwardStats want = eager.stats();
    const Tensor want_grad = m.params().flat_grad().to(Device::CPU);
    std::unique_ptr<DeviceGraph> graph;
    std::optional<PendingForwardStats> captured;
    m.params().zero_grad();
    {
      GraphCapture capture;
      captured.emplace(m.forward_queued(tokens, targets, sr, true, 0.5f));
      m.backward();
      graph = capture.finish(captured->captured_tensors());
    }
    for (int replay = 0; replay < 2; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      Tensor grads = m.params().flat_grad();
      ops::fill_(grads, 7.0);  // the replay must write every gradient
      graph->replay();
      ops::check_index_errors(Device::CUDA);
      PendingForwardStats again = captured->after_replay();  // the replay's buffers, read behind it
      const ForwardStats& got = again.stats();
      EXPECT_EQ(got.loss, want.loss);
      EXPECT_EQ(got.aux_loss, want.aux_loss);
      EXPECT_EQ(got.tokens, want.tokens);
      const Tensor g = m.params().flat_grad().to(Device::CPU);
      ASSERT_EQ(g.numel(), want_grad.numel());
      EXPECT_EQ(std::memcmp(g.raw(), want_grad.raw(), size_t(g.nbytes())), 0) << "gradients differ";
    }
    EXPECT_HAS(testutil::error_of([&] { (void)eager.after_replay(); }),
               "not the stats of a forward queued while a CUDA graph");
  }
  set_moe_backward_device_offsets(before);
}
