// defines: the DataParallel tests: two ranks, each running the real model's forward and backward
// on its own batch, with the flat gradient buffer all-reduced in buckets, equal one process that
// accumulates the same two batches as micro-batches: bit for bit for every parameter whose
// gradient takes one addition per micro-batch (every GEMM weight gradient: attention, routed and
// shared experts, router, dense FFN), and within float rounding for those the one process adds
// up row by row across both batches (the tied embedding, the RMSNorm gains). A trainer that wants
// those bitwise too forms each micro-batch's gradient in a zeroed buffer and adds it
// (docs/distributed.md "Equivalence").
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fourbit/dist/grad_reduce.h"
#include "fourbit/dist/local_group.h"
#include "fourbit/model/model.h"
#include "model/model_test_util.h"

using namespace fourbit;

namespace {

TEST(DataParallel, TwoRanksEqualOneProcessWithTwoMicroBatches) {
  modeltest::OmpThreads one_thread(1);  // two ranks share the test's cores
  const ModelConfig cfg = modeltest::tiny_moe_config(2, 32);
  const Recipe& recipe = recipe_by_name("nvfp4-fwd");
  const uint64_t seed = 77;
  std::vector<Tensor> tokens, targets;
  for (int m = 0; m < 2; ++m) {
    tokens.push_back(modeltest::random_tokens(2, 16, 500 + uint64_t(m)));
    targets.push_back(modeltest::shifted_targets(tokens.back(), 10));
  }
  auto fresh_model = [&] {
    auto m = std::make_unique<Model>(cfg, recipe, Device::CPU);
    init_params(m->params(), cfg, seed);
    m->params().zero_grad();
    return m;
  };
  // one process: micro-batches 0 and 1 of step 3, each weighted 1/2
  auto ref = fresh_model();
  for (int m = 0; m < 2; ++m) {
    ref->forward(tokens[size_t(m)], targets[size_t(m)], SrStreams{seed, 3, uint64_t(m)}, true, 0.5f);
    ref->backward();
  }
  // two ranks: rank r runs micro-batch r; buckets are reduced as the backward marks them
  std::vector<Tensor> grads(2);
  dist::LocalGroup::run(2, [&](dist::Communicator& comm) {
    modeltest::OmpThreads t(1);
    const int r = comm.rank();
    auto model = fresh_model();
    model->forward(tokens[size_t(r)], targets[size_t(r)], SrStreams{seed, 3, uint64_t(r)}, true, 0.5f);
    model->backward();
    dist::GradientReducer red(comm, model->params().flat_grad(), 4 * 1000);
    const auto& infos = model->params().infos();
    for (auto it = infos.rbegin(); it != infos.rend(); ++it) red.mark_ready(it->offset, it->offset + it->numel());
    red.finish();
    grads[size_t(r)] = model->params().flat_grad().clone();
  });
  ASSERT_EQ(std::memcmp(grads[0].raw(), grads[1].raw(), size_t(grads[0].nbytes())), 0) << "ranks disagree";
  const Tensor& want = ref->params().flat_grad();
  int bitwise = 0;
  for (const ParamInfo& p : ref->params().infos()) {
    const float* a = grads[0].data<float>() + p.offset;
    const float* b = want.data<float>() + p.offset;
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < p.numel(); ++i) {
      max_ref = std::max(max_ref, double(std::fabs(b[i])));
      max_diff = std::max(max_diff, std::fabs(double(a[i]) - double(b[i])));
    }
    const bool same = std::memcmp(a, b, size_t(p.numel()) * 4) == 0;
    bitwise += same ? 1 : 0;
    const bool row_sums = p.name == "embed" || p.name.ends_with("norm");
    if (row_sums) {
      EXPECT_LE(max_diff, 1e-6 * max_ref) << p.name;  // summation order only
    } else {
      EXPECT_TRUE(same) << p.name << ": max |diff| " << max_diff << " of max |grad| " << max_ref;
    }
  }
  EXPECT_GT(bitwise, 10);
}

}  // namespace
