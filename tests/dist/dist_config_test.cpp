// defines: the DistConfig tests: the [dist] section of a run config (ep, dp) parses, validates what
// the file alone decides (positive, ep divides n_experts), round-trips through JSON, and run
// directories written before it existed still load as one process.
#include <gtest/gtest.h>

#include <string>

#include <fmt/format.h>

#include "fourbit/model/config.h"
#include "test_util.h"

using namespace fourbit;

namespace {

const char* kModel = "[model]\nn_experts = 8\n";

TEST(DistConfig, ParsesAndValidates) {
  const RunConfig c = parse_config(fmt::format("{}[dist]\nep = 4\ndp = 2\n", kModel), "x.toml");
  EXPECT_EQ(c.dist.ep, 4);
  EXPECT_EQ(c.dist.dp, 2);
  const RunConfig d = parse_config(kModel, "x.toml");
  EXPECT_EQ(d.dist.ep, 1);  // one process unless said otherwise
  EXPECT_EQ(d.dist.dp, 1);
  using testutil::error_of;
  EXPECT_NE(error_of([] { parse_config(fmt::format("{}[dist]\nep = 3\n", kModel), "x.toml"); })
                .find("x.toml:4: dist.ep (3) must divide model.n_experts (8, x.toml:2)"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_config(fmt::format("{}[dist]\ndp = 0\n", kModel), "x.toml"); })
                .find("dist.dp must be positive"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_config(fmt::format("{}[dist]\ntp = 2\n", kModel), "x.toml"); })
                .find("unknown field (known in [dist]: dp, ep)"),
            std::string::npos);
}

TEST(DistConfig, RoundTripsAndOldRunsLoad) {
  const RunConfig c = parse_config(fmt::format("{}[dist]\nep = 2\n", kModel), "x.toml");
  nlohmann::json j = config_to_json(c);
  EXPECT_EQ(j["dist"]["ep"], 2);
  EXPECT_EQ(config_from_json(j, "run/config.json").dist.ep, 2);
  j.erase("dist");  // a run directory from before [dist]
  const RunConfig old = config_from_json(j, "run/config.json");
  EXPECT_EQ(old.dist.ep, 1);
  EXPECT_EQ(old.dist.dp, 1);
}

}  // namespace
