// defines: MainLoop, DecodeTile, kDecodeWidths, TrainingTile, randn_cuda, bytes
// What the grouped-kernel tests share (CUDA builds only).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::optest {

// An F32 CUDA tensor of N(0, scale^2) values from seed.
inline Tensor randn_cuda(const Shape& s, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g) * scale;
  return Tensor::from_host(v.data(), s, DType::F32, Device::CUDA);
}

// A tensor's bytes, on the host.
inline std::vector<uint8_t> bytes(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  const auto* p = static_cast<const uint8_t*>(h.raw());
  return {p, p + h.nbytes()};
}

// Runs the grouped kernel's wgmma (Hopper) or mma.sync main loop in its scope (on GPUs other than
// Hopper both are the mma.sync one), naming it in failures.
struct MainLoop {
  explicit MainLoop(bool wgmma) : trace(__FILE__, __LINE__, wgmma ? "wgmma main loop" : "mma.sync main loop") {
    ops::cuda::set_grouped_wgmma(wgmma);
  }
  ~MainLoop() { ops::cuda::set_grouped_wgmma(true); }
  MainLoop(const MainLoop&) = delete;
  MainLoop& operator=(const MainLoop&) = delete;
  testing::ScopedTrace trace;
};

// The Hopper loop's decode configuration for the scope (set_grouped_decode_width): 0 chosen per
// call, 16 the streaming kernel, 32 or 128 columns, or -1 for the 64 x 256 tile of two warpgroups.
struct DecodeTile {
  explicit DecodeTile(int width) : trace(__FILE__, __LINE__, "decode tile width " + std::to_string(width)) {
    ops::cuda::set_grouped_decode_width(width);
  }
  ~DecodeTile() { ops::cuda::set_grouped_decode_width(0); }
  DecodeTile(const DecodeTile&) = delete;
  DecodeTile& operator=(const DecodeTile&) = delete;
  testing::ScopedTrace trace;
};
inline constexpr int kDecodeWidths[] = {0, -1, 16, 32, 128};

// Groups of more than 64 rows on the 256 x 128 training tile in the scope, also where its tiles
// would number fewer than the SMs (set_grouped_narrow_tiles(false)): the reference the other
// configurations' bits are checked against.
struct TrainingTile {
  TrainingTile() { ops::cuda::set_grouped_narrow_tiles(false); }
  ~TrainingTile() { ops::cuda::set_grouped_narrow_tiles(true); }
  TrainingTile(const TrainingTile&) = delete;
  TrainingTile& operator=(const TrainingTile&) = delete;
};

// The row-grouped TMA form's tile for the scope, whatever K: 256 (128 x 256), 128 (256 x 128), or
// kPingPongTile (the ping-pong form's 128 x 128, set_grouped_tma_pingpong: the default where K <=
// 4096); the settings found are restored at its end.
inline constexpr int kPingPongTile = -1;
inline constexpr int kTmaTiles[] = {256, 128, kPingPongTile};
inline std::string tma_tile_name(int tile) {
  return tile == kPingPongTile ? "ping-pong 128 x 128" : "tile n " + std::to_string(tile);
}
struct TmaTile {
  explicit TmaTile(int tile)
      : tile_before(ops::cuda::set_grouped_tma_tile(tile == kPingPongTile ? 256 : tile)),
        pingpong_before(ops::cuda::set_grouped_tma_pingpong(tile == kPingPongTile ? 1 << 30 : 0)) {}
  ~TmaTile() {
    ops::cuda::set_grouped_tma_tile(tile_before);
    ops::cuda::set_grouped_tma_pingpong(pingpong_before);
  }
  TmaTile(const TmaTile&) = delete;
  TmaTile& operator=(const TmaTile&) = delete;
  int tile_before;
  int pingpong_before;
};

}  // namespace fourbit::optest
