// defines: finish_name, Sampler (sampler.h)
#include "fourbit/rl/sampler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <numeric>
#include <set>

#include "fourbit/model/decode_graph.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::Stop: return "stop";
    case Finish::Length: return "length";
    case Finish::Context: return "context";
  }
  return "?";
}

namespace {

using Clock = std::chrono::steady_clock;

// Seconds since t0, after the device has finished what was issued (so GPU work is counted where
// it was asked for, not at the next synchronisation).
double seconds_since(Clock::time_point t0, Device device) {
  if (device == Device::CUDA) device_synchronize();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

Sampler::Sampler(Model& model, const SrStreams& sr) : model_(model), sr_(sr) {}

std::vector<Completion> Sampler::sample(const std::vector<SampleRequest>& requests, const SamplingOptions& opt) {
  const ModelConfig& cfg = model_.config();
  const int64_t V = cfg.vocab_size;
  const Device dev = model_.device();
  check_sampling_options(opt, V);
  if (model_.dtype() != DType::F32)
    fail("sampler: runs f32 models (the f64 model is for gradient checks), got {}", dtype_name(model_.dtype()));

  // ---- checks, before any work ----
  std::vector<Completion> out(requests.size());
  std::set<uint64_t> ids;
  for (size_t i = 0; i < requests.size(); ++i) {
    const SampleRequest& r = requests[i];
    if (r.prompt.empty()) fail("sampler: request {} has an empty prompt", i);
    if (int64_t(r.prompt.size()) > cfg.max_seq_len)
      fail("sampler: request {}: a prompt of {} tokens does not fit the model's context (max_seq_len {})", i,
           r.prompt.size(), cfg.max_seq_len);
    for (size_t t = 0; t < r.prompt.size(); ++t)
      if (r.prompt[t] < 0 || r.prompt[t] >= V)
        fail("sampler: request {}: prompt token {} is {}, outside the vocabulary [0, {})", i, t, r.prompt[t], V);
    if (!ids.insert(r.sequence_id).second)
      fail("sampler: request {} repeats sequence id {}: ids key the random draws and must be distinct", i,
           r.sequence_id);
    out[i].sequence_id = r.sequence_id;
  }
  stats_.calls += 1;
  stats_.sequences += int64_t(requests.size());
  if (requests.empty() || opt.max_new == 0) return out;

  // ---- distinct prompts, and the batch rows ordered by prompt length ----
  std::map<std::vector<int32_t>, int64_t> index_of;
  std::vector<const std::vector<int32_t>*> prompts;
  std::vector<int64_t> prompt_of(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    auto [it, fresh] = index_of.try_emplace(requests[i].prompt, int64_t(prompts.size()));
    if (fresh) prompts.push_back(&requests[i].prompt);
    prompt_of[i] = it->second;
  }
  auto len = [&](size_t i) { return int64_t(requests[i].prompt.size()); };
  std::vector<size_t> rows(requests.size());  // request of each batch row
  std::iota(rows.begin(), rows.end(), size_t(0));
  std::stable_sort(rows.begin(), rows.end(), [&](size_t a, size_t b) {
    return len(a) != len(b) ? len(a) < len(b) : prompt_of[a] < prompt_of[b];
  });
  const int64_t U = int64_t(prompts.size());
  int64_t L_max = 0;
  for (const auto* p : prompts) L_max = std::max(L_max, int64_t(p->size()));
  // Positions ever written: the prompt, then every sampled token but the last.
  const int64_t capacity = std::min(cfg.max_seq_len, L_max + opt.max_new - 1);

  // ---- prefill the distinct prompts, right-padded (padding rows write K/V only after their
  // prompt's end, where the sequence's own tokens overwrite them before anything reads them) ----
  auto t0 = Clock::now();
  std::vector<int32_t> host(size_t(U * L_max), 0);
  std::vector<int32_t> last_rows;
  for (int64_t u = 0; u < U; ++u) {
    std::copy(prompts[size_t(u)]->begin(), prompts[size_t(u)]->end(), host.begin() + u * L_max);
    last_rows.push_back(int32_t(u * L_max + int64_t(prompts[size_t(u)]->size()) - 1));
    stats_.prefill_tokens += int64_t(prompts[size_t(u)]->size());
  }
  std::vector<int64_t> slot_prompt;
  std::vector<int32_t> slot_prompt32;
  for (size_t r : rows) {
    slot_prompt.push_back(prompt_of[r]);
    slot_prompt32.push_back(int32_t(prompt_of[r]));
  }
  const int64_t A0 = int64_t(rows.size());
  KvCache cache;
  Tensor logits = Tensor::empty({A0, V}, DType::F32, dev);
  {
    KvCache prompt_cache(cfg, U, capacity, DType::F32, dev, kv_storage_);
    const Tensor prompt_tokens = Tensor::from_host(host.data(), {U, L_max}, DType::I32, dev);
    const Tensor prompt_logits =
        model_.forward_cached(prompt_tokens, KvBatch{L_max, {KvGroup{0, U, 0}}}, prompt_cache, sr_, last_rows);
    // Every row starts from its prompt's cache and last logits row (copies: the same bits).
    cache = prompt_cache.gather_slots(slot_prompt);
    ops::gather_rows(prompt_logits, Tensor::from_host(slot_prompt32.data(), {A0}, DType::I32, dev), logits);
  }
  stats_.prefill_s += seconds_since(t0, dev);
  // The decode step as a CUDA graph over `cache` as it is (reset when the cache is re-gathered).
  // A batch is captured at its second step: one that changes at every step (sequences stopping
  // one after another) then runs op by op rather than paying a capture each step.
  bool graphs = cuda_graphs_ && dev == Device::CUDA;
  if (graphs && !graph_failure_.empty()) {
    graphs = false;
    if (stats_.graph_error.empty()) stats_.graph_error = graph_failure_;
  }
  if (graphs && !model_.forward_cached_stays_on_device()) {  // a known case, not a failure: no warning
    graphs = false;
    if (stats_.graph_error.empty())
      stats_.graph_error = "the forward reads the MoE routing counts back to the host (FP32 experts, or "
                           "set_moe_routing_waits_deferred(false)): it cannot be recorded";
  }
  std::unique_ptr<DecodeGraph> graph;
  int64_t steps_on_cache = 0;  // decode forwards run over `cache` as it is
  // Draws on the GPU where the rows fit its kernel; else on the host, from the logits read back.
  const bool device_draws = gpu_draws_ && dev == Device::CUDA && V <= ops::kGpuDrawMaxVocab;
  const ops::DrawSpec spec = draw_spec(opt);

  while (true) {
    // ---- the next token of every active row ----
    t0 = Clock::now();
    const int64_t A = int64_t(rows.size());
    std::vector<int32_t> next(static_cast<size_t>(A));
    std::vector<double> sample_lp(static_cast<size_t>(A));
    Tensor targets, losses = Tensor::empty({A}, DType::F32, dev);
    std::shared_ptr<PendingRead> draw_read, loss_read;
    Tensor h;  // the logits on the host: host draws, keep_logits
    // Each row's draw key: (sequence id, the position of the token drawn).
    std::vector<int64_t> keys(static_cast<size_t>(2 * A));
    for (int64_t a = 0; a < A; ++a) {
      keys[size_t(2 * a)] = int64_t(out[rows[size_t(a)]].sequence_id);
      keys[size_t(2 * a + 1)] = len(rows[size_t(a)]) + int64_t(out[rows[size_t(a)]].tokens.size());
    }
    if (opt.keep_logits || !device_draws) h = dev == Device::CPU ? logits : logits.to(Device::CPU);
    if (device_draws) {
      // Drawn where the logits are (ops::draw_tokens, the host's bits): only the tokens and their
      // statuses come back before the next step (one buffer, one copy); the draw log-probs come
      // back with the policy log-probs, behind the next decode forward.
      Tensor drawn = Tensor::empty({2 * A}, DType::I32, dev), draw_lp = Tensor::empty({A}, DType::F64, dev);
      Tensor status = drawn.view(A, {A});
      targets = drawn.view(0, {A});
      ops::draw_tokens(logits, spec, Tensor::from_host(keys.data(), {A, 2}, DType::I64, dev), targets, draw_lp,
                       status);
      ops::cross_entropy(logits, targets, losses, nullptr, 0.0);  // the policy log-probs, as below
      loss_read = read_later(losses.raw(), size_t(A) * sizeof(float));
      draw_read = read_later(draw_lp.raw(), size_t(A) * sizeof(double));
      const Tensor back = drawn.to(Device::CPU);
      for (int64_t a = 0; a < A; ++a) {
        fail_bad_draw(back.data<int32_t>()[A + a], out[rows[size_t(a)]].sequence_id, keys[size_t(2 * a + 1)]);
        next[size_t(a)] = back.data<int32_t>()[a];
      }
    } else {
      // The rows' draws are independent (each its own stream of uniforms): ops::draw_tokens on
      // the host spreads them over the cores.
      Tensor tok = Tensor::empty({A}, DType::I32), lp = Tensor::empty({A}, DType::F64),
             status = Tensor::empty({A}, DType::I32);
      ops::draw_tokens(h, spec, Tensor::from_host(keys.data(), {A, 2}, DType::I64), tok, lp, status);
      for (int64_t a = 0; a < A; ++a) {
        fail_bad_draw(status.data<int32_t>()[a], out[rows[size_t(a)]].sequence_id, keys[size_t(2 * a + 1)]);
        next[size_t(a)] = tok.data<int32_t>()[a];
        sample_lp[size_t(a)] = lp.data<double>()[a];
      }
      // The trainer's per-token loss on this row and token, negated: the same op on the same bits.
      // Read back behind the next decode forward (the finishes do not depend on it), so the GPU
      // does not drain between the two.
      targets = Tensor::from_host(next.data(), {A}, DType::I32, dev);
      ops::cross_entropy(logits, targets, losses, nullptr, 0.0);
      if (dev != Device::CPU) loss_read = read_later(losses.raw(), size_t(A) * sizeof(float));
    }
    for (int64_t a = 0; a < A; ++a) {
      Completion& c = out[rows[size_t(a)]];
      c.tokens.push_back(next[size_t(a)]);
      if (opt.keep_logits) c.logits.insert(c.logits.end(), h.data<float>() + a * V, h.data<float>() + (a + 1) * V);
    }
    std::vector<size_t> keep_rows;
    std::vector<int64_t> keep_slots;
    for (int64_t a = 0; a < A; ++a) {
      const size_t r = rows[size_t(a)];
      Completion& c = out[r];
      const int64_t n = int64_t(c.tokens.size());
      if (next[size_t(a)] == opt.stop_token) c.finish = Finish::Stop;
      else if (n == opt.max_new) c.finish = Finish::Length;
      else if (len(r) + n > cfg.max_seq_len) c.finish = Finish::Context;  // no position left for it
      else {
        keep_rows.push_back(r);
        keep_slots.push_back(a);
      }
    }
    stats_.sampled_tokens += A;
    // host time only: the log-probs' GPU work is counted with the decode forward queued behind it
    stats_.choose_s += std::chrono::duration<double>(Clock::now() - t0).count();

    // ---- one decode forward over the unfinished rows ----
    t0 = Clock::now();
    const bool more = !keep_rows.empty();
    if (more) {
      if (int64_t(keep_rows.size()) < A) {
        graph.reset();                           // it records the cache about to be replaced
        steps_on_cache = 0;
        cache = cache.gather_slots(keep_slots);  // the finished leave (order kept: runs stay runs)
        std::vector<int32_t> kept;
        for (int64_t a : keep_slots) kept.push_back(next[size_t(a)]);
        next = std::move(kept);
      }
      const int64_t An = int64_t(keep_rows.size());
      std::vector<int64_t> positions(static_cast<size_t>(An));
      for (int64_t a = 0; a < An; ++a)  // the input is the token just drawn, at position prompt + tokens - 1
        positions[size_t(a)] = len(keep_rows[size_t(a)]) + int64_t(out[keep_rows[size_t(a)]].tokens.size()) - 1;
      if (graphs && !graph && steps_on_cache >= 1) {
        try {
          graph = std::make_unique<DecodeGraph>(model_, cache, sr_);
          stats_.graph_captures += 1;
        } catch (const std::exception& e) {
          graphs = false;  // this call and later ones decode eagerly from here on
          graph_failure_ = e.what();
          if (stats_.graph_error.empty()) stats_.graph_error = e.what();
          if (!graph_warned_)  // the samples are the same either way; the speed is not
            std::fprintf(stderr, "sampler: the decode step runs op by op, as a CUDA graph capture failed: %s\n", e.what());
          graph_warned_ = true;
        }
      }
      steps_on_cache += 1;
      if (graph) {
        logits = graph->run(next, positions);
        stats_.graph_replays += 1;
      } else {
        KvBatch batch{1, {}};
        for (int64_t a = 0; a < An; ++a) {
          const int64_t pos = positions[size_t(a)];
          if (!batch.groups.empty() && batch.groups.back().pos0 == pos) batch.groups.back().end = a + 1;
          else batch.groups.push_back(KvGroup{a, a + 1, pos});
        }
        const Tensor tokens = Tensor::from_host(next.data(), {An, 1}, DType::I32, dev);
        logits = model_.forward_cached(tokens, batch, cache, sr_);
      }
      stats_.decode_issue_s += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    // the drawn tokens' policy log-probs (their read was queued before the forward)
    const float* loss = loss_read ? static_cast<const float*>(loss_read->wait()) : losses.data<float>();
    const double* drawn_lp = draw_read ? static_cast<const double*>(draw_read->wait()) : sample_lp.data();
    for (int64_t a = 0; a < A; ++a) {
      out[rows[size_t(a)]].logprobs.push_back(-loss[a]);
      out[rows[size_t(a)]].sample_logprobs.push_back(drawn_lp[a]);
    }
    if (!more) break;
    rows = std::move(keep_rows);
    stats_.decode_forwards += 1;
    stats_.decode_s += seconds_since(t0, dev);
  }
  return out;
}

std::vector<Completion> Sampler::sample_groups(const std::vector<std::vector<int32_t>>& prompts, int64_t group,
                                               const SamplingOptions& opt, uint64_t first_id) {
  if (group < 2)
    fail("sampler: a group needs at least 2 samples per prompt (the baseline is the group's mean reward), got {}",
         group);
  std::vector<SampleRequest> requests;
  requests.reserve(prompts.size() * size_t(group));
  for (size_t i = 0; i < prompts.size(); ++i)
    for (int64_t g = 0; g < group; ++g)
      requests.push_back(SampleRequest{prompts[i], first_id + uint64_t(i) * uint64_t(group) + uint64_t(g)});
  return sample(requests, opt);
}

}  // namespace fourbit::rl
