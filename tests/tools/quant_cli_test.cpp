// defines: the QuantCli tests (`fourbit quant`)
// `fourbit quant` end to end: the built CLI is run as a user would run it, its stdout and stderr
// captured. The table and JSON report the figures; --out round-trips through read_safetensors to
// exactly what ops::quantize / ops::dequantize give for the same input; every bad input ends in
// one stderr line and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"
#include "fourbit/io/npy.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "io/io_test_util.h"

using namespace fourbit;
using namespace fourbit::testing_io;

using namespace fourbit::clitest;

namespace {


// Table cells are separated by at least two spaces (labels contain single spaces only).
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  size_t i = line.find_first_not_of(' ');
  while (i != std::string::npos) {
    size_t end = line.find("  ", i);
    out.push_back(line.substr(i, end == std::string::npos ? std::string::npos : end - i));
    i = end == std::string::npos ? end : line.find_first_not_of(' ', end);
  }
  return out;
}

Tensor random_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor x = Tensor::empty({rows, cols}, DType::F32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);
  x.data<float>()[5] = 0.0f;  // exact zeros are never "flushed"
  return x;
}

void expect_bytes_equal(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what << ": " << shape_str(a.shape()) << " vs "
                                  << shape_str(b.shape());
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())), 0) << what;
}

// Runs `--in x.npy --out q.safetensors <flags>` and checks the file against the library.
void check_out_file(const std::string& dir, const Tensor& x, const std::string& flags,
                    const QuantSpec& spec, uint64_t seed,
                    const std::map<std::string, std::string>& meta_expect) {
  SCOPED_TRACE(flags);
  io::write_npy(dir + "/x.npy", x);
  const CliRun r =
      run_cli(dir, "quant --in " + dir + "/x.npy --out " + dir + "/q.safetensors " + flags);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const io::SafetensorsFile f = io::read_safetensors(dir + "/q.safetensors");
  const QTensor q = ops::quantize(x, spec, ops::RngKey{seed, 0});
  const int64_t R = x.size(0), C = x.size(1);
  const bool col = spec.axis == BlockAxis::Col;
  const int64_t sr = col ? C : R, sc = col ? R : C;  // storage rows / cols
  const int64_t code_cols = sc * format_info(spec.fmt).element_bits / 8;

  EXPECT_EQ(f.get("codes").shape(), (Shape{sr, code_cols}));
  EXPECT_EQ(f.get("block_scales").shape(), (Shape{sr, sc / spec.block()}));
  EXPECT_EQ(f.get("dequantized").shape(), (Shape{R, C}));
  EXPECT_EQ(f.get("dequantized").dtype(), DType::F32);
  expect_bytes_equal(f.get("codes"), q.codes, "codes");
  expect_bytes_equal(f.get("block_scales"), q.block_scales, "block_scales");
  expect_bytes_equal(f.get("dequantized"), ops::dequantize(q), "dequantized");
  if (q.outer_scales.defined()) {
    expect_bytes_equal(f.get("outer_scales"), q.outer_scales, "outer_scales");
    EXPECT_EQ(f.get("outer_scales").shape(), (Shape{spec.outer == OuterScale::PerRow ? sr : 1}));
  } else {
    EXPECT_EQ(f.find("outer_scales"), nullptr);
  }
  for (const auto& [k, v] : meta_expect)
    EXPECT_EQ(f.metadata.count(k) ? f.metadata.at(k) : "<absent>", v) << k;
}

}  // namespace

TEST(QuantCli, GenNormalPrintsATableWithEffectiveBits) {
  const std::string dir = test_dir();
  const CliRun r = run_cli(dir, "quant --gen normal --rows 256 --cols 256 --seed 3");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  EXPECT_MSG_HAS(lines[0], "--gen normal", "256 x 256");
  const auto head = cells(lines[1]);
  const std::vector<std::string> want = {"quantizer",   "MSE",       "rel err",       "eff bits",
                                         "max abs err", "flushed %", "4/6 chose 4 %", "bits/value"};
  EXPECT_EQ(head, want);
  const auto row = cells(lines[2]);
  ASSERT_EQ(row.size(), want.size()) << lines[2];
  EXPECT_EQ(row[0], "nvfp4");
  const double eff = std::stod(row[3]);
  EXPECT_GT(eff, 3.3);
  EXPECT_LT(eff, 3.6);
  EXPECT_EQ(row[6], "-");  // Four Over Six is off
}

TEST(QuantCli, JsonReportsNvfp4EffectiveBitsOnNormalData) {
  const std::string dir = test_dir();
  const CliRun r = run_cli(dir, "quant --gen normal --rows 1024 --cols 1024 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  // NUMERICS.md: per-tensor NVFP4 RNE on N(0,1) keeps at least 3.38 effective bits.
  EXPECT_GE(j["eff_bits"].get<double>(), 3.38);
  EXPECT_EQ(j["quantizer"]["format"], "nvfp4");
  EXPECT_EQ(j["input"]["rows"], 1024);
  EXPECT_EQ(j["input"]["generator"], "normal");
  // 4-bit codes + one E4M3 byte per 16 values + one FP32 outer scale.
  EXPECT_DOUBLE_EQ(j["bits_per_value"].get<double>(), (524288.0 + 65536.0 + 4.0) * 8.0 / 1048576.0);
  EXPECT_TRUE(j["four_over_six_chose_four_pct"].is_null());
  for (const char* key : {"mse", "rel_err", "max_abs_err", "flushed_pct"})
    EXPECT_TRUE(j[key].is_number()) << key;

  // Four Over Six on the same data: at least 3.52 effective bits, and some blocks choose 4.
  const CliRun r46 =
      run_cli(dir, "quant --gen normal --rows 1024 --cols 1024 --four-over-six mse --json");
  ASSERT_EQ(r46.status, 0) << r46.err;
  const auto j46 = nlohmann::json::parse(r46.out);
  EXPECT_GE(j46["eff_bits"].get<double>(), 3.52);
  EXPECT_GT(j46["four_over_six_chose_four_pct"].get<double>(), 0.0);
}

TEST(QuantCli, GeneratorsAreSeededAndDistinct) {
  const std::string dir = test_dir();
  auto run = [&](const std::string& args) {
    const CliRun r = run_cli(dir, "quant --rows 64 --cols 64 --json " + args);
    EXPECT_EQ(r.status, 0) << args << ": " << r.err;
    return r.status == 0 ? nlohmann::json::parse(r.out) : nlohmann::json();
  };
  EXPECT_EQ(run("--gen student-t:3 --seed 1"), run("--gen student-t:3 --seed 1"));
  EXPECT_NE(run("--gen student-t:3 --seed 1")["mse"], run("--gen student-t:3 --seed 2")["mse"]);
  EXPECT_NE(run("--gen student-t:2.5")["mse"], run("--gen normal")["mse"]);
  // 0.1% outliers x100 dominate the tensor amax: nvfp4 per-tensor loses accuracy to them.
  EXPECT_GT(run("--gen outliers")["max_abs_err"].get<double>(),
            run("--gen normal")["max_abs_err"].get<double>());
}

TEST(QuantCli, OutFileMatchesTheLibrary) {
  const std::string dir = test_dir();
  const Tensor x = random_matrix(64, 96, 7);
  QuantSpec nv;
  nv.fmt = Format::NVFP4;
  nv.outer = OuterScale::PerRow;
  nv.four_over_six = true;
  check_out_file(dir, x, "--outer row --four-over-six mse --seed 5", nv, 5,
                 {{"format", "nvfp4"},
                  {"block_axis", "row"},
                  {"storage", "row-major"},
                  {"outer", "row"},
                  {"four_over_six", "mse"}});

  QuantSpec nv_tensor;
  nv_tensor.fmt = Format::NVFP4;
  nv_tensor.rounding = num::Rounding::SR;
  nv_tensor.tile_2d = true;
  nv_tensor.hadamard = 16;
  nv_tensor.hadamard_signs = num::kNvidiaRht16Signs;
  check_out_file(dir, x, "--rounding sr --tile-2d --hadamard 16 --seed 9", nv_tensor, 9,
                 {{"rounding", "sr"},
                  {"tile_2d", "true"},
                  {"hadamard", "16"},
                  {"hadamard_signs", "0x0000d7e8"}});

  QuantSpec mx;
  mx.fmt = Format::MXFP8_E4M3;
  mx.axis = BlockAxis::Col;
  mx.rounding = num::Rounding::SR;
  check_out_file(dir, x, "--format mxfp8-e4m3 --block-axis col --rounding sr --seed 11", mx, 11,
                 {{"format", "mxfp8-e4m3"},
                  {"block_axis", "col"},
                  {"storage", "transposed"},
                  {"scale_rule", "rceil"}});

  QuantSpec mx5;
  mx5.fmt = Format::MXFP8_E5M2;
  mx5.mx_rule = num::MxScaleRule::FLOOR;
  check_out_file(dir, x, "--format mxfp8-e5m2 --scale-rule floor", mx5, 0,
                 {{"scale_rule", "floor"}});

  QuantSpec m4;  // MXFP4: one registry row, and fourbit quant takes it
  m4.fmt = Format::MXFP4;
  m4.rounding = num::Rounding::SR;
  m4.axis = BlockAxis::Col;
  check_out_file(dir, x, "--format mxfp4 --rounding sr --block-axis col --seed 6", m4, 6,
                 {{"format", "mxfp4"}, {"block_axis", "col"}, {"scale_rule", "rceil"}, {"rounding", "sr"}});
  QuantSpec m4f;
  m4f.fmt = Format::MXFP4;
  m4f.mx_rule = num::MxScaleRule::FLOOR;
  m4f.hadamard = 32;
  m4f.hadamard_signs = num::rht_signs(2, 0x5248, 32);
  check_out_file(dir, x, "--format mxfp4 --scale-rule floor --hadamard 32 --seed 2", m4f, 2,
                 {{"scale_rule", "floor"}, {"hadamard", "32"}});

  QuantSpec s2;
  s2.fmt = Format::S2F6;
  s2.hadamard = 32;
  s2.hadamard_signs = num::rht_signs(4, 0x5248, 32);
  check_out_file(dir, x, "--format s2f6 --hadamard 32 --seed 4", s2, 4,
                 {{"format", "s2f6"}, {"hadamard", "32"}});
}

TEST(QuantCli, CompareRunsTheStandardSetOneRowEach) {
  const std::string dir = test_dir();
  const CliRun r = run_cli(dir, "quant --gen normal --rows 256 --cols 256 --compare");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<std::string> labels = {
      "nvfp4",         "nvfp4 per-row",     "nvfp4 4/6 mse per-row",
      "nvfp4 4/6 mae", "nvfp4 16x16 tiles", "nvfp4 SR",
      "mxfp8-e4m3",    "mxfp8-e5m2",        "mxfp8-e4m3 floor",
      "mxfp4",         "s2f6",              "s2f6+RHT32"};
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 2 + labels.size()) << r.out;
  for (size_t i = 0; i < labels.size(); ++i) {
    const auto row = cells(lines[2 + i]);
    ASSERT_EQ(row.size(), 8u) << lines[2 + i];
    EXPECT_EQ(row[0], labels[i]);
    const bool fos = labels[i].find("4/6") != std::string::npos;
    EXPECT_EQ(row[6] == "-", !fos) << lines[2 + i];
  }
  const CliRun rj = run_cli(dir, "quant --gen normal --rows 256 --cols 256 --compare --json");
  ASSERT_EQ(rj.status, 0) << rj.err;
  const auto j = nlohmann::json::parse(rj.out);
  ASSERT_EQ(j["results"].size(), labels.size());
  for (size_t i = 0; i < labels.size(); ++i)
    EXPECT_EQ(j["results"][i]["quantizer"]["label"], labels[i]);
  // 8-bit formats are more accurate than 4-bit ones; the RHT does not hurt s2f6 on Gaussian data
  // much.
  EXPECT_GT(j["results"][6]["eff_bits"].get<double>(),
            j["results"][0]["eff_bits"].get<double>() + 1.0);
}

TEST(QuantCli, BadInputGivesOneErrorLineAndNonZeroExit) {
  const std::string dir = test_dir();
  const std::string gen = "--gen normal --rows 32 --cols 64 ";
  io::write_npy(dir + "/vec.npy", random_matrix(4, 16, 1).reshape({64}));
  Tensor ints = Tensor::zeros({4, 16}, DType::I32);
  io::write_npy(dir + "/ints.npy", ints);
  Tensor dbl = Tensor::zeros({4, 16}, DType::F64);
  io::write_npy(dir + "/dbl.npy", dbl);
  Tensor nan = random_matrix(4, 32, 2);
  nan.data<float>()[3] = std::nanf("");
  nan.data<float>()[40] = INFINITY;
  io::write_npy(dir + "/nan.npy", nan);
  io::write_npy(dir + "/ok.npy", random_matrix(4, 32, 3));

  struct Case {
    std::string args;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"--in " + dir + "/missing.npy", {"missing.npy", "no such file"}},
      {"--in " + dir + "/vec.npy", {"vec.npy", "expected a 2-D float32 array", "shape [64]"}},
      {"--in " + dir + "/ints.npy", {"ints.npy", "got dtype '<i4'"}},
      {"--in " + dir + "/dbl.npy", {"dbl.npy", "got dtype '<f8'"}},
      {"--in " + dir + "/nan.npy", {"nan.npy", "input has 2 non-finite values (NaN/Inf)"}},
      {"--gen normal --rows 4 --cols 24", {"cols = 24", "not a multiple of the 16-value block"}},
      {"--gen normal --rows 24 --cols 32 --block-axis col", {"rows = 24", "--block-axis col"}},
      {"--gen normal --rows 4 --cols 48 --format mxfp8-e4m3", {"cols = 48", "32-value block"}},
      {"--gen normal --rows 4 --cols 48 --compare", {"cols = 48", "32-value block"}},
      {gen + "--format nvfp5", {"--format", "nvfp5"}},
      {gen + "--outer bogus", {"--outer"}},
      {gen + "--four-over-six yes", {"--four-over-six"}},
      {gen + "--rounding up", {"--rounding"}},
      {gen + "--scale-rule ceil", {"--scale-rule"}},
      {gen + "--block-axis diag", {"--block-axis"}},
      {gen + "--hadamard 8", {"--hadamard"}},
      {gen + "--device tpu", {"--device"}},
      {"--gen uniform --rows 4 --cols 32", {"--gen", "uniform"}},
      {"--gen student-t:0 --rows 4 --cols 32", {"--gen", "student-t:0"}},
      {"--gen student-t: --rows 4 --cols 32", {"--gen"}},
      {"--in " + dir + "/ok.npy --gen normal --rows 4 --cols 32", {"--in", "--gen"}},
      {"", {"--in", "--gen"}},
      {"--rows 4 --cols 32", {"--in", "--gen"}},
      {"--gen normal --rows 0 --cols 32", {"--rows", "positive"}},
      {"--gen normal --rows 4 --cols -32", {"--cols"}},
      {"--gen normal --rows 4", {"--cols"}},
      {"--in " + dir + "/ok.npy --rows 4", {"--rows", "own shape"}},
      {gen + "--format mxfp8-e4m3 --four-over-six mse", {"--four-over-six", "nvfp4 only"}},
      {gen + "--format mxfp8-e5m2 --tile-2d", {"--tile-2d"}},
      {gen + "--format s2f6 --outer row", {"--outer"}},
      {gen + "--format nvfp4 --scale-rule floor", {"--scale-rule"}},
      {gen + "--format mxfp4 --outer row", {"--outer", "nvfp4 only", "mxfp4"}},
      {gen + "--format mxfp4 --four-over-six mae", {"--four-over-six", "mxfp4"}},
      {"--gen normal --rows 4 --cols 48 --format mxfp4", {"cols = 48", "32-value block"}},
      {gen + "--format s2f6 --rounding sr", {"--rounding sr", "s2f6"}},
      {gen + "--hadamard 32", {"--hadamard 32", "16-value blocks"}},
      {gen + "--compare --format nvfp4", {"--compare", "--format"}},
      {gen + "--compare --out " + dir + "/c.safetensors", {"--out", "--compare"}},
      {gen + "--no-such-flag", {"--no-such-flag"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const CliRun r = run_cli(dir, "quant " + c.args);
    EXPECT_NE(r.status, 0);
    EXPECT_EQ(r.out, "");
    const auto err_lines = lines_of(r.err);
    ASSERT_EQ(err_lines.size(), 1u) << r.err;
    EXPECT_EQ(err_lines[0].rfind("fourbit: error: ", 0), 0u) << r.err;
    for (const std::string& w : c.words) EXPECT_MSG_HAS(r.err, w);
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/c.safetensors"));

  if (cuda_device_count() == 0) {
    const CliRun r = run_cli(dir, "quant " + gen + "--device cuda");
    EXPECT_NE(r.status, 0);
    EXPECT_EQ(lines_of(r.err).size(), 1u) << r.err;
    EXPECT_MSG_HAS(r.err, "no CUDA device");
  }
}

TEST(QuantCli, HelpDocumentsTheGenerators) {
  const std::string dir = test_dir();
  const CliRun r = run_cli(dir, "quant --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_MSG_HAS(r.out, "--gen", "student-t:NU", "mt19937_64", "Box-Muller", "outliers",
                 "--four-over-six", "eff bits");
}
