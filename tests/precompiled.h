// The headers most test files include, precompiled once per build (CMakeLists.txt, FOURBIT_PCH)
// instead of parsed by each of the suite's files. Each file still includes what it uses itself.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
