// defines: the gpu_sampler benchmark (main)
// Decode speed of the KV-cache sampler (rl/sampler.h) per recipe and batch size: B distinct
// random prompts of P tokens, each sampled at temperature 1 with no stop token until its
// sequence fills a cache of C positions (C - P + 1 new tokens: one from the prefill, the rest
// from C - P decode steps), on seeded random weights of the config's model. Decode tokens/s
// counts the tokens of the decode steps over their time (forwards, cache writes, the host-side
// draws and log-probs); prefill is reported apart. host_ms_per_step: the host's time to queue one
// decode forward (near ms_per_step, the step waits for the host). Times are wall clock with the device
// synchronised at each phase's end, so this runs on the CPU as well (--device cpu).
// Usage: gpu_sampler [--config configs/gpu-small.toml] [--device auto|cuda|cpu]
//                    [--recipes bf16,mxfp8,nvfp4-fwd] [--batches 1,16,64,256] [--prompt 16]
//                    [--cache 512] [--kv-cache bf16,f32] [--decode-widths 0,32,128]
//                    [--forward-gemms grouped,gemm] [--fused on,off] [--producer-quant on,off]
//                    [--shared-group on,off] [--routing deferred,layer]
//                    [--attention group,head] [--graphs on,off] [--draws gpu,host]
//                    [--dependent-launches on,off] [--traffic on|off]
//                    [--json FILE]
// --kv-cache: the KV cache's storage per run (KvCache: BF16 is the GPU's default, F32 the cache
// before it; the same samples), each a row of the table. --decode-widths: the grouped expert
// GEMMs' decode configuration per run (cuda::set_grouped_decode_width: 0 chosen per call, 16 the
// streaming kernel, 32 / 128 the one-warpgroup tiles, -1 the 64 x 256 tile; the same samples),
// each a row: an A/B of the expert kernels within one process, after a sample at the batch size
// (its allocations: KV caches of the full length) that no row counts. --forward-gemms: the linear
// layers' forward GEMMs on the grouped kernel family (grouped, the default: forward_gemm) or on
// ops::gemm's cuBLASLt (gemm, the path before it), rows adjacent per batch as the widths'.
// --fused: the GEMMs that read one input as one GEMM on their weights' rows stacked (on, the
// default: set_fused_forward_gemms; wq | wk | wv, every FFN's w1 | w3) or one GEMM each (off, the
// path before it); the same samples, rows adjacent per batch. --producer-quant: in those fused
// forwards, the block-scaled GEMM inputs quantized by the RMSNorm or SwiGLU that writes them (on,
// the default: set_producer_quantizers) or by a quantizer of their own after it (off, the path
// before it); the same samples (the run fails otherwise), rows adjacent per batch. --shared-group: in
// those fused forwards, a MoE layer's shared expert as one more group of the routed experts' GEMMs
// (on, the default: set_shared_expert_grouped) or its own GEMMs (off, the path before it); the same
// samples (the run fails otherwise), rows adjacent per batch.
// --routing: the MoE layers on the GPU's routing offsets with one wait for the router counts after
// the forward (deferred, the default: set_moe_routing_waits_deferred) or a wait in every MoE layer
// (layer, the path before it); the same samples, rows adjacent per batch. --attention: a decode
// step's attention a CTA per kv head group (group, the default: cuda::set_flash_head_rows) or per
// q head (head, the path before it); the same samples, rows adjacent per batch. --graphs: the
// decode steps as CUDA graphs (on, the default: Sampler::set_cuda_graphs) or issued op by op (off);
// rows adjacent per batch, and the run fails unless both give the same completions. graph_captures
// counts the graphs a row recorded; a row that decoded op by op with graphs on says why in graph_error.
// --draws: the tokens drawn on the GPU (gpu, the default: Sampler::set_gpu_draws) or on the host from the
// logits read back (host); the same samples (the run fails otherwise), rows adjacent per batch.
// --dependent-launches: a decode step's kernels as programmatic dependent launches (on, the default on
// compute capability 9.0+: cuda::set_dependent_launches) or plain launches (off); the same samples (the
// run fails otherwise), rows adjacent per batch.
// --traffic (on by default): the memory traffic a decode step cannot avoid, and the rate it ran at.
// After a batch's timed rows, one more sample of the same prompts (untimed, op by op with a wait for
// the router counts in every MoE layer, Model::set_routing_observer) counts the routed experts that each
// decode step's MoE layers send a token to (experts_per_layer). A decode step reads at least every
// other weight as the forward stores it (forward_weight_bytes: codes and scales, or the BF16
// matrix), one routed expert's weights for each expert touched (expert_MB), and the KV rows its
// attention reads (P + j + 1 positions of every sequence at decode step j), and writes its new
// K/V rows: MB_per_step, their mean over the decode steps, a lower bound (activations, the
// embedding rows and the logits are left out). GB_per_s: MB_per_step over ms_per_step; of_copy:
// that over a device-to-device copy measured in the same process (CUDA only). speed_vs_bf16: the
// decode tokens/s over the bf16 row's at the same batch and settings; bytes_vs_bf16: bf16's
// MB_per_step over this row's, the speed-up a step that reads at bf16's rate would reach.
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/gpu_bench_util.h"
#include "fourbit/model/model.h"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/rl/sampler.h"
#include "fourbit/tensor/device_memory.h"

using namespace fourbit;

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// A flag listing runs of one of two settings ("--graphs on,off"): true for `yes`, false for `no`,
// in the order given (each an A/B row); `fallback` where the flag is absent.
std::vector<bool> two_way(int argc, char** argv, const std::string& name, const std::string& yes,
                          const std::string& no, const std::string& fallback) {
  std::vector<bool> out;
  for (const std::string& f : split(arg(argc, argv, name, fallback))) {
    if (f != yes && f != no) fail("{} takes {} or {}, not {}", name, yes, no, f);
    out.push_back(f == yes);
  }
  if (out.empty()) fail("{} names no setting", name);
  return out;
}

std::vector<rl::SampleRequest> random_prompts(int64_t B, int64_t P, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> u(0, 255);
  std::vector<rl::SampleRequest> out;
  for (int64_t b = 0; b < B; ++b) {
    rl::SampleRequest r;
    r.sequence_id = uint64_t(b);
    for (int64_t t = 0; t < P; ++t) r.prompt.push_back(u(g));
    out.push_back(std::move(r));
  }
  return out;
}

// The experts each MoE layer of a decode step sends a token to, summed over the layers, for every
// decode step of one sample() call: the first forward of the call is its prefill, each later one
// a decode step (the sampler's order); a forward is the MoE layers' events in layer order.
class ExpertCensus {
 public:
  ExpertCensus(const ModelConfig& cfg, const ForwardWeightBytes& bytes) : bytes_(bytes) {
    for (int64_t l = 0; l < cfg.n_layers; ++l)
      if (cfg.is_moe_layer(l)) ++moe_layers_;
  }
  void operator()(const RoutingEvent& ev) {
    if (events_ % moe_layers_ == 0) steps_.push_back({0, 0});  // a forward begins
    ++events_;
    int64_t touched = 0;
    for (size_t e = 0; e + 1 < ev.offsets.size(); ++e) touched += ev.offsets[e + 1] > ev.offsets[e] ? 1 : 0;
    steps_.back().experts += touched;
    steps_.back().bytes += touched * bytes_.expert_by_layer.at(ev.layer);
  }
  // Over the decode steps (every forward after the first); fails unless there are `decode_steps`.
  double experts_per_layer(int64_t decode_steps) const { return mean(decode_steps, true) / double(moe_layers_); }
  double expert_bytes_per_step(int64_t decode_steps) const { return mean(decode_steps, false); }

 private:
  struct Step {
    int64_t experts, bytes;
  };
  double mean(int64_t decode_steps, bool experts) const {
    if (int64_t(steps_.size()) != decode_steps + 1 || events_ % moe_layers_ != 0)
      fail("traffic census: {} MoE layer events in {} forwards, expected a prefill and {} decode steps of {} layers",
           events_, steps_.size(), decode_steps, moe_layers_);
    double sum = 0;
    for (size_t i = 1; i < steps_.size(); ++i) sum += double(experts ? steps_[i].experts : steps_[i].bytes);
    return sum / double(decode_steps);
  }
  const ForwardWeightBytes& bytes_;
  int64_t moe_layers_ = 0, events_ = 0;
  std::vector<Step> steps_;
};

bool same_tokens(const std::vector<rl::Completion>& a, const std::vector<rl::Completion>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].tokens != b[i].tokens) return false;
  return true;
}

// The same doubles bit for bit, row by row.
bool same_bits(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(double)) != 0)
      return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string config_path = arg(argc, argv, "--config", "configs/gpu-small.toml");
    const RunConfig cfg = load_config(config_path);
    const std::string dev_name = arg(argc, argv, "--device", "auto");
    const Device device = dev_name == "cpu" ? Device::CPU
                          : dev_name == "cuda" || cuda_device_count() > 0 ? Device::CUDA
                                                                          : Device::CPU;
    if (device == Device::CUDA && cuda_device_count() == 0) fail("--device cuda: no CUDA device visible");
    const int64_t P = std::stoll(arg(argc, argv, "--prompt", "16"));
    int64_t C = std::stoll(arg(argc, argv, "--cache", "512"));
    if (C > cfg.model.max_seq_len) {
      std::printf("cache %lld > max_seq_len %lld of %s: using %lld\n", (long long)C, (long long)cfg.model.max_seq_len,
                  config_path.c_str(), (long long)cfg.model.max_seq_len);
      C = cfg.model.max_seq_len;
    }
    if (P < 1 || P >= C) fail("--prompt must be in [1, cache) = [1, {}), got {}", C, P);
    std::vector<int64_t> batches;
    for (const std::string& b : split(arg(argc, argv, "--batches", "1,16,64,256"))) batches.push_back(std::stoll(b));

    bench::BenchTable table;
    table.name = fmt::format("KV-cache sampler decode, {} on {} (prompt {}, cache {} positions)", config_path,
                             device_name(device), P, C);
    table.columns = {"recipe",  "kv_cache", "forward",          "fused",        "producer_quant",   "shared_group",
                     "routing",
                     "attention", "graphs", "draws",            "experts",      "batch",            "decode_tok_per_s",
                     "ms_per_step",         "host_ms_per_step", "prefill_tok_per_s", "kv_cache_MiB"};
    const std::string traffic_arg = arg(argc, argv, "--traffic", "on");
    if (traffic_arg != "on" && traffic_arg != "off") fail("--traffic takes on or off, not {}", traffic_arg);
    const bool traffic = traffic_arg == "on";
    if (traffic)
      for (const char* c : {"experts_per_layer", "expert_MB", "MB_per_step", "GB_per_s", "of_copy", "speed_vs_bf16",
                            "bytes_vs_bf16"})
        table.columns.push_back(c);
    std::vector<int> widths;
    for (const std::string& w : split(arg(argc, argv, "--decode-widths", "0"))) widths.push_back(std::stoi(w));
    if (device == Device::CPU && widths != std::vector<int>{0})
      fail("--decode-widths: the grouped GEMM's decode configurations are the CUDA backend's; on the CPU give 0");
    const std::vector<bool> forward_grouped = two_way(argc, argv, "--forward-gemms", "grouped", "gemm", "grouped");
    const std::vector<bool> fusions = two_way(argc, argv, "--fused", "on", "off", "on");
    const std::vector<bool> producer_quants = two_way(argc, argv, "--producer-quant", "on", "off", "on");
    const std::vector<bool> shared_groups = two_way(argc, argv, "--shared-group", "on", "off", "on");
    const std::vector<bool> routing_deferred = two_way(argc, argv, "--routing", "deferred", "layer", "deferred");
    const std::vector<bool> head_rows = two_way(argc, argv, "--attention", "group", "head", "group");
    const std::vector<bool> graph_modes = two_way(argc, argv, "--graphs", "on", "off", "on");
    const std::vector<bool> draw_modes = two_way(argc, argv, "--draws", "gpu", "host", "gpu");
    const std::vector<bool> pdl_modes = two_way(argc, argv, "--dependent-launches", "on", "off", "on");
    if (device == Device::CPU && head_rows != std::vector<bool>{true})
      fail("--attention: the decode attention's CTAs are the CUDA backend's; on the CPU give group");
    std::vector<DType> kv_storages;
    for (const std::string& kv : split(arg(argc, argv, "--kv-cache", "default"))) {
      if (kv != "default" && kv != "bf16" && kv != "f32") fail("--kv-cache takes bf16, f32 or default, not {}", kv);
      kv_storages.push_back(kv == "f32"    ? DType::F32
                            : kv == "bf16" ? DType::BF16
                                           : KvCache::default_storage(DType::F32, device));
    }
    table.meta = {
        {"config", config_path}, {"device", device_name(device)}, {"prompt_tokens", P}, {"cache_positions", C}};
    const double copy_gbs = traffic && device == Device::CUDA ? bench::copy_bandwidth_gbs(10) : 0.0;
    if (copy_gbs > 0) table.meta["copy_GB_per_s"] = copy_gbs;
    rl::SamplingOptions opt;
    opt.temperature = 1.0;
    opt.stop_token = -1;
    opt.max_new = C - P + 1;
    for (const std::string& recipe : split(arg(argc, argv, "--recipes", "bf16,mxfp8,nvfp4-fwd"))) {
      Model model(cfg.model, recipe_by_name(recipe), device);
      init_params(model.params(), cfg.model, 1234);
      rl::Sampler sampler(model);
      const ForwardWeightBytes weight_bytes = forward_weight_bytes(model);
      {  // warm-up: GEMM plans, weight quantization (cached for the whole run, as in one RL step)
        rl::SamplingOptions w = opt;
        w.max_new = 4;
        sampler.sample(random_prompts(2, P, 1), w);
      }
      for (const DType storage : kv_storages)
        for (int64_t B : batches) {
          sampler.set_kv_storage(storage);
          // one cached position: K and V of every layer
          const double kv_row = 2.0 * double(cfg.model.n_layers * cfg.model.n_kv_heads * cfg.model.hd()) *
                                double(dtype_size(storage));
          // the batch's allocations (full-length KV caches) first: no row pays them
          if (widths.size() * forward_grouped.size() * fusions.size() * producer_quants.size() *
                  shared_groups.size() * routing_deferred.size() * head_rows.size() * graph_modes.size() * draw_modes.size() *
                  pdl_modes.size() > 1)
            sampler.sample(random_prompts(B, P, 3), opt);
          const size_t first_row = table.rows.size();
          std::vector<rl::Completion> timed_out;  // the last timed row's, for the census's check
          std::vector<std::vector<int32_t>> first_tokens;  // the first row's completions, to compare
          std::vector<std::vector<double>> first_draw_logprobs;
          for (const bool pdl : pdl_modes)
          for (const bool gpu_draws : draw_modes)
          for (const bool graphs : graph_modes)
          for (const bool fwd : forward_grouped)
          for (const bool fused : fusions)
          for (const bool producer_quant : producer_quants)
          for (const bool shared_group : shared_groups)
          for (const bool deferred : routing_deferred)
          for (const bool group_ctas : head_rows)
          for (const int width : widths) {  // adjacent in time: an A/B of the kernels
            if (device == Device::CUDA) {
              ops::cuda::set_grouped_decode_width(width);
              ops::cuda::set_flash_head_rows(group_ctas);
              ops::cuda::set_dependent_launches(pdl);
            }
            set_forward_gemms_grouped(fwd);
            set_fused_forward_gemms(fused);
            set_producer_quantizers(producer_quant);
            set_shared_expert_grouped(shared_group);
            set_moe_routing_waits_deferred(deferred);
            sampler.set_cuda_graphs(graphs);
            sampler.set_gpu_draws(gpu_draws);
            const std::string experts = width == 0    ? "chosen"
                                        : width == 16 ? "stream"
                                        : width < 0   ? "64x256"
                                                      : fmt::format("64x{}", width);
            sampler.reset_stats();
            const std::vector<rl::Completion> out = sampler.sample(random_prompts(B, P, 7 + uint64_t(B)), opt);
            const rl::SamplerStats& s = sampler.stats();
            if (graph_modes.size() * draw_modes.size() * pdl_modes.size() * producer_quants.size() *
                    shared_groups.size() > 1) {
              // any of these: the same samples
              std::vector<std::vector<int32_t>> tokens;
              std::vector<std::vector<double>> draw_logprobs;
              for (const rl::Completion& c : out) tokens.push_back(c.tokens), draw_logprobs.push_back(c.sample_logprobs);
              if (first_tokens.empty()) {
                first_tokens = std::move(tokens);
                first_draw_logprobs = std::move(draw_logprobs);
              } else if (tokens != first_tokens || !same_bits(draw_logprobs, first_draw_logprobs)) {
                fail("{} batch {}: graphs {} with draws on the {}, dependent launches {}, producer quantizers {} "
                     "and the shared expert grouped {} sampled other tokens or draw log-probs than the first row",
                     recipe, B, graphs ? "on" : "off", gpu_draws ? "gpu" : "host", pdl ? "on" : "off",
                     producer_quant ? "on" : "off", shared_group ? "on" : "off");
              }
            }
            if (!s.graph_error.empty()) std::fprintf(stderr, "gpu_sampler: the decode ran op by op: %s\n", s.graph_error.c_str());
            const int64_t decode_tokens = s.sampled_tokens - B;  // the first token of each came from the prefill
            const double decode_s = s.decode_s + s.choose_s * double(decode_tokens) / double(s.sampled_tokens);
            const double kv_mib = double(B) * double(C) * kv_row / 1048576.0;
            table.add({{"recipe", recipe},
                       {"kv_cache", dtype_name(storage)},
                       {"forward", fwd ? "grouped" : "gemm"},
                       {"fused", fused ? "on" : "off"},
                       {"producer_quant", producer_quant ? "on" : "off"},
                       {"shared_group", shared_group ? "on" : "off"},
                       {"routing", deferred ? "deferred" : "layer"},
                       {"attention", group_ctas ? "group" : "head"},
                       {"graphs", graphs ? "on" : "off"},
                       {"draws", gpu_draws ? "gpu" : "host"},
                       {"dependent_launches", pdl ? "on" : "off"},
                       {"experts", experts},
                       {"batch", B},
                       {"decode_tok_per_s", double(decode_tokens) / decode_s},
                       {"ms_per_step", 1e3 * decode_s / double(s.decode_forwards)},
                       {"prefill_tok_per_s", double(s.prefill_tokens) / s.prefill_s},
                       {"kv_cache_MiB", kv_mib},
                       {"decode_steps", s.decode_forwards},
                       {"sampled_tokens", s.sampled_tokens},
                       {"decode_s", s.decode_s},
                       {"host_ms_per_step", 1e3 * s.decode_issue_s / double(s.decode_forwards)},
                       {"choose_s", s.choose_s},
                       {"prefill_s", s.prefill_s},
                       {"graph_captures", s.graph_captures},
                       {"graph_error", s.graph_error}});
            std::printf("%s, %s cache, forward %s, fused %s, producer quant %s, shared group %s, routing %s, "
                        "attention %s, graphs %s, "
                        "draws %s, dependent launches %s, experts %s, batch %lld: %.0f decode tokens/s (%lld steps)\n",
                        recipe.c_str(), dtype_name(storage), fwd ? "grouped" : "gemm", fused ? "on" : "off",
                        producer_quant ? "on" : "off", shared_group ? "on" : "off",
                        deferred ? "deferred" : "layer", group_ctas ? "group" : "head", graphs ? "on" : "off",
                        gpu_draws ? "gpu" : "host", pdl ? "on" : "off", experts.c_str(), (long long)B,
                        double(decode_tokens) / decode_s, (long long)s.decode_forwards);
            timed_out = out;
          }
          if (traffic) {
            // The same prompts once more, untimed, op by op with the counts on the host in every layer
            // (a replayed graph calls no host code).
            set_moe_routing_waits_deferred(false);
            sampler.set_cuda_graphs(false);
            ExpertCensus census(cfg.model, weight_bytes);
            model.set_routing_observer([&](const RoutingEvent& ev) { census(ev); });
            sampler.reset_stats();
            const std::vector<rl::Completion> out = sampler.sample(random_prompts(B, P, 7 + uint64_t(B)), opt);
            model.set_routing_observer({});
            const int64_t S = sampler.stats().decode_forwards;
            const bool same = same_tokens(out, timed_out);
            // decode step j reads P + j + 1 positions of each sequence and writes one
            const double kv_bytes =
                double(B) * kv_row * (double(S) * double(P + 1) + double(S) * double(S - 1) / 2.0 + double(S)) /
                double(S);
            const double expert_bytes = census.expert_bytes_per_step(S), experts = census.experts_per_layer(S);
            const double step_bytes = double(weight_bytes.other) + expert_bytes + kv_bytes;
            for (size_t i = first_row; i < table.rows.size(); ++i) {
              nlohmann::json& row = table.rows[i];
              const double gbs = step_bytes / (row["ms_per_step"].get<double>() * 1e6);
              row["experts_per_layer"] = experts;
              row["expert_MB"] = expert_bytes / 1e6;
              row["MB_per_step"] = step_bytes / 1e6;
              row["GB_per_s"] = gbs;
              if (copy_gbs > 0) row["of_copy"] = gbs / copy_gbs;
              row["kv_MB_per_step"] = kv_bytes / 1e6;
              row["other_weights_MB"] = double(weight_bytes.other) / 1e6;
              row["census_same_samples"] = same;
            }
            set_moe_routing_waits_deferred(true);
            sampler.set_cuda_graphs(true);
          }
        }
      if (device == Device::CUDA) {
        ops::cuda::set_grouped_decode_width(0);
        ops::cuda::set_flash_head_rows(true);
        ops::cuda::set_dependent_launches(true);
      }
      set_forward_gemms_grouped(true);
      set_fused_forward_gemms(true);
      set_producer_quantizers(true);
      set_shared_expert_grouped(true);
      set_moe_routing_waits_deferred(true);
      sampler.set_cuda_graphs(true);
      sampler.set_gpu_draws(true);
    }
    if (traffic)  // each row against the bf16 row of the same batch and settings, where there is one
      for (nlohmann::json& row : table.rows) {
        if (row["recipe"] == "bf16") continue;
        for (const nlohmann::json& base : table.rows) {
          bool match = base["recipe"] == "bf16";
          for (const char* k :
               {"kv_cache", "forward", "fused", "producer_quant", "shared_group", "routing", "attention", "graphs", "draws",
                "dependent_launches",
                "experts", "batch"})
            match = match && base[k] == row[k];
          if (!match) continue;
          row["speed_vs_bf16"] = row["decode_tok_per_s"].get<double>() / base["decode_tok_per_s"].get<double>();
          row["bytes_vs_bf16"] = base["MB_per_step"].get<double>() / row["MB_per_step"].get<double>();
          break;
        }
      }
    table.print();
    table.write_json(bench::json_path_arg(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_sampler: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
