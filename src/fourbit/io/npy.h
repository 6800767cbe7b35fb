// defines: NpyHeader, read_npy_header, read_npy, write_npy, npy_descr
// NumPy .npy files (format versions 1.0, 2.0 and 3.0): the magic "\x93NUMPY", a version, a header
// length (2 bytes little-endian in 1.0, 4 bytes in 2.0/3.0), a Python dict literal
// {'descr': '<f4', 'fortran_order': False, 'shape': (R, C), } padded with spaces and a newline so
// the data starts on a 64-byte boundary, then the raw C-order data. Only little-endian dtypes
// whose element type fourbit has are read into tensors; everything else fails naming the file.
#pragma once
#include <cstdint>
#include <string>

#include "fourbit/tensor/tensor.h"

namespace fourbit::io {

struct NpyHeader {
  int version_major = 1, version_minor = 0;
  std::string descr;  // as written: '<f4', '<f8', '|u1', ...
  bool fortran_order = false;
  Shape shape;               // () is a 0-d array of one element
  uint64_t data_offset = 0;  // bytes before the data
  int64_t item_bytes = 0;    // size of one element of descr
};

// Parses and validates the header of `path`: magic, version, dict syntax and keys, a known
// little-endian descr, C order, and a data section of exactly numel * item_bytes bytes.
// Accepts descrs that fourbit has no tensor type for (e.g. '<f2') so callers can name them.
NpyHeader read_npy_header(const std::string& path);

// The array as a CPU tensor of the matching DType: <f4 F32, <f8 F64, |u1 U8, |i1 I8, <u2 U16,
// <i4 I32, <i8 I64, <u4 U32. Other dtypes (e.g. <f2, which fourbit has no type for) fail naming
// the file.
Tensor read_npy(const std::string& path);

// Writes t (any device; copied to the CPU) as a version 1.0 .npy (2.0 if the header outgrows
// 64 KiB, as NumPy does), atomically. BF16 has no NumPy descr and fails.
void write_npy(const std::string& path, const Tensor& t);

// The .npy descr of a DType ('<f4', ...); fails for BF16.
const char* npy_descr(DType t);

}  // namespace fourbit::io
