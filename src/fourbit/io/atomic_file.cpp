// defines: FileSink, write_file_atomic, InputFile, read_file_bytes (atomic_file.h)
#include "fourbit/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "fourbit/tensor/error.h"

namespace fourbit::io {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::string parent_dir(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

// A name no other writer uses: pid, a process-wide counter and a random word. The leading dot
// keeps it out of globs; the ".tmp-" marks what it is if a crash ever leaves one behind.
std::string temp_path_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path p(path);
  std::random_device rd;
  const std::string name = fmt::format(".{}.tmp-{}-{}-{:08x}", p.filename().string(), ::getpid(),
                                       counter.fetch_add(1), uint32_t(rd()));
  return (p.parent_path() / name).string();
}

void fsync_directory(const std::string& path, const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    fail("{}: written, but opening its directory '{}' to sync it failed: {}", path, dir,
         errno_text(errno));
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  // EINVAL: this file system cannot sync directories; the rename is as durable as it gets.
  if (rc != 0 && err != EINVAL)
    fail("{}: written, but syncing its directory '{}' failed: {}", path, dir, errno_text(err));
}

}  // namespace

void FileSink::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed after {} bytes: {}", target_, written_, errno_text(errno));
    }
    p += n;
    bytes -= size_t(n);
    written_ += uint64_t(n);
  }
}

void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& writer) {
  if (path.empty()) fail("write_file_atomic: empty file name");
  struct stat target_st {};
  const bool target_exists = ::stat(path.c_str(), &target_st) == 0;
  if (target_exists && S_ISDIR(target_st.st_mode))
    fail("{}: is a directory, expected a file name to write", path);

  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = temp_path_for(path);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST)
      fail("{}: cannot create a temp file in '{}': {}", path, parent_dir(path), errno_text(errno));
  }
  if (fd < 0) fail("{}: cannot find an unused temp file name in '{}'", path, parent_dir(path));

  bool fd_open = true;
  auto discard = [&] {
    if (fd_open) ::close(fd);
    fd_open = false;
    ::unlink(tmp.c_str());
  };
  try {
    // A replaced file keeps its permissions; a new one gets 0666 minus the umask, like fopen's.
    if (target_exists && ::fchmod(fd, target_st.st_mode & 07777) != 0)
      fail("{}: cannot copy its permissions to the temp file: {}", path, errno_text(errno));
    FileSink sink(fd, path);
    writer(sink);
    int rc;
    do rc = ::fsync(fd);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) fail("{}: fsync of the temp file failed: {}", path, errno_text(errno));
    fd_open = false;
    if (::close(fd) != 0) fail("{}: closing the temp file failed: {}", path, errno_text(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail("{}: cannot rename the temp file over it: {}", path, errno_text(errno));
  } catch (const std::exception& e) {
    discard();
    // Errors raised here and by FileSink already name the file; others get it prepended.
    const std::string msg = e.what();
    if (msg.find(path) != std::string::npos) throw Error(msg);
    fail("{}: not written (an existing file is left unchanged): {}", path, msg);
  } catch (...) {
    discard();
    throw;
  }
  fsync_directory(path, parent_dir(path));
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, [&](FileSink& sink) { sink.write(bytes); });
}

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) fail("{}: no such file", path_);
    fail("{}: cannot access: {}", path_, errno_text(errno));
  }
  if (S_ISDIR(st.st_mode)) fail("{}: is a directory, expected a file", path_);
  if (!S_ISREG(st.st_mode)) fail("{}: not a regular file", path_);
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail("{}: cannot open for reading: {}", path_, errno_text(errno));
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fail("{}: cannot stat: {}", path_, errno_text(err));
  }
  size_ = uint64_t(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_at(uint64_t offset, void* dst, size_t bytes, std::string_view what) const {
  char* p = static_cast<char*>(dst);
  uint64_t at = offset;
  size_t left = bytes;
  while (left > 0) {
    const ssize_t n = ::pread(fd_, p, left, off_t(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: read error in {} at byte {}: {}", path_, what, at, errno_text(errno));
    }
    if (n == 0)
      fail("{}: file ends at byte {}, but {} needs bytes [{}, {})", path_, at, what, offset,
           offset + bytes);
    p += n;
    at += uint64_t(n);
    left -= size_t(n);
  }
}

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  InputFile f(path);
  std::vector<uint8_t> out(size_t(f.size()));
  f.read_at(0, out.data(), out.size(), "the file");
  return out;
}

}  // namespace fourbit::io
