// The headers most of the library's C++ files include, precompiled once per build
// (CMakeLists.txt, FOURBIT_PCH) instead of parsed by every file: a clean build on two cores
// spends much of its time re-parsing them. Each file still includes what it uses itself.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"
#include "fourbit/tensor/tensor.h"
