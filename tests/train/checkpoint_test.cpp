// defines: tests of train/checkpoint on its own (no training): every flipped bit of a
//          checkpoint's files is caught on load (tensor checksums, state.json's checksum, the
//          safetensors structure); non-finite weights and moments are refused naming the tensor;
//          loading falls back past a corrupt newest checkpoint with a warning but not past one
//          asked for by name; keep_last keeps exactly the newest N; later checkpoints are set
//          aside, not deleted; temporaries of other processes are removed and ours kept.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "fourbit/model/params.h"
#include "fourbit/train/checkpoint.h"
#include <fmt/format.h>

#include "model/model_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using fourbit::testutil::error_of;
namespace fs = std::filesystem;

namespace {

struct Fixture {
  RunConfig cfg = [] {
    RunConfig c = tiny_run_config(2, 32);
    c.model.d_expert = 32;
    return c;
  }();
  ParamStore params{cfg.model, DType::F32, Device::CPU};
  Tensor m = Tensor::zeros({params.numel()}, DType::F32), v = Tensor::zeros({params.numel()}, DType::F32);
  Fixture() {
    init_params(params, cfg.model, 5);
    for (int64_t i = 0; i < params.numel(); ++i) {
      m.data<float>()[i] = 1e-3f * float(i % 17);
      v.data<float>()[i] = 1e-6f * float(i % 5);
    }
  }
  std::string save(const std::string& run, int64_t step, int64_t keep_last = 0) {
    CheckpointState st{cfg, "mxfp8", step, 5, step * 32, nullptr, nullptr, nlohmann::json::object()};
    return save_checkpoint(run, params, m, v, st, keep_last);
  }
  // Loads dir into fresh buffers (what resume does).
  void load(const std::string& dir) {
    ParamStore p(cfg.model, DType::F32, Device::CPU);
    Tensor mm = Tensor::zeros({p.numel()}, DType::F32), vv = mm.clone();
    read_checkpoint_state(dir);
    load_checkpoint(dir, p, &mm, &vv);
  }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

std::vector<std::string> names(const std::string& run) {
  std::vector<std::string> out;
  for (const auto& [step, dir] : list_checkpoints(run)) out.push_back(fs::path(dir).filename().string());
  return out;
}

}  // namespace

// A flipped bit anywhere in model.safetensors, optim.safetensors or state.json makes the load
// fail: checksums cover each tensor's bytes, the safetensors metadata and the state's content;
// the rest of a header is JSON whose structure, names, dtypes, shapes and offsets are all
// checked, and its padding must be spaces. Tried (a sample, to keep the test fast): every 31st
// byte of each header and every 11th of state.json (one bit each, which one cycling with the
// position), and all 8 bits of 8 bytes spread over each data buffer.
TEST(Checkpoint, AFlippedBitIsCaughtOnLoad) {
  Fixture fx;
  const std::string run = fresh_test_dir("checkpoint_tests") + "/run";
  const std::string dir = fx.save(run, 3);
  fx.load(dir);
  ParamStore p(fx.cfg.model, DType::F32, Device::CPU);
  Tensor mm = Tensor::zeros({p.numel()}, DType::F32), vv = mm.clone();
  for (const std::string file : {"model.safetensors", "optim.safetensors", "state.json"}) {
    const std::string path = dir + "/" + file;
    const std::string good = file_bytes(path);
    auto load = [&] {
      if (file == "state.json") read_checkpoint_state(dir);
      else if (file == "model.safetensors") load_checkpoint(dir, p, nullptr, nullptr);
      else load_checkpoint(dir, p, &mm, &vv);
    };
    std::vector<std::pair<size_t, int>> flips;  // (byte, bit)
    size_t header_end = good.size();
    if (file != "state.json") {
      uint64_t n = 0;
      for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(good[size_t(i)]);
      header_end = 8 + size_t(n);
      const size_t data = good.size() - header_end;
      for (size_t k = 0; k < 8; ++k)
        for (int bit = 0; bit < 8; ++bit) flips.push_back({header_end + k * data / 8 + k, bit});
    }
    const size_t stride = file == "state.json" ? 11 : 31;
    for (size_t byte = 0; byte < header_end; byte += stride) flips.push_back({byte, int(byte % 8)});
    if (file != "state.json") flips.push_back({header_end - 1, 0});  // the padding's last space
    int caught = 0, tried = 0;
    std::string missed;
    for (const auto& [byte, bit] : flips) {
      // 'e' <-> 'E' in a number's exponent ("1e-05") is the one flip that keeps the JSON's
      // meaning: it is not corruption of anything.
      if (file == "state.json" && bit == 5 && (good[byte] | 0x20) == 'e' && byte > 0 &&
          std::isdigit(static_cast<unsigned char>(good[byte - 1])))
        continue;
      ++tried;
      std::string bad = good;
      bad[byte] = char(bad[byte] ^ (1 << bit));
      write_bytes(path, bad);
      try {
        load();
        if (missed.size() < 400) missed += fmt::format(" byte {} bit {} ('{}' -> '{}');", byte, bit, good[byte], bad[byte]);
      } catch (const Error&) {
        ++caught;
      }
    }
    write_bytes(path, good);
    std::printf("  %s: %d of %d single-bit flips caught\n", file.c_str(), caught, tried);
    EXPECT_EQ(caught, tried) << file << " missed:" << missed;
  }
  fx.load(dir);  // restored
}

TEST(Checkpoint, NonFiniteWeightsAreRefusedNamingTheTensor) {
  Fixture fx;
  const std::string run = fresh_test_dir("checkpoint_tests") + "/run";
  const ParamInfo& info = fx.params.info("layers.1.moe.w2");
  fx.params.flat().data<float>()[info.offset + 5] = std::numeric_limits<float>::quiet_NaN();
  const std::string dir = fx.save(run, 1);
  const std::string msg = error_of([&] { fx.load(dir); });
  EXPECT_HAS(msg, "model.safetensors");
  EXPECT_HAS(msg, "'layers.1.moe.w2' holds a non-finite value (nan) at element 5");
  fx.params.flat().data<float>()[info.offset + 5] = 0.0f;
  fx.v.data<float>()[3] = std::numeric_limits<float>::infinity();
  const std::string dir2 = fx.save(run, 2);
  const std::string msg2 = error_of([&] { fx.load(dir2); });
  EXPECT_HAS(msg2, "optim.safetensors");
  EXPECT_HAS(msg2, "'v.");
  EXPECT_HAS(msg2, "non-finite value (inf)");
}

TEST(Checkpoint, FallsBackPastACorruptNewestCheckpoint) {
  Fixture fx;
  const std::string run = fresh_test_dir("checkpoint_tests") + "/run";
  fx.save(run, 1);
  fx.save(run, 2);
  const std::string newest = fx.save(run, 3);
  const std::string model = newest + "/model.safetensors";
  std::string bytes = file_bytes(model);
  bytes[bytes.size() - 3] = char(bytes[bytes.size() - 3] ^ 0x10);  // in the last tensor's data
  write_bytes(model, bytes);
  std::vector<std::string> warnings;
  std::string loaded;
  const std::string used = load_first_valid_checkpoint(run, "", [&](const std::string& d) { fx.load(d); loaded = d; }, &warnings);
  EXPECT_EQ(fs::path(used).filename(), "step-000002");
  EXPECT_EQ(loaded, used);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_HAS(warnings[0], "step-000003/model.safetensors");
  EXPECT_HAS(warnings[0], "fails its checksum");
  EXPECT_HAS(warnings[0], "using step-000002");
  EXPECT_TRUE(file_bytes(model) == bytes) << "the corrupt checkpoint must be left as it is";
  // Asked for by name: no fallback, the error names it.
  EXPECT_HAS(error_of([&] { load_first_valid_checkpoint(run, "step-3", [&](const std::string& d) { fx.load(d); }, nullptr); }),
             "step-000003/model.safetensors");
  EXPECT_EQ(fs::path(load_first_valid_checkpoint(run, "1", [&](const std::string& d) { fx.load(d); }, nullptr)).filename(),
            "step-000001");
  EXPECT_HAS(error_of([&] { load_first_valid_checkpoint(run, "step-9", [](const std::string&) {}, nullptr); }),
             "has no checkpoint step-000009 (it has: step-000001, step-000002, step-000003)");
  EXPECT_HAS(error_of([&] { load_first_valid_checkpoint(run, "latest", [](const std::string&) {}, nullptr); }),
             "checkpoint 'latest': expected step-N or N");
  // Nothing loads: one error listing every failure.
  const std::string msg = error_of([&] {
    load_first_valid_checkpoint(run, "", [](const std::string& d) { fail("{}: unreadable", d); }, nullptr);
  });
  EXPECT_HAS(msg, "no checkpoint can be loaded");
  EXPECT_HAS(msg, "step-000001: unreadable");
  EXPECT_HAS(msg, "step-000003: unreadable");
}

TEST(Checkpoint, KeepLastKeepsExactlyTheNewest) {
  Fixture fx;
  const std::string run = fresh_test_dir("checkpoint_tests") + "/run";
  for (int64_t step = 1; step <= 7; ++step) {
    fx.save(run, step * 10, /*keep_last=*/3);
    const size_t want = size_t(std::min<int64_t>(step, 3));
    ASSERT_EQ(list_checkpoints(run).size(), want) << "after step " << step * 10;
  }
  EXPECT_EQ(names(run), (std::vector<std::string>{"step-000050", "step-000060", "step-000070"}));
  EXPECT_EQ(fs::path(latest_checkpoint(run)).filename(), "step-000070");
  fx.save(run, 80, 0);  // keep_last 0 keeps everything
  EXPECT_EQ(list_checkpoints(run).size(), 4u);
  prune_checkpoints(run, 1);
  EXPECT_EQ(names(run), (std::vector<std::string>{"step-000080"}));
}

TEST(Checkpoint, LaterCheckpointsAreSetAsideAndStaleTemporariesRemoved) {
  Fixture fx;
  const std::string run = fresh_test_dir("checkpoint_tests") + "/run";
  for (int64_t s : {2, 4, 6}) fx.save(run, s);
  const std::string aside = set_aside_checkpoints_after(run, 2);
  ASSERT_FALSE(aside.empty());
  EXPECT_EQ(names(run), (std::vector<std::string>{"step-000002"}));
  EXPECT_TRUE(fs::exists(aside + "/step-000004/model.safetensors"));
  EXPECT_TRUE(fs::exists(aside + "/step-000006/state.json"));
  EXPECT_EQ(set_aside_checkpoints_after(run, 2), "");  // nothing later now

  // A killed writer's leftovers (a pid that is not ours) go; this process's own stay.
  const std::string ck = run + "/checkpoints";
  const long other = 999999999;  // above any pid_max: certainly not a live process of ours
  fs::create_directories(ck + "/.step-000008.tmp-" + std::to_string(other) + "/x");
  write_bytes(ck + "/.latest.tmp-" + std::to_string(other) + "-0-deadbeef", "step-000008\n");
  write_bytes(run + "/.metrics.jsonl.tmp-" + std::to_string(other) + "-3-0badf00d", "{}");
  const std::string mine = ck + "/.step-000010.tmp-" + std::to_string(::getpid());
  fs::create_directories(mine);
  write_bytes(run + "/.notes.tmp", "not a fourbit temporary");
  EXPECT_EQ(remove_stale_temporaries(run), 3);
  EXPECT_TRUE(fs::exists(mine));
  EXPECT_TRUE(fs::exists(run + "/.notes.tmp"));
  EXPECT_FALSE(fs::exists(ck + "/.step-000008.tmp-" + std::to_string(other)));
  EXPECT_EQ(names(run), (std::vector<std::string>{"step-000002"}));
}
