// defines: add_quant_command (`fourbit quant`)
// Quantizes one matrix (from a .npy file or a seeded generator) with one quantizer, or with the
// standard comparison set, and prints the error measures as a table or JSON; optionally writes the
// QTensor's bytes and the dequantized matrix to a safetensors file. Usage: docs/cli-quant.md.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fourbit/io/npy.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "tools/fourbit/commands.h"
#include "tools/fourbit/quant_gen.h"
#include "tools/fourbit/quant_stats.h"

namespace fourbit::cli {
namespace {

using Json = nlohmann::ordered_json;  // keys print in the order written

// The stream of num::rht_signs for the sign vectors of --hadamard ("RH" in ASCII).
constexpr uint64_t kRhtSignStream = 0x5248;
// Larger inputs than this are refused rather than attempted (16 GiB of float32).
constexpr int64_t kMaxValues = int64_t(1) << 32;

struct QuantOptions {
  std::string in, gen, out, device = "cpu";
  int64_t rows = 0, cols = 0;
  uint64_t seed = 0;
  std::string format = "nvfp4", outer = "tensor", four_over_six = "off", rounding = "rne",
              block_axis = "row", scale_rule = "rceil";
  int hadamard = 0;
  bool tile_2d = false, json = false, compare = false;
  // Set by add_quant_command so run_quant can tell flags the user gave from defaults.
  std::map<std::string, const CLI::Option*> given;
  bool was_given(const std::string& flag) const { return given.at(flag)->count() > 0; }
};

struct Input {
  Tensor x;          // F32 [rows, cols] on the CPU
  std::string name;  // what errors call it: the .npy path, or "--gen normal"
  Json description;
};

struct NamedSpec {
  std::string label;
  QuantSpec spec;
};

struct Result {
  NamedSpec quantizer;
  QTensor q;    // on the CPU
  Tensor xhat;  // F32 [rows, cols] on the CPU, the RHT undone
  QuantStats stats;
};

uint32_t rht_signs_for(int n, uint64_t seed) {
  if (n == 0) return 0;
  return n == 16 ? num::kNvidiaRht16Signs : num::rht_signs(seed, kRhtSignStream, n);
}

// ---- input --------------------------------------------------------------------------------------

Input load_npy(const std::string& path) {
  const io::NpyHeader h = io::read_npy_header(path);
  if (h.descr != "<f4" || h.shape.size() != 2)
    fail("{}: expected a 2-D float32 array ('<f4'), got dtype '{}' with shape {}", path, h.descr,
         shape_str(h.shape));
  if (h.shape[0] == 0 || h.shape[1] == 0)
    fail("{}: the array is empty (shape {})", path, shape_str(h.shape));
  if (h.shape[0] * h.shape[1] > kMaxValues)
    fail("{}: {} values is more than fourbit quant handles ({})", path, h.shape[0] * h.shape[1],
         kMaxValues);
  Input in{io::read_npy(path), path, {}};
  in.description = {{"source", path}};
  return in;
}

Input make_input(const QuantOptions& o) {
  if (!o.in.empty() && !o.gen.empty()) fail("give either --in or --gen, not both");
  if (o.in.empty() && o.gen.empty())
    fail(
        "no input: give --in X.npy (2-D float32) or --gen normal|student-t:NU|outliers with --rows "
        "and --cols");
  Input in;
  if (!o.in.empty()) {
    for (const char* flag : {"--rows", "--cols"})
      if (o.was_given(flag))
        fail("{} sets the size of a --gen matrix; --in {} has its own shape", flag, o.in);
    in = load_npy(o.in);
  } else {
    for (const char* flag : {"--rows", "--cols"})
      if (!o.was_given(flag)) fail("--gen {} needs {} (and both --rows and --cols)", o.gen, flag);
    if (o.rows > kMaxValues / o.cols)
      fail("--rows {} x --cols {} is more values than fourbit quant handles ({})", o.rows, o.cols,
           kMaxValues);
    const auto spec = parse_gen_spec(o.gen);
    FOURBIT_CHECK(spec, "--gen '{}' passed the validator but does not parse", o.gen);
    in.x = generate_matrix(*spec, o.rows, o.cols, o.seed);
    in.name = "--gen " + o.gen;
    in.description = {{"source", "gen"}, {"generator", o.gen}, {"seed", o.seed}};
  }
  in.description["rows"] = in.x.size(0);
  in.description["cols"] = in.x.size(1);
  // Counted here rather than from QuantReport, whose count is of the rotated values under an RHT
  // (one NaN spreads over its whole chunk).
  int64_t nonfinite = 0;
  const float* x = in.x.data<float>();
  for (int64_t i = 0; i < in.x.numel(); ++i) nonfinite += std::isfinite(x[i]) ? 0 : 1;
  if (nonfinite)
    fail("{}: input has {} non-finite values (NaN/Inf); quantizers do not map them silently",
         in.name, nonfinite);
  return in;
}

// ---- quantizers ---------------------------------------------------------------------------------

// A table row's label: "nvfp4 per-row 4/6 mse SR+RHT16 col-blocks".
std::string label_of(const QuantSpec& s) {
  std::string d(format_name(s.fmt));
  if (s.fmt == Format::NVFP4)
    d += s.outer == OuterScale::PerRow ? " per-row"
         : s.outer == OuterScale::None ? " no-outer"
                                       : "";
  if (s.four_over_six) d += s.metric == num::ScaleMetric::MSE ? " 4/6 mse" : " 4/6 mae";
  if (s.tile_2d) d += " 16x16 tiles";
  if (s.mx_rule == num::MxScaleRule::FLOOR) d += " floor";
  if (s.rounding == num::Rounding::SR) d += " SR";
  if (s.hadamard) d += fmt::format("+RHT{}", s.hadamard);
  if (s.axis == BlockAxis::Col) d += " col-blocks";
  return d;
}

// The block formats that take a QuantSpec field, for messages: "mxfp8-e4m3, mxfp8-e5m2 and mxfp4".
std::string formats_taking(SpecField field) {
  std::vector<std::string> names;
  for (Format f : quantized_formats())
    if (format_info(f).fields & field) names.emplace_back(format_name(f));
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

// The flags as a QuantSpec. Flags that do not apply to the format (the registry's row says which
// fields it takes) are refused by name; the registry's validate() checks the rest.
QuantSpec spec_from_flags(const QuantOptions& o) {
  QuantSpec s;
  s.fmt = *parse_format(o.format);
  const FormatInfo& f = format_info(s.fmt);
  auto refuse = [&](SpecField field, bool given, const char* flag) {
    if (given && !(f.fields & field))
      fail("{} applies to {} only, not {}", flag, formats_taking(field), o.format);
  };
  refuse(kFieldOuter, o.was_given("--outer"), "--outer");
  refuse(kFieldFourOverSix, o.four_over_six != "off", "--four-over-six");
  refuse(kFieldTile2d, o.tile_2d, "--tile-2d (16x16 scale tiles)");
  refuse(kFieldMxRule, o.was_given("--scale-rule"), "--scale-rule");
  if (o.rounding == "sr" && !f.sr) fail("--rounding sr: {} supports round-to-nearest-even only", o.format);
  s.axis = o.block_axis == "col" ? BlockAxis::Col : BlockAxis::Row;
  s.outer = !(f.fields & kFieldOuter) ? OuterScale::None
            : o.outer == "row"        ? OuterScale::PerRow
            : o.outer == "none"       ? OuterScale::None
                                      : OuterScale::Tensor;
  s.rounding = o.rounding == "sr" ? num::Rounding::SR : num::Rounding::RNE;
  s.four_over_six = o.four_over_six != "off";
  s.metric = o.four_over_six == "mae" ? num::ScaleMetric::MAE : num::ScaleMetric::MSE;
  s.mx_rule = o.scale_rule == "floor" ? num::MxScaleRule::FLOOR : num::MxScaleRule::RCEIL;
  s.hadamard = o.hadamard;
  s.hadamard_signs = rht_signs_for(o.hadamard, o.seed);
  s.tile_2d = o.tile_2d;
  if (const std::string err = validate(s); !err.empty()) {
    if (s.hadamard) fail("--hadamard {}: {}", s.hadamard, err);
    fail("{}", err);
  }
  return s;
}

// The standard comparison set of --compare, one table row each.
std::vector<NamedSpec> compare_set(BlockAxis axis, uint64_t seed) {
  auto make = [axis](Format f) {
    QuantSpec s;
    s.fmt = f;
    s.axis = axis;
    s.outer = f == Format::NVFP4 ? OuterScale::Tensor : OuterScale::None;
    return s;
  };
  std::vector<NamedSpec> set;
  set.push_back({"nvfp4", make(Format::NVFP4)});
  set.push_back({"nvfp4 per-row", make(Format::NVFP4)});
  set.back().spec.outer = OuterScale::PerRow;
  set.push_back({"nvfp4 4/6 mse per-row", make(Format::NVFP4)});
  set.back().spec.outer = OuterScale::PerRow;
  set.back().spec.four_over_six = true;
  set.push_back({"nvfp4 4/6 mae", make(Format::NVFP4)});
  set.back().spec.four_over_six = true;
  set.back().spec.metric = num::ScaleMetric::MAE;
  set.push_back({"nvfp4 16x16 tiles", make(Format::NVFP4)});
  set.back().spec.tile_2d = true;
  set.push_back({"nvfp4 SR", make(Format::NVFP4)});
  set.back().spec.rounding = num::Rounding::SR;
  set.push_back({"mxfp8-e4m3", make(Format::MXFP8_E4M3)});
  set.push_back({"mxfp8-e5m2", make(Format::MXFP8_E5M2)});
  set.push_back({"mxfp8-e4m3 floor", make(Format::MXFP8_E4M3)});
  set.back().spec.mx_rule = num::MxScaleRule::FLOOR;
  set.push_back({"mxfp4", make(Format::MXFP4)});
  set.push_back({"s2f6", make(Format::S2F6)});
  set.push_back({"s2f6+RHT32", make(Format::S2F6)});
  set.back().spec.hadamard = 32;
  set.back().spec.hadamard_signs = rht_signs_for(32, seed);
  return set;
}

// The library pads partial blocks, but a padded block's error is not the format's: the command
// measures whole blocks only.
void check_whole_blocks(const Input& in, const NamedSpec& q) {
  const bool row = q.spec.axis == BlockAxis::Row;
  const int64_t along = row ? in.x.size(1) : in.x.size(0);
  if (along % q.spec.block() != 0)
    fail(
        "{}: {} = {} is not a multiple of the {}-value block of {} (--block-axis {}); fourbit "
        "quant needs whole blocks",
        in.name, row ? "cols" : "rows", along, q.spec.block(), q.label, row ? "row" : "col");
}

Result run_quantizer(const Input& in, const NamedSpec& q, Device device, uint64_t seed) {
  Result r;
  r.quantizer = q;
  ops::QuantReport report;
  const ops::RngKey rng{seed, 0};
  if (device == Device::CPU) {
    r.q = ops::quantize(in.x, q.spec, rng, &report);
    r.xhat = ops::dequantize(r.q);
  } else {
    const QTensor qd = ops::quantize(in.x.to(device), q.spec, rng, &report);
    r.xhat = ops::dequantize(qd).to(Device::CPU);
    r.q = qd.to(Device::CPU);
  }
  if (report.nonfinite > 0)
    fail("{}: input has {} non-finite values (NaN/Inf); quantizers do not map them silently",
         in.name, report.nonfinite);
  r.stats = quant_stats(in.x, r.xhat, r.q, report, q.spec.four_over_six);
  return r;
}

// ---- output -------------------------------------------------------------------------------------

Json spec_json(const NamedSpec& q, uint64_t seed) {
  const QuantSpec& s = q.spec;
  Json j = {{"label", q.label},
            {"format", std::string(format_name(s.fmt))},
            {"block", s.block()},
            {"block_axis", s.axis == BlockAxis::Row ? "row" : "col"},
            {"rounding", s.rounding == num::Rounding::SR ? "sr" : "rne"},
            {"hadamard", s.hadamard}};
  const uint8_t fields = format_info(s.fmt).fields;  // the fields this format takes
  if (fields & kFieldOuter)
    j["outer"] = s.outer == OuterScale::PerRow ? "row"
                 : s.outer == OuterScale::None ? "none"
                                               : "tensor";
  if (fields & kFieldFourOverSix)
    j["four_over_six"] = !s.four_over_six                    ? "off"
                         : s.metric == num::ScaleMetric::MSE ? "mse"
                                                             : "mae";
  if (fields & kFieldTile2d) j["tile_2d"] = s.tile_2d;
  if (fields & kFieldMxRule) j["scale_rule"] = s.mx_rule == num::MxScaleRule::FLOOR ? "floor" : "rceil";
  if (s.hadamard) j["hadamard_signs"] = fmt::format("{:#010x}", s.hadamard_signs);
  if (s.rounding == num::Rounding::SR) j["seed"] = seed;
  return j;
}

// Non-finite figures (eff bits of an exact result) come out as JSON null.
Json result_json(const Result& r, uint64_t seed) {
  auto num = [](double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); };
  const QuantStats& s = r.stats;
  return {{"quantizer", spec_json(r.quantizer, seed)},
          {"values", s.values},
          {"mse", num(s.mse)},
          {"rel_err", num(s.rel_err)},
          {"eff_bits", num(s.eff_bits)},
          {"max_abs_err", num(s.max_abs_err)},
          {"flushed_pct", num(s.flushed_pct)},
          {"four_over_six_chose_four_pct",
           s.chose_four_pct < 0 ? Json(nullptr) : num(s.chose_four_pct)},
          {"bits_per_value", num(s.bits_per_value)}};
}

void print_table(const Input& in, const std::vector<Result>& results) {
  size_t w = std::string("quantizer").size();
  for (const Result& r : results) w = std::max(w, r.quantizer.label.size());
  std::string source = in.description.value("source", "");
  if (source == "gen")
    source = fmt::format("--gen {} --seed {}", in.description.value("generator", ""),
                         in.description.value("seed", uint64_t(0)));
  fmt::print("input: {}, {} x {} ({} values)\n", source, in.x.size(0), in.x.size(1), in.x.numel());
  fmt::print("{:<{}}  {:>10}  {:>10}  {:>8}  {:>11}  {:>9}  {:>13}  {:>10}\n", "quantizer", w,
             "MSE", "rel err", "eff bits", "max abs err", "flushed %", "4/6 chose 4 %",
             "bits/value");
  for (const Result& r : results) {
    const QuantStats& s = r.stats;
    const std::string four = s.chose_four_pct < 0 ? "-" : fmt::format("{:.2f}", s.chose_four_pct);
    fmt::print("{:<{}}  {:>10.3e}  {:>10.3e}  {:>8.3f}  {:>11.3e}  {:>9.4f}  {:>13}  {:>10.3f}\n",
               r.quantizer.label, w, s.mse, s.rel_err, s.eff_bits, s.max_abs_err, s.flushed_pct,
               four, s.bits_per_value);
  }
}

// --out: the QTensor's three buffers plus the dequantized matrix, and how to read them.
void write_result(const std::string& path, const Input& in, const Result& r, uint64_t seed) {
  const QuantSpec& s = r.quantizer.spec;
  const bool col = s.axis == BlockAxis::Col;
  std::vector<std::pair<std::string, Tensor>> tensors = {{"codes", r.q.codes},
                                                         {"block_scales", r.q.block_scales}};
  if (r.q.outer_scales.defined()) tensors.emplace_back("outer_scales", r.q.outer_scales);
  tensors.emplace_back("dequantized", r.xhat);

  std::map<std::string, std::string> meta;
  const Json spec = spec_json(r.quantizer, seed);
  for (const auto& [k, v] : spec.items()) meta[k] = v.is_string() ? v.get<std::string>() : v.dump();
  meta["writer"] = "fourbit quant";
  meta["rows"] = std::to_string(in.x.size(0));
  meta["cols"] = std::to_string(in.x.size(1));
  meta["input"] = in.description.dump();
  meta["storage"] = col ? "transposed" : "row-major";
  const std::string storage_shape = col ? "[cols, rows]" : "[rows, cols]";
  const FormatInfo& f = format_info(s.fmt);  // the registry's byte layout
  meta["codes"] = std::string(f.codes_layout) + "; storage " + storage_shape;
  meta["block_scales"] = std::string(f.scales_layout);
  if (r.q.outer_scales.defined()) meta["outer_scales"] = std::string(f.outer_layout);
  meta["dequantized"] = std::string("F32 [rows, cols] in the input's layout") +
                        (s.hadamard ? ", the inverse RHT applied" : "");
  io::write_safetensors(path, tensors, meta);
}

// ---- the command --------------------------------------------------------------------------------

void run_quant(const QuantOptions& o) {
  if (o.compare) {
    for (const char* flag : {"--format", "--outer", "--four-over-six", "--rounding", "--scale-rule",
                             "--hadamard", "--tile-2d"})
      if (o.was_given(flag)) fail("--compare runs a fixed set of quantizers; drop {}", flag);
    if (!o.out.empty())
      fail("--out writes one quantizer's result; it cannot be combined with --compare");
  }
  const Device device = parse_device(o.device);

  std::vector<NamedSpec> quantizers;
  if (o.compare) {
    quantizers = compare_set(o.block_axis == "col" ? BlockAxis::Col : BlockAxis::Row, o.seed);
  } else {
    const QuantSpec spec = spec_from_flags(o);
    quantizers.push_back({label_of(spec), spec});
  }
  const Input in = make_input(o);
  for (const NamedSpec& q : quantizers) check_whole_blocks(in, q);

  std::vector<Result> results;
  for (const NamedSpec& q : quantizers) results.push_back(run_quantizer(in, q, device, o.seed));

  if (!o.out.empty()) write_result(o.out, in, results.front(), o.seed);
  if (o.json) {
    Json j;
    if (o.compare) {
      j = {{"input", in.description}, {"results", Json::array()}};
      for (const Result& r : results) j["results"].push_back(result_json(r, o.seed));
    } else {
      j = {{"input", in.description}};
      j.update(result_json(results.front(), o.seed));
    }
    fmt::print("{}\n", j.dump(2));
  } else {
    print_table(in, results);
    if (!o.out.empty()) fmt::print("wrote {}\n", o.out);
  }
}

CLI::Validator gen_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        return parse_gen_spec(s)
                   ? ""
                   : "expected normal, student-t:NU (NU > 0) or outliers, got '" + s + "'";
      },
      "normal|student-t:NU|outliers");
}

CLI::Validator positive_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        return ec == std::errc() && end == s.data() + s.size() && v > 0
                   ? ""
                   : "expected a positive integer, got '" + s + "'";
      },
      "POSITIVE");
}

}  // namespace

void add_quant_command(CLI::App& app) {
  auto o = std::make_shared<QuantOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quant",
      "Quantize one matrix and measure the error: one quantizer, or --compare a standard set");
  cmd->footer(
      std::string("\n") + kGenHelp +
      "\n\nTable columns: MSE = mean (x - xhat)^2; rel err = ||x - xhat|| / ||x||; eff bits ="
      "\n  -log2(MSE / mean x^2) / 2; max abs err; flushed % = nonzero x decoded as 0;"
      "\n  4/6 chose 4 % = blocks where Four Over Six kept the 1.5x scale; bits/value ="
      "\n  (codes + block scales + outer scales) bytes * 8 / values. See docs/cli-quant.md.");

  auto& g = o->given;
  g["--in"] = cmd->add_option("--in", o->in, "input: a 2-D float32 (<f4) C-order .npy file")
                  ->type_name("X.npy");
  g["--gen"] = cmd->add_option("--gen", o->gen, "input: a generated matrix (see below)")
                   ->type_name("KIND")
                   ->check(gen_validator());
  g["--rows"] =
      cmd->add_option("--rows", o->rows, "rows of the --gen matrix")->check(positive_validator());
  g["--cols"] =
      cmd->add_option("--cols", o->cols, "cols of the --gen matrix")->check(positive_validator());
  g["--seed"] = cmd->add_option("--seed", o->seed, "seed of --gen, of SR and of the RHT signs")
                    ->capture_default_str();
  std::vector<std::string> block_formats;  // the registry's quantized rows
  std::string format_help = "block format:";
  for (Format f : quantized_formats()) {
    block_formats.emplace_back(format_name(f));
    format_help += fmt::format("\n  {}: {}", format_name(f), format_info(f).summary);
  }
  g["--format"] = cmd->add_option("--format", o->format, format_help)
                      ->check(CLI::IsMember(block_formats))
                      ->capture_default_str();
  g["--outer"] = cmd->add_option("--outer", o->outer,
                                 "nvfp4 FP32 outer scale: one per tensor, per row, or none")
                     ->check(CLI::IsMember({"tensor", "row", "none"}))
                     ->capture_default_str();
  g["--four-over-six"] =
      cmd->add_option("--four-over-six", o->four_over_six,
                      "nvfp4 Four Over Six block scales, choosing by squared or absolute error")
          ->check(CLI::IsMember({"off", "mse", "mae"}))
          ->capture_default_str();
  g["--rounding"] =
      cmd->add_option("--rounding", o->rounding, "element rounding: nearest-even or stochastic")
          ->check(CLI::IsMember({"rne", "sr"}))
          ->capture_default_str();
  g["--scale-rule"] = cmd->add_option("--scale-rule", o->scale_rule,
                                      "MX UE8M0 scale: round up (rceil) or OCP floor")
                          ->check(CLI::IsMember({"rceil", "floor"}))
                          ->capture_default_str();
  g["--block-axis"] =
      cmd->add_option("--block-axis", o->block_axis,
                      "blocks run along rows (row) or down columns (col, stored transposed)")
          ->check(CLI::IsMember({"row", "col"}))
          ->capture_default_str();
  g["--hadamard"] =
      cmd->add_option("--hadamard", o->hadamard,
                      "random Hadamard transform size before quantizing (16: NVIDIA's fixed signs)")
          ->check(CLI::IsMember({0, 16, 32}))
          ->capture_default_str();
  g["--tile-2d"] =
      cmd->add_flag("--tile-2d", o->tile_2d, "nvfp4 16x16 scale tiles (NVIDIA's weight recipe)");
  g["--compare"] =
      cmd->add_flag("--compare", o->compare, "run the standard set of quantizers side by side");
  g["--json"] = cmd->add_flag("--json", o->json, "print one JSON object instead of the table");
  g["--out"] = cmd->add_option("--out", o->out,
                               "write codes, scales and the dequantized matrix (.safetensors)")
                   ->type_name("F.safetensors");
  g["--device"] = cmd->add_option("--device", o->device, "where to quantize")
                      ->check(CLI::IsMember({"cpu", "cuda"}))
                      ->capture_default_str();
  add_threads_option(cmd);
  cmd->callback([o] { run_quant(*o); });
}

}  // namespace fourbit::cli
