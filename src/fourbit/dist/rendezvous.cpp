// defines: Rendezvous (rendezvous.h): the TCP protocol and the watchdog thread
// Frames: a 12-byte header (magic "FBZ1", type, payload length; little-endian) and the payload.
// HELLO (rank, world, job key) -> WELCOME or REJECT; GATHER / GATHERED for all_gather; ABORT
// (a message) and BYE (a clean exit) afterwards. Every blocking step has a deadline.
#include "fourbit/dist/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <optional>

#include <fmt/format.h>

namespace fourbit::dist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x315A4246u;  // "FBZ1"
enum FrameType : uint32_t { kHello = 1, kWelcome = 2, kReject = 3, kGather = 4, kGathered = 5, kAbort = 6, kBye = 7 };
constexpr uint32_t kMaxPayload = 16u << 20;
constexpr auto kSendWindow = std::chrono::seconds(5);  // a frame to a live peer never takes longer

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(char(uint8_t(v >> (8 * i))));
}
uint32_t get_u32(const std::string& s, size_t at) {
  if (at + 4 > s.size()) throw DistError("rendezvous: a truncated frame");
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(s[at + size_t(i)])) << (8 * i);
  return v;
}

int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : int(std::min<int64_t>(left, 1 << 30));
}

// Waits for fd to be ready for `events`; false at the deadline.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms_until(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) throw DistError(fmt::format("rendezvous: poll: {}", std::strerror(errno)));
  }
}

void write_all(int fd, const char* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) throw DistError("rendezvous: a peer does not read (send timed out)");
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw DistError(fmt::format("rendezvous: send: {}", std::strerror(errno)));
    }
    p += w;
    n -= size_t(w);
  }
}

// false on a closed connection.
bool read_all(int fd, char* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) throw DistError("rendezvous: a peer went silent (receive timed out)");
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) return false;
      throw DistError(fmt::format("rendezvous: recv: {}", std::strerror(errno)));
    }
    p += r;
    n -= size_t(r);
  }
  return true;
}

struct Frame {
  uint32_t type;
  std::string payload;
};

void write_frame(int fd, uint32_t type, const std::string& payload, Clock::time_point deadline) {
  std::string buf;
  put_u32(buf, kMagic);
  put_u32(buf, type);
  put_u32(buf, uint32_t(payload.size()));
  buf += payload;
  write_all(fd, buf.data(), buf.size(), deadline);
}

std::optional<Frame> read_frame(int fd, Clock::time_point deadline) {
  char head[12];
  if (!read_all(fd, head, sizeof head, deadline)) return std::nullopt;
  const std::string h(head, sizeof head);
  if (get_u32(h, 0) != kMagic) throw DistError("rendezvous: a connection that does not speak fourbit's protocol");
  Frame f{get_u32(h, 4), std::string()};
  const uint32_t len = get_u32(h, 8);
  if (len > kMaxPayload) throw DistError(fmt::format("rendezvous: a frame of {} bytes", len));
  f.payload.resize(len);
  if (len && !read_all(fd, f.payload.data(), len, deadline)) return std::nullopt;
  return f;
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// One attempt to connect to host:port within the deadline; -1 when nobody listens (yet).
int try_connect(const std::string& host, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int g = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (g != 0) return -1;  // the name may not resolve yet (a starting node): retried
  int fd = -1;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int r = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      const auto attempt = std::min(deadline, Clock::now() + std::chrono::seconds(2));
      int err = ETIMEDOUT;
      if (wait_fd(fd, POLLOUT, attempt)) {
        socklen_t len = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
      r = err == 0 ? 0 : -1;
    }
    if (r < 0) {
      ::close(fd);
      fd = -1;
      continue;
    }
    fcntl(fd, F_SETFL, flags);
    tune(fd);
  }
  ::freeaddrinfo(res);
  return fd;
}

std::string missing_ranks(const std::vector<int>& fds) {
  std::string s;
  for (size_t p = 1; p < fds.size(); ++p)
    if (fds[p] < 0) s += (s.empty() ? "" : ", ") + std::to_string(p);
  return s;
}

}  // namespace

Rendezvous::Rendezvous(int rank, int world, std::shared_ptr<Health> health, std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), health_(std::move(health)), timeout_(timeout) {}

std::unique_ptr<Rendezvous> Rendezvous::connect(const LaunchInfo& info, std::shared_ptr<Health> health,
                                                std::chrono::milliseconds timeout) {
  std::unique_ptr<Rendezvous> rz(new Rendezvous(info.rank, info.world, std::move(health), timeout));
  if (info.world == 1) return rz;
  const auto deadline = Clock::now() + timeout;
  const double secs = double(timeout.count()) / 1000.0;
  const std::string where = fmt::format("rendezvous at {}:{}", info.rdzv_host, info.rdzv_port);
  if (info.rank == 0) {
    const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) throw DistError(fmt::format("rank 0: {}: socket: {}", where, std::strerror(errno)));
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(uint16_t(info.rdzv_port));
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0 || ::listen(lfd, info.world + 8) < 0) {
      const std::string e = std::strerror(errno);
      ::close(lfd);
      throw DistError(fmt::format("rank 0: cannot listen on port {} for the rendezvous: {} (another run there? set "
                                  "FOURBIT_RDZV_PORT)", info.rdzv_port, e));
    }
    rz->fds_.assign(size_t(info.world), -1);
    // Tells every connected process why the run cannot start, then leaves nothing open.
    auto give_up = [&](const std::string& msg) {
      for (int fd : rz->fds_)
        if (fd >= 0) {
          try {
            write_frame(fd, kAbort, msg, Clock::now() + kSendWindow);
          } catch (...) {
          }
          ::close(fd);
        }
      rz->fds_.clear();
      ::close(lfd);
      throw DistError(msg);
    };
    int joined = 1;
    while (joined < info.world) {
      if (!wait_fd(lfd, POLLIN, deadline))
        give_up(fmt::format("rank 0: rank(s) {} never joined the {} within {} s", missing_ranks(rz->fds_), where, secs));
      const int cfd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (cfd < 0) continue;
      tune(cfd);
      std::optional<Frame> hello;
      try {
        hello = read_frame(cfd, std::min(deadline, Clock::now() + kSendWindow));
      } catch (const DistError&) {
      }
      if (!hello || hello->type != kHello || hello->payload.size() < 8) {
        ::close(cfd);  // not one of ours, or gone: keep waiting for the real ranks
        continue;
      }
      const int r = int(get_u32(hello->payload, 0)), w = int(get_u32(hello->payload, 4));
      const std::string key = hello->payload.substr(8);
      if (key != info.job_key) {
        try {
          write_frame(cfd, kReject, info.job_key, Clock::now() + kSendWindow);
        } catch (...) {
        }
        ::close(cfd);
        continue;
      }
      if (w != info.world) {
        rz->fds_[0] = cfd;  // so give_up tells it too
        give_up(fmt::format("rank 0: rank {} was launched with a world of {} processes, rank 0 with {}", r, w, info.world));
      }
      if (r < 1 || r >= info.world || rz->fds_[size_t(r)] >= 0) {
        rz->fds_[0] = cfd;
        give_up(fmt::format("rank 0: a second process claims rank {} (or a rank outside 1..{}): check the launch", r,
                            info.world - 1));
      }
      rz->fds_[size_t(r)] = cfd;
      ++joined;
    }
    ::close(lfd);
    for (int p = 1; p < info.world; ++p) write_frame(rz->fds_[size_t(p)], kWelcome, "", deadline);
  } else {
    int fd = -1;
    for (;;) {
      fd = try_connect(info.rdzv_host, info.rdzv_port, deadline);
      if (fd >= 0) {
        std::string hello;
        put_u32(hello, uint32_t(info.rank));
        put_u32(hello, uint32_t(info.world));
        hello += info.job_key;
        std::optional<Frame> reply;
        try {
          write_frame(fd, kHello, hello, deadline);
          reply = read_frame(fd, deadline);
        } catch (const DistError&) {
        }
        if (reply && reply->type == kWelcome) break;
        ::close(fd);
        fd = -1;
        if (reply && reply->type == kAbort) throw DistError(fmt::format("rank {}: {}", info.rank, reply->payload));
        if (reply && reply->type == kReject)
          throw DistError(fmt::format("rank {}: the process listening for the {} belongs to another job (its key "
                                      "'{}', ours '{}'): set FOURBIT_RDZV_PORT",
                                      info.rank, where, reply->payload, info.job_key));
      }
      if (Clock::now() >= deadline)
        throw DistError(fmt::format("rank {}: rank 0 did not answer at the {} within {} s", info.rank, where, secs));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    rz->fds_ = {fd};
  }
  rz->said_goodbye_.assign(rz->fds_.size(), 0);
  return rz;
}

std::vector<std::string> Rendezvous::all_gather(const std::string& mine) {
  if (world_ == 1) return {mine};
  if (watchdog_.joinable()) throw DistError("rendezvous: all_gather after start_watchdog");
  const auto deadline = Clock::now() + timeout_;
  std::vector<std::string> all(static_cast<size_t>(world_));
  auto expect = [&](std::optional<Frame> f, uint32_t type, int peer) -> std::string {
    if (!f) throw DistError(fmt::format("rank {}: rank {} closed its connection during all_gather", rank_, peer));
    if (f->type == kAbort) throw DistError(fmt::format("rank {}: {}", rank_, f->payload));
    if (f->type != type) throw DistError(fmt::format("rank {}: rank {} sent frame {} during all_gather", rank_, peer, f->type));
    return f->payload;
  };
  if (rank_ == 0) {
    all[0] = mine;
    for (int p = 1; p < world_; ++p) all[size_t(p)] = expect(read_frame(fds_[size_t(p)], deadline), kGather, p);
    std::string list;
    for (const std::string& s : all) {
      put_u32(list, uint32_t(s.size()));
      list += s;
    }
    for (int p = 1; p < world_; ++p) write_frame(fds_[size_t(p)], kGathered, list, deadline);
  } else {
    write_frame(fds_[0], kGather, mine, deadline);
    const std::string list = expect(read_frame(fds_[0], deadline), kGathered, 0);
    size_t at = 0;
    for (int p = 0; p < world_; ++p) {
      const uint32_t n = get_u32(list, at);
      if (at + 4 + n > list.size()) throw DistError("rendezvous: a truncated all_gather list");
      all[size_t(p)] = list.substr(at + 4, n);
      at += 4 + n;
    }
  }
  return all;
}

void Rendezvous::start_watchdog() {
  if (world_ == 1 || watchdog_.joinable()) return;
  if (::pipe2(wake_, O_CLOEXEC) < 0) throw DistError(fmt::format("rendezvous: pipe: {}", std::strerror(errno)));
  watchdog_ = std::thread([this] { watch(); });
}

void Rendezvous::send_to(int fd, uint32_t type, const std::string& payload) {
  std::lock_guard<std::mutex> lk(send_mu_);
  try {
    write_frame(fd, type, payload, Clock::now() + kSendWindow);
  } catch (const DistError&) {
    // that peer is gone; the others still hear
  }
}

void Rendezvous::announce(const std::string& message) {
  if (announced_.exchange(true)) return;
  for (size_t i = 0; i < fds_.size() && i < said_goodbye_.size(); ++i)
    if (fds_[i] >= 0 && !said_goodbye_[i]) send_to(fds_[i], kAbort, message);
}

void Rendezvous::abort(const std::string& why) {
  health_->fail(fmt::format("rank {} failed: {}", rank_, why));
  announce(health_->message());
}

// The watchdog: polls the connections (and the wake pipe) every 100 ms.
void Rendezvous::watch() {
  std::vector<pollfd> polls;
  std::vector<size_t> which;
  for (;;) {
    polls.assign(1, pollfd{wake_[0], POLLIN, 0});
    which.assign(1, size_t(-1));
    for (size_t i = 0; i < fds_.size(); ++i)
      if (fds_[i] >= 0 && !said_goodbye_[i]) {
        polls.push_back(pollfd{fds_[i], POLLIN, 0});
        which.push_back(i);
      }
    const int r = ::poll(polls.data(), nfds_t(polls.size()), 100);
    if (r < 0 && errno != EINTR) return;
    if (polls[0].revents) return;  // stop
    // A failure this process found itself (the NCCL monitor, a caller) goes to the others.
    if (health_->failed() && !announced_.load()) announce(health_->message());
    for (size_t k = 1; k < polls.size(); ++k) {
      if (!polls[k].revents) continue;
      const size_t i = which[k];
      const int peer = rank_ == 0 ? int(i) : 0;
      std::optional<Frame> f;
      try {
        f = read_frame(fds_[i], Clock::now() + kSendWindow);
      } catch (const DistError&) {
      }
      if (f && f->type == kBye) {
        said_goodbye_[i] = 1;
        continue;
      }
      std::string message;
      if (f && f->type == kAbort) message = f->payload;
      else if (!f)
        message = fmt::format("rank {} exited or lost its connection without a goodbye (killed, crashed, or its node "
                              "failed)", peer);
      else continue;  // nothing else is expected now
      said_goodbye_[i] = 2;  // gone: stop polling it
      health_->fail(message);
      if (rank_ == 0) {  // pass it on to everyone else
        announced_ = true;
        for (size_t j = 0; j < fds_.size(); ++j)
          if (j != i && fds_[j] >= 0 && !said_goodbye_[j]) send_to(fds_[j], kAbort, health_->message());
      } else {
        announced_ = true;  // it came from rank 0, which tells everyone
      }
    }
  }
}

void Rendezvous::stop_watchdog() {
  if (!watchdog_.joinable()) return;
  const char c = 0;
  (void)!::write(wake_[1], &c, 1);
  watchdog_.join();
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void Rendezvous::goodbye() {
  if (closed_) return;
  closed_ = true;
  stop_watchdog();
  for (size_t i = 0; i < fds_.size() && i < said_goodbye_.size(); ++i)
    if (fds_[i] >= 0) {
      if (!said_goodbye_[i]) send_to(fds_[i], kBye, "");
      ::close(fds_[i]);
    }
}

Rendezvous::~Rendezvous() {
  if (closed_) return;
  if (health_->failed() || std::uncaught_exceptions() > 0) {
    if (!health_->failed()) health_->fail(fmt::format("rank {} is exiting with an error", rank_));
    announce(health_->message());
    closed_ = true;
    stop_watchdog();
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
    return;
  }
  goodbye();
}

}  // namespace fourbit::dist
