// The headers most of the command line's files include, precompiled once per build
// (CMakeLists.txt, FOURBIT_PCH): CLI11, fmt and nlohmann/json are header-heavy, and every command
// file parsed them. Each file still includes what it uses itself.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fourbit/tensor/error.h"
#include "fourbit/tensor/tensor.h"
