// defines: the train_bench benchmark (main)
// Training-step throughput per recipe: tokens/s, model-FLOPs utilisation, step time relative to
// the bf16 recipe measured in the same process, and the activation bytes kept for backward.
// Usage: train_bench [--config configs/tiny.toml] [--device cpu|cuda] [--recipes a,b,c]
//                    [--warmup 2] [--steps 5] [--expert-gemms V[,V...]|all]
//                    [--keep-ffn off|on|both] [--forward-gemms grouped|gemm|both]
//                    [--grad-quant V[,V...]] [--weight-amax optimizer|pass|both]
//                    [--saved-x decodes|codes|both] [--weight-forms batched|each|both]
//                    [--loss-read queued|first|both] [--router-wgrad kernels|cublas|both]
//                    [--tma-tile V[,V...]] [--moe-backward V[,V...]] [--graph V[,V...]]
//                    [--set section.key=value]... [--json FILE]
// --set: a config field changed as fourbit pretrain's --set does (train.grad_accum=2 with
// train.batch_size=4 runs gpu-small's 8192 tokens a step as two micro-batches); the JSON's meta
// lists them.
// --expert-gemms (CUDA): the expert GEMMs through the grouped kernel with block-scaled operands
// dequantized inside it (grouped, the default; grouped-lanes-dgrad: with the bf16 recipe's expert
// dgrad, a transposed weight, on cuBLASLt an expert at a time), the grouped kernel after a decode
// pass to BF16 copies and before a scale epilogue (decode-path), one cuBLASLt GEMM per expert
// (per-expert); several (comma-separated, repeats allowed), or all (per-expert, decode-path,
// grouped), run each recipe under each in this process. --keep-ffn: the FFN interiors recomputed in backward (off, the
// default) or kept from the forward (on: Model::set_keep_ffn_activations, the same bits), or both.
// --forward-gemms: the linear layers' forward GEMMs (attention, shared expert, dense FFN, LM head)
// on the grouped kernel family (grouped, the default: forward_gemm) or on ops::gemm's cuBLASLt
// (gemm, the path before it), or both, each recipe run under each in this process.
// --grad-quant: how a step makes its MXFP8 operands: fused (the ops that produce them quantize
// what they compute, and the dY pairs are written as their BF16 decodes alone:
// set_training_producer_quantizers, set_dy_decodes_only; the shipped default, what a step runs
// without the flag), decodes (the decodes alone, each quantizer a pass of its own) or apart
// (neither: the dY pairs' codes written too); several (comma-separated, repeats allowed) run each
// recipe under each in this process.
// --weight-amax: the NVFP4 weights' outer-scale amax raised by the optimizer in its update
// (optimizer, the default, as the trainer does: Optimizer::write_slice_amax) or by a pass of the
// quantizers over the weights (pass), or both, each recipe run under each in this process.
// --saved-x: what a training forward keeps of the MXFP8 X^T it makes with X (train.saved_x_decodes):
// their BF16 decodes alone (decodes, the default), or their codes (codes), decoded before the
// weight-gradient GEMMs, or both, each recipe run under each in this process.
// --weight-forms: the MXFP8 weights' fprop and dgrad operands made in one launch for all the
// weights (batched, the default: set_weight_forms_batched) or a launch a weight (each), or both,
// each recipe run under each in this process.
// --loss-read: when the host reads a micro-batch's loss back: after its backward is queued
// (queued, the default, as the trainer does: Model::forward_queued) or before (first:
// Model::forward, so the GPU idles from the forward's end until the host has queued the
// backward's first kernels), or both, each recipe run under each in this process.
// --router-wgrad (CUDA): the router's FP32 weight gradient on skinny_gemm.cu's chunked kernels,
// its input made where they read it (kernels, the default: cuda::set_skinny_wgrad), or on
// cuBLASLt after a norm pass that makes its input (cublas, the path before them), or both, each
// recipe run under each in this process.
// --tma-tile (CUDA): the grouped kernel's TMA forms as shipped (pingpong, the default: the
// row-grouped form's ping-pong 128 x 128 tiles, taken by two warpgroups in turn, where K <= 4096,
// cuda::set_grouped_tma_pingpong; the weight gradients on 128 x 256 tiles of two m64n256k16
// warpgroups), the ping-pong tiles but for the bf16 recipe's dgrads (MN-major B), which take 128 x
// 256 (pingpong-fwd: set_grouped_tma_pingpong_mn_major), the ping-pong tiles in the weight
// gradients too (pingpong-all: set_grouped_wgrad_tma_pingpong), 128 x 256 tiles in both forms
// (256), 256 x 128 tiles of four m64n128k16 warpgroups in both (128: set_grouped_tma_tile,
// set_grouped_wgrad_tma_tile), or the 256 x 128 tile in the row-grouped form only (128-rows:
// forward and dgrad) or the K-grouped one only (128-wgrad), the other on 128 x 256; the same bits.
// Several (comma-separated, repeats allowed) run each recipe under each in this process.
// --moe-backward (CUDA): the bf16 recipe's MoE backward with its experts' GEMMs on the offsets
// where the GPU made them, its forward then reading no router count back (device, the default:
// set_moe_backward_device_offsets), the same with the experts' MXFP8 pairs made on those offsets
// too (pairs: set_moe_pairs_on_device_offsets; the mxfp8 recipe and nvfp4-fwd's tail layers), or
// on the host's routing offsets (host); several (comma-separated, repeats allowed) run each recipe
// under each in this process (other experts take the host's either way).
// --graph: each micro-batch's forward and backward as the trainer runs them (on, the default,
// train.cuda_graphs: StepGraphs records a micro-batch that reads nothing back, the bf16 recipe's
// with --moe-backward device, as a CUDA graph the second time its kind comes, in the warm-up, and
// replays it after; the batch copied into the graph's buffers, the update eager) or all eager
// (off); several (comma-separated, repeats allowed) run each recipe under each in this process.
// "replays" counts the timed micro-batches that were replays; "last loss" is the last timed
// step's, the same bits either way.
// Model FLOPs per token = 6 * (active matmul parameters) + 6 * L * H * hd * T (causal attention:
// half of the 12 L H hd T of the non-causal count); the peak is the H200's measured cuBLAS BF16
// rate (786 TFLOP/s, 8192^3) and the datasheet's dense 989 TFLOP/s.
#include <algorithm>
#include <chrono>
#include <sstream>
#include <vector>

#include "bench/bench_util.h"
#include "fourbit/model/model.h"
#include "fourbit/model/step_graph.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/train/data.h"
#include "fourbit/train/optimizer.h"
#if FOURBIT_HAS_CUDA
#include <cuda_runtime.h>

#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;

namespace {

double active_matmul_params(const ModelConfig& c) {
  const double D = double(c.d_model), hd = double(c.hd());
  const double attn = D * hd * double(c.n_heads) * 2 + D * hd * double(c.n_kv_heads) * 2;
  const double moe = double(c.top_k) * 3 * D * double(c.d_expert) +
                     double(c.n_shared_experts) * 3 * D * double(c.shared_hidden()) + D * double(c.n_experts);
  const double dense = 3 * D * double(c.dense_hidden());
  const double moe_layers = double(c.n_layers - c.dense_layers), dense_layers = double(c.dense_layers);
  return double(c.n_layers) * attn + moe_layers * moe + dense_layers * dense + D * double(c.vocab_size);
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return def;
}

// An option of two values or `both` (each run in this process, first then second): the values to
// run; where it is not its default (`first`), the table gets a column for it after the recipe's.
std::vector<std::string> one_or_both(int argc, char** argv, const std::string& name, const std::string& first,
                                     const std::string& second, const std::string& column, bench::BenchTable& table) {
  const std::string v = arg(argc, argv, name, first);
  if (v != first && v != second && v != "both")
    fail("train_bench: {} must be {}, {} or both, got '{}'", name, first, second, v);
  if (v != first) table.columns.insert(table.columns.begin() + 1, column);
  return v == "both" ? std::vector<std::string>{first, second} : std::vector<std::string>{v};
}

// An option of comma-separated variants (repeats allowed, each run in this process in turn), each
// one of `allowed`, whose first is the default; where it is not the default alone, the table gets
// a column for it after the recipe's.
std::vector<std::string> variant_list(int argc, char** argv, const std::string& name,
                                      const std::vector<std::string>& allowed, const std::string& column,
                                      bench::BenchTable& table) {
  std::vector<std::string> out;
  std::stringstream ss(arg(argc, argv, name, allowed.front()));
  for (std::string v; std::getline(ss, v, ',');) {
    if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
      std::string names;
      for (size_t i = 0; i < allowed.size(); ++i)
        names += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") + allowed[i];
      fail("train_bench: {} takes {}, got '{}'", name, names, v);
    }
    out.push_back(v);
  }
  if (out.empty()) fail("train_bench: {} names no variant", name);
  if (out != std::vector<std::string>{allowed.front()}) table.columns.insert(table.columns.begin() + 1, column);
  return out;
}

void sync(Device d) {
  if (d == Device::CUDA) device_synchronize();
}

int run(int argc, char** argv) {
  std::vector<std::string> sets;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--set") sets.push_back(argv[i + 1]);
  const RunConfig cfg = [&] {
    RunConfig c = load_config(arg(argc, argv, "--config", "configs/tiny.toml"));
    for (const std::string& a : sets) apply_override(c, a);
    validate_config(c);
    return c;
  }();
  const Device device = arg(argc, argv, "--device", "cpu") == "cuda" ? Device::CUDA : Device::CPU;
  if (device == Device::CUDA && cuda_device_count() == 0) {
    std::printf("train_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  std::vector<std::string> recipes;
  {
    std::stringstream ss(arg(argc, argv, "--recipes", "bf16,mxfp8,nvfp4-fwd"));
    for (std::string r; std::getline(ss, r, ',');) recipes.push_back(r);
  }
  const int warmup = std::stoi(arg(argc, argv, "--warmup", "2"));
  const int steps = std::stoi(arg(argc, argv, "--steps", "5"));
  const TrainConfig& t = cfg.train;
  const int64_t tokens_per_step = t.batch_size * t.seq_len * t.grad_accum;
  const double flops_per_token = 6.0 * active_matmul_params(cfg.model) +
                                 6.0 * double(cfg.model.n_layers * cfg.model.n_heads * cfg.model.hd() * t.seq_len);
  const auto src = data::make_token_source(cfg.data, data::Split::Train, t.seed, cfg.model.vocab_size);

  bench::BenchTable table;
  // the machine's name (an H100 or an H200 step is not the same number): the GPU's, or the backend's
  std::string machine = device_name(device);
#if FOURBIT_HAS_CUDA
  cudaDeviceProp prop{};
  if (device == Device::CUDA && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) machine = prop.name;
#endif
  table.name = fmt::format("training step, {} on {}, {} tokens/step", cfg.path, machine, tokens_per_step);
  table.columns = device == Device::CUDA
                      ? std::vector<std::string>{"recipe", "step ms", "host ms", "tokens/s", "TFLOP/s", "MFU vs 786",
                                                 "step / bf16", "saved MiB", "peak MiB", "last loss"}
                      : std::vector<std::string>{"recipe", "step ms", "tokens/s", "step / bf16", "saved MiB"};
  const std::string expert_gemms = arg(argc, argv, "--expert-gemms", "grouped");
  std::vector<std::string> variants;
  if (expert_gemms == "all") variants = {"per-expert", "decode-path", "grouped"};
  else {
    std::stringstream list(expert_gemms);
    for (std::string v; std::getline(list, v, ',');) {
      if (v != "grouped" && v != "grouped-lanes-dgrad" && v != "decode-path" && v != "per-expert")
        fail("train_bench: --expert-gemms takes grouped, grouped-lanes-dgrad, decode-path, per-expert "
             "(comma-separated) or all, got '{}'", v);
      variants.push_back(v);
    }
  }
  if (variants.empty()) fail("train_bench: --expert-gemms names no variant");
  if (variants.size() > 1 || variants[0] != "grouped") {
    if (device != Device::CUDA) fail("train_bench: --expert-gemms {} is for --device cuda", expert_gemms);
    table.columns.insert(table.columns.begin() + 1, "expert GEMMs");
  }
  const std::vector<std::string> keeps = one_or_both(argc, argv, "--keep-ffn", "off", "on", "FFN interiors", table);
  const std::vector<std::string> fwds =
      one_or_both(argc, argv, "--forward-gemms", "grouped", "gemm", "forward GEMMs", table);
  const std::vector<std::string> grad_quants =
      variant_list(argc, argv, "--grad-quant", {"fused", "decodes", "apart"}, "dY quantizers", table);
  const std::vector<std::string> amaxes =
      one_or_both(argc, argv, "--weight-amax", "optimizer", "pass", "weight amax", table);
  const std::vector<std::string> saved_xs = one_or_both(argc, argv, "--saved-x", "decodes", "codes", "saved X^T", table);
  const std::vector<std::string> weight_forms =
      one_or_both(argc, argv, "--weight-forms", "batched", "each", "weight forms", table);
  const std::vector<std::string> loss_reads =
      one_or_both(argc, argv, "--loss-read", "queued", "first", "loss read", table);
  const std::vector<std::string> router_wgrads =
      one_or_both(argc, argv, "--router-wgrad", "kernels", "cublas", "router wgrad", table);
  if (router_wgrads != std::vector<std::string>{"kernels"} && device != Device::CUDA)
    fail("train_bench: --router-wgrad is for --device cuda");
  const std::vector<std::string> tma_tiles =
      variant_list(argc, argv, "--tma-tile", {"pingpong", "pingpong-fwd", "pingpong-all", "256", "128", "128-rows", "128-wgrad"}, "TMA tile", table);
  if (tma_tiles != std::vector<std::string>{"pingpong"} && device != Device::CUDA)
    fail("train_bench: --tma-tile is for --device cuda");
  const std::vector<std::string> moe_backwards =
      variant_list(argc, argv, "--moe-backward", {"device", "pairs", "host"}, "MoE backward offsets", table);
  const std::vector<std::string> graphs = variant_list(argc, argv, "--graph", {"on", "off"}, "graph", table);
  if (moe_backwards != std::vector<std::string>{"device"} && device != Device::CUDA)
    fail("train_bench: --moe-backward is for --device cuda");
  // the process's settings, put back after the variants
  const bool producers_before = set_training_producer_quantizers(true), decodes_before = set_dy_decodes_only(true);
  const bool batched_before = set_weight_forms_batched(true);
  const bool moe_backward_before = set_moe_backward_device_offsets(true);
  const bool moe_pairs_before = set_moe_pairs_on_device_offsets(false);
  for (const std::string& variant : variants)
  for (const std::string& fwd_gemms : fwds)
  for (const std::string& keep_ffn : keeps)
  for (const std::string& gq : grad_quants)
  for (const std::string& amax : amaxes)
  for (const std::string& saved_x : saved_xs)
  for (const std::string& wforms : weight_forms)
  for (const std::string& loss_read : loss_reads)
  for (const std::string& router_wgrad : router_wgrads)
  for (const std::string& tma_tile : tma_tiles)
  for (const std::string& moe_backward : moe_backwards)
  for (const std::string& graph_mode : graphs) {
    const bool keep = keep_ffn == "on";
    set_moe_backward_device_offsets(moe_backward != "host");
    set_moe_pairs_on_device_offsets(moe_backward == "pairs");
    set_weight_forms_batched(wforms == "batched");
    set_forward_gemms_grouped(fwd_gemms == "grouped");
    set_training_producer_quantizers(gq == "fused");
    set_dy_decodes_only(gq != "apart");
#if FOURBIT_HAS_CUDA
    if (device == Device::CUDA) {
      ops::cuda::set_skinny_wgrad(router_wgrad == "kernels");
      ops::cuda::set_grouped_tma_tile(tma_tile == "128" || tma_tile == "128-rows" ? 128 : 256);
      ops::cuda::set_grouped_wgrad_tma_tile(tma_tile == "128" || tma_tile == "128-wgrad" ? 128 : 256);
      ops::cuda::set_grouped_tma_pingpong(tma_tile.rfind("pingpong", 0) == 0 ? 4096 : 0);
      ops::cuda::set_grouped_tma_pingpong_mn_major(tma_tile != "pingpong-fwd");
      ops::cuda::set_grouped_wgrad_tma_pingpong(tma_tile == "pingpong-all");
      ops::cuda::set_grouped_kernel(variant != "per-expert");
      ops::cuda::set_fused_dequant(variant == "grouped" || variant == "grouped-lanes-dgrad");
      ops::cuda::set_grouped_transposed_b(variant != "grouped-lanes-dgrad");
    }
#endif
    double bf16_ms = 0;
    for (const std::string& name : recipes) {
      Model model(cfg.model, recipe_by_name(name), device);
      model.set_keep_ffn_activations(keep);
      model.set_saved_x_decodes(saved_x == "decodes");
      init_params(model.params(), cfg.model, t.seed);
      Optimizer optim(model.params(), t);
      optim.write_bf16_copies(model.bf16_weight_copies());  // as the trainer does
      if (amax == "optimizer") optim.write_slice_amax(model.slice_amax_ahead());
      // The batches are made before the timed steps (the PyTorch peer draws its data on the GPU
      // before timing too); each step uploads its own, as the trainer does.
      const size_t batch_values = size_t(t.batch_size * t.seq_len);
      std::vector<std::vector<int32_t>> toks, tgts;
      for (int64_t b = 0; b < (warmup + steps) * t.grad_accum; ++b) {
        toks.emplace_back(batch_values);
        tgts.emplace_back(batch_values);
        src->batch(b, t.batch_size, t.seq_len, toks.back().data(), tgts.back().data());
      }
      // the trainer's micro-batches (StepGraphs), or with --loss-read first Model::forward's order
      StepGraphs step_graphs(model, graph_mode == "on" && loss_read == "queued");
      double last_loss = 0;
      auto run_step = [&](int64_t step) {
        model.params().zero_grad();
        for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
          const size_t b = size_t(step * t.grad_accum + micro);
          const Tensor tokens = Tensor::from_host(toks[b].data(), {t.batch_size, t.seq_len}, DType::I32, device);
          const Tensor targets = Tensor::from_host(tgts[b].data(), {t.batch_size, t.seq_len}, DType::I32, device);
          const SrStreams sr{t.seed, uint64_t(step), uint64_t(micro)};
          const float share = 1.0f / float(t.grad_accum);
          if (loss_read == "first") {
            PendingForwardStats pending = model.forward_queued(tokens, targets, sr, true, share);
            (void)pending.stats();
            model.backward();
            last_loss = pending.stats().loss;
          } else {
            PendingForwardStats pending = step_graphs.run(tokens, targets, Tensor(), share, sr, micro == 0);
            if (const std::string f = step_graphs.take_failure(); !f.empty()) fail("train_bench: {}", f);
            last_loss = pending.stats().loss;
          }
        }
        optim.step(step);
        model.invalidate_weight_cache(optim.wrote_bf16_copies(), optim.wrote_slice_amax());
      };
      for (int i = 0; i < warmup; ++i) run_step(i);
      const int64_t replays_before = step_graphs.replays();
      sync(device);
      device_peak_bytes(true);
      // host ms: until the step's last launch returns (its waits for the GPU included); where it
      // is close to the step's time, the host, not the GPU, bounds the step
      std::vector<double> ms, host_ms;
      for (int i = 0; i < steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        run_step(warmup + i);
        host_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        sync(device);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ms.begin(), ms.end());
      std::sort(host_ms.begin(), host_ms.end());
      const double step_ms = ms[ms.size() / 2];
      if (name == "bf16") bf16_ms = step_ms;
      const double tps = double(tokens_per_step) / (step_ms / 1e3);
      const double tflops = tps * flops_per_token / 1e12;
      int64_t saved = 0;
      nlohmann::json by;
      for (const auto& [k, v] : model.saved_bytes().by_category) {
        saved += v;
        by[k] = double(v) / 1048576.0;
      }
      table.add({{"recipe", name},
                 {"expert GEMMs", variant},
                 {"FFN interiors", keep ? "kept" : "recomputed"},
                 {"forward GEMMs", fwd_gemms},
                 {"dY quantizers", gq},
                 {"weight amax", amax},
                 {"saved X^T", saved_x},
                 {"weight forms", wforms},
                 {"loss read", loss_read},
                 {"router wgrad", router_wgrad},
                 {"TMA tile", tma_tile},
                 {"MoE backward offsets", moe_backward},
                 {"graph", graph_mode},
                 {"replays", step_graphs.replays() - replays_before},
                 {"last loss", last_loss},
                 {"step ms", step_ms},
                 {"host ms", host_ms[host_ms.size() / 2]},
                 {"tokens/s", tps},
                 {"TFLOP/s", tflops},
                 {"MFU vs 786", tflops / 786.0},
                 {"MFU vs 989", tflops / 989.0},
                 {"step / bf16", bf16_ms > 0 ? step_ms / bf16_ms : 0.0},
                 {"saved MiB", double(saved) / 1048576.0},
                 {"saved MiB by category", by},
                 {"peak MiB", double(device_peak_bytes(false)) / 1048576.0},
                 {"step ms all", ms}});
    }
  }
  set_forward_gemms_grouped(true);
  set_training_producer_quantizers(producers_before);
  set_dy_decodes_only(decodes_before);
  set_weight_forms_batched(batched_before);
  set_moe_backward_device_offsets(moe_backward_before);
  set_moe_pairs_on_device_offsets(moe_pairs_before);
#if FOURBIT_HAS_CUDA
  if (device == Device::CUDA) {
    ops::cuda::set_grouped_tma_tile(256);
    ops::cuda::set_grouped_wgrad_tma_tile(256);
    ops::cuda::set_grouped_tma_pingpong(4096);
    ops::cuda::set_grouped_tma_pingpong_mn_major(true);
    ops::cuda::set_grouped_wgrad_tma_pingpong(false);
  }
#endif
  table.meta = {{"config", cfg.path}, {"device", device_name(device)}, {"machine", machine}, {"tokens_per_step", tokens_per_step},
                {"model_flops_per_token", flops_per_token}, {"active_matmul_params", active_matmul_params(cfg.model)},
                {"warmup", warmup}, {"steps", steps}};
  if (!sets.empty()) table.meta["set"] = sets;
  table.print();
  table.write_json(arg(argc, argv, "--json", ""));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a bad option or config field: its message, not an abort
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    return 2;
  }
}
