// defines: tiny_moe_config, gpu_test_config, tiny_run_config, random_tokens, shifted_targets,
//          host_doubles, fresh_test_dir, file_bytes, OmpThreads (helpers for tests/model,
//          tests/train and tests/tools)
// The small models these tests train and differentiate: every code path of the model (dense FFN
// layer, MoE layer with a shared expert, grouped-query attention) at sizes that run in
// milliseconds on two cores.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::modeltest {

// 2 heads over 1 KV head (GQA), the first layer dense, the rest MoE with 4 experts, top-2 and a
// shared expert. d_model and d_expert are multiples of 32, so NVFP4 and MXFP8 blocks fill rows.
inline ModelConfig tiny_moe_config(int64_t n_layers = 2, int64_t d_model = 32) {
  ModelConfig c;
  c.vocab_size = 260;
  c.d_model = d_model;
  c.n_layers = n_layers;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.max_seq_len = 16;
  c.n_experts = 4;
  c.top_k = 2;
  c.d_expert = 32;
  c.n_shared_experts = 1;
  c.dense_layers = 1;
  c.d_dense = 64;
  return c;
}

// The GPU tests' model: tiny_moe_config(3, 64) with d_expert 96 (and the shared expert's and
// dense FFN's hidden sizes not multiples of 128), so the SwiGLU pass's half tiles of 128 columns
// are cut short.
inline ModelConfig gpu_test_config() {
  ModelConfig c = tiny_moe_config(3, 64);
  c.d_expert = 96;
  c.d_shared = 96;
  c.d_dense = 160;
  return c;
}

// A run of a few steps on the synthetic corpus: batch 2 x 16 tokens.
inline RunConfig tiny_run_config(int64_t n_layers = 4, int64_t d_model = 64) {
  RunConfig r;
  r.model = tiny_moe_config(n_layers, d_model);
  r.model.d_expert = 64;
  r.path = "<test>";
  TrainConfig& t = r.train;
  t.batch_size = 2;
  t.seq_len = 16;
  t.grad_accum = 1;
  t.steps = 6;
  t.lr = 3e-3;
  t.warmup_steps = 2;
  t.eval_every = 3;
  t.eval_batches = 1;
  t.checkpoint_every = 0;
  t.log_every = 1;
  t.seed = 1234;
  return r;
}

// I32 [B, T] of ids in [0, vocab).
inline Tensor random_tokens(int64_t B, int64_t T, uint64_t seed, int32_t vocab = 256) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> u(0, vocab - 1);
  std::vector<int32_t> v(size_t(B * T));
  for (auto& x : v) x = u(rng);
  return Tensor::from_host(v.data(), {B, T}, DType::I32);
}

// The next token of each row as its target; the last position of each row gets `last`.
inline Tensor shifted_targets(const Tensor& tokens, int32_t last) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  std::vector<int32_t> v(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      v[size_t(b * T + t)] = t + 1 < T ? tokens.data<int32_t>()[b * T + t + 1] : last;
  return Tensor::from_host(v.data(), {B, T}, DType::I32);
}

inline std::vector<double> host_doubles(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  std::vector<double> out(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i)
    out[size_t(i)] = h.dtype() == DType::F64 ? h.data<double>()[i] : double(h.data<float>()[i]);
  return out;
}

// A fresh, empty directory for the running test under FOURBIT_TEST_DATA_DIR/group (the tests
// may run as parallel processes, so each test has its own).
inline std::string fresh_test_dir(const std::string& group) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(FOURBIT_TEST_DATA_DIR) / group /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Runs the ops of a scope on n OpenMP threads. These models are so small that a parallel region
// costs more than its work, and on a shared, oversubscribed machine two spinning threads make a
// test 100x slower; results do not depend on the thread count (batch_invariance_test checks it).
class OmpThreads {
 public:
  explicit OmpThreads(int n) : prev_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(prev_); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int prev_;
};

inline std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace fourbit::modeltest
