// defines: SampleRequest, Finish, Completion, SamplerStats, Sampler
// The KV-cache sampler: many sequences (B prompts x G samples, ragged prompt lengths) prefilled
// and decoded together through Model::forward_cached, i.e. the training forward's blocks, cached
// weights and per-token activation quantization, with a per-layer KV cache.
//
// "log-prob" here is always the policy's: log softmax of the model's logits at temperature 1 over
// the whole vocabulary (no top-k/top-p), computed by ops::cross_entropy on the logits row exactly
// as the trainer computes its per-token loss (log-prob = -loss). For the batch-invariant recipes
// (fp32, bf16, mxfp8, nvfp4-fwd) it equals the trainer's forward on the full sequence bit for bit.
// The probability a token was actually drawn with (temperature, truncation) is sample_logprob;
// an RL step that samples at temperature 1 without truncation draws from the policy itself.
//
// Flow of sample(): identical prompts are prefilled once (one forward over the distinct prompts,
// right-padded; logits only at each prompt's last token), their cache slots copied to every
// sequence that starts from them, then one decode forward per new token over all unfinished
// sequences. Finished sequences leave the batch and the cache at once. On the GPU the decode
// forward is a CUDA graph (model/decode_graph.h), recorded at the second step of each batch the
// decode runs (a batch changes when sequences leave) and replayed for the batch's later steps: the
// same bits as the forward it records.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/rl/sampling.h"

namespace fourbit::rl {

struct SampleRequest {
  std::vector<int32_t> prompt;  // token ids (e.g. <bos> text <sep>), at least one
  uint64_t sequence_id = 0;     // keys the random draws with (seed, step, position); distinct in a call
};

enum class Finish : uint8_t {
  Stop,     // sampled the stop token (the last token of `tokens`)
  Length,   // max_new tokens
  Context,  // the sequence reached the model's max_seq_len
};
const char* finish_name(Finish f);

struct Completion {
  uint64_t sequence_id = 0;
  std::vector<int32_t> tokens;          // the sampled tokens, the stop token included
  std::vector<float> logprobs;          // the policy's log-prob of each token (see above)
  std::vector<double> sample_logprobs;  // log-prob under the distribution it was drawn from
  std::vector<float> logits;            // keep_logits: [tokens.size(), V], row i gave token i
  Finish finish = Finish::Length;
};

struct SamplerStats {
  int64_t calls = 0;
  int64_t sequences = 0;
  int64_t prefill_tokens = 0;   // distinct prompts' tokens (without padding)
  int64_t decode_forwards = 0;  // forward_cached calls with T = 1
  int64_t sampled_tokens = 0;
  double prefill_s = 0, decode_s = 0;  // forward passes (incl. the cache copies)
  // the host's part of decode_s: until the decode forwards are queued (where it nears decode_s, the
  // decode steps wait for the host, not the GPU)
  double decode_issue_s = 0;
  double choose_s = 0;  // the draws (on the GPU: queued, and the tokens read back), the log-probs' queueing
  int64_t graph_captures = 0;  // decode graphs recorded (counted in decode_s and decode_issue_s)
  int64_t graph_replays = 0;   // decode forwards run as a graph replay (a capture's first run included)
  std::string graph_error;     // why the decode did not run as graphs (a capture failed, or the model's
                               // forward reads back: Model::forward_cached_stays_on_device); empty if it did
};

class Sampler {
 public:
  // sr: the streams the forward's quantizers use (forward quantizers of every recipe round to
  // nearest, so they draw nothing; passed for the keys to match the trainer's).
  explicit Sampler(Model& model, const SrStreams& sr = {});
  void set_sr_streams(const SrStreams& sr) { sr_ = sr; }
  // The KV cache's storage dtype (KvCache): KvCache::default_storage unless set (F32 where the
  // default is BF16, for benchmarks comparing the two; both give the same samples).
  void set_kv_storage(std::optional<DType> storage) { kv_storage_ = storage; }
  // Whether a GPU model's decode steps run as CUDA graphs (on by default; the same samples either
  // way). Not where the model's forward reads back to the host (FP32 experts); where a capture
  // fails the call decodes op by op, and so do later calls until set_cuda_graphs(true) is called
  // again (a failure is paid once, not once a call). stats().graph_error says why in either case.
  void set_cuda_graphs(bool on) {
    cuda_graphs_ = on;
    graph_failure_.clear();
  }

  // Whether a GPU model's tokens are drawn on the GPU (ops::draw_tokens; on by default where the
  // vocabulary fits its kernel, ops::kGpuDrawMaxVocab): only the tokens come back to the host
  // each step, not the logits. Off: drawn on the host from the logits. The same samples either way.
  void set_gpu_draws(bool on) { gpu_draws_ = on; }
  // One completion per request, in request order. Fails (before any work) on an empty or
  // out-of-vocabulary prompt, a prompt longer than max_seq_len, repeated sequence ids or bad
  // options. A prompt of exactly max_seq_len tokens gets one token.
  std::vector<Completion> sample(const std::vector<SampleRequest>& requests, const SamplingOptions& opt);

  // The RL rollout shape: `group` (G >= 2, a group baseline needs two) samples of each prompt;
  // result i * G + g is sample g of prompt i, with sequence id first_id + i * G + g.
  std::vector<Completion> sample_groups(const std::vector<std::vector<int32_t>>& prompts, int64_t group,
                                        const SamplingOptions& opt, uint64_t first_id = 0);

  const SamplerStats& stats() const { return stats_; }
  void reset_stats() { stats_ = SamplerStats{}; }

 private:
  Model& model_;
  SrStreams sr_;
  SamplerStats stats_;
  std::optional<DType> kv_storage_;
  bool cuda_graphs_ = true;
  bool gpu_draws_ = true;
  bool graph_warned_ = false;  // a failed capture is reported on stderr once
  std::string graph_failure_;  // why a capture failed, since set_cuda_graphs
};

}  // namespace fourbit::rl
