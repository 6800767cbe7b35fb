// defines: SafetensorsFile, read_safetensors, write_safetensors, safetensors_dtype_name
// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"key": "value", ...},
//    "name": {"dtype": "F32", "shape": [4, 8], "data_offsets": [begin, end]}, ...}
// (padded with spaces to a multiple of 8 bytes), then the data buffer. Offsets are relative to
// the buffer start; the tensors tile the buffer exactly, without overlaps or holes. Data is
// little-endian and row-major. fourbit reads and writes the dtypes it has: F32, F64, BF16, U8,
// I8, U16, I32, I64, U32; and, as raw bytes in a tensor of the same element size, the dtypes it
// has no arithmetic type for: F8_E4M3, F8_E5M2, F8_E8M0 (U8 tensors) and F16 (U16 tensors), so
// quantized checkpoints (ModelOpt's NVFP4 / MXFP8 layout) keep their declared dtypes.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fourbit/tensor/tensor.h"

namespace fourbit::io {

struct SafetensorsFile {
  std::string path;
  std::map<std::string, std::string> metadata;
  // CPU tensors in data-buffer order (for files from write_safetensors: the order written)
  std::vector<std::pair<std::string, Tensor>> tensors;
  // Each tensor's dtype as the header declares it ("F32", "F8_E4M3", ...): the tensor's own
  // dtype says only how its bytes are stored.
  std::map<std::string, std::string> dtype_names;

  // The tensor called `name`; an Error naming it and the file when there is none.
  const Tensor& get(const std::string& name) const;
  const Tensor* find(const std::string& name) const;  // nullptr when absent
};

// Reads and validates the whole file: header length vs file size, JSON syntax, no duplicate
// names, each entry's fields, dtype and shape, offsets inside the buffer, no overlaps or holes,
// buffer length. Errors name the file and, where one is at fault, the tensor.
SafetensorsFile read_safetensors(const std::string& path);

// Writes `tensors` in the given order (data laid out in that order), with `metadata` as
// __metadata__ (omitted when empty), atomically (write_file_atomic). Tensors on a GPU are copied
// to the CPU. Names must be unique and not "__metadata__". `dtype_names` declares another dtype
// for some tensors (a U8 tensor of E4M3 codes as "F8_E4M3"); the declared dtype must be stored
// in the tensor's dtype.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const std::map<std::string, std::string>& dtype_names = {});

// "F32", "BF16", "U8", ... as written in the header.
const char* safetensors_dtype_name(DType t);

}  // namespace fourbit::io
