// defines: FileSink, write_file_atomic, InputFile, read_file_bytes
// Checked file access for everything fourbit reads and writes. Writes are atomic: the bytes go to
// a temp file beside the target, which is fsynced and renamed over it, so a reader (or a crash)
// sees either the old file or the complete new one, never a torn checkpoint. Every failure is an
// Error that names the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::io {

// What a write_file_atomic writer writes into (the temp file). Unbuffered: write large chunks.
class FileSink {
 public:
  FileSink(int fd, std::string target) : fd_(fd), target_(std::move(target)) {}
  void write(const void* data, size_t bytes);  // Error naming the target on failure
  void write(std::string_view s) { write(s.data(), s.size()); }
  uint64_t bytes_written() const { return written_; }

 private:
  int fd_;
  std::string target_;
  uint64_t written_ = 0;
};

// Replaces `path` with what `writer` writes, atomically: temp file in the same directory, fsync,
// rename over the target, fsync the directory. If the writer throws or any step fails, the temp
// file is removed, an existing target is left untouched, and an Error naming `path` is thrown.
void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& writer);
void write_file_atomic(const std::string& path, std::string_view bytes);

// A file opened for reading at explicit offsets. Opening fails with a clear Error when the path
// is missing, is a directory or cannot be read.
class InputFile {
 public:
  explicit InputFile(std::string path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Reads exactly `bytes` bytes at `offset`; `what` names them in the error ("the header",
  // "tensor 'w1'") when the file is shorter than that.
  void read_at(uint64_t offset, void* dst, size_t bytes, std::string_view what) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole file (errors as InputFile's).
std::vector<uint8_t> read_file_bytes(const std::string& path);

}  // namespace fourbit::io
