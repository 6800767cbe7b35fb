// defines: LocalGroup (local_group.h), all_to_all_counts (communicator.h)
// A collective is two barriers around a work phase. Every rank deposits its arguments in its slot
// and waits until all have arrived; then each rank does its own share of the work, reading the
// others' slots (a receive copies from the sender's buffer; a reduction reads every buffer and
// writes a private result); then each waits until all are done, so no buffer is released or
// overwritten while a peer still reads it, and only then writes results that peers read. Waits
// wake on arrival, on a failure, on a departure, or at the deadline, and name who they waited for.
#include "fourbit/dist/local_group.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <thread>

#include <fmt/format.h>

#include "fourbit/tensor/device_memory.h"

namespace fourbit::dist {

namespace {

struct Slot {
  std::string op;
  const Tensor* send = nullptr;
  const std::vector<int64_t>* send_bytes = nullptr;
  Tensor* recv = nullptr;
  const std::vector<int64_t>* recv_bytes = nullptr;
  Tensor* x = nullptr;
  int root = 0;
  int color = 0, key = 0;
  // split's result, filled by the last rank to arrive
  std::shared_ptr<LocalGroup::State> new_state;
  int new_rank = -1;
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

struct LocalGroup::State {
  int size;
  std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  Health health;
  std::vector<char> left;
  std::vector<Slot> slots;
  std::vector<uint64_t> arrived_at;  // generation + 1 of the collective a rank last arrived at
  std::vector<uint64_t> done_at;     // generation + 1 of the collective a rank last finished
  uint64_t gen = 0;
  int arrived = 0, done = 0;
  int in_work = 0;  // ranks reading the deposited buffers right now
  bool working = false;

  State(int n, std::chrono::milliseconds t)
      : size(n), timeout(t), left(size_t(n), 0), slots(size_t(n)), arrived_at(size_t(n), 0), done_at(size_t(n), 0) {}

  // Records the group's first failure and wakes every waiter. Caller holds mu.
  void fail_locked(const std::string& message) {
    health.fail(message);
    cv.notify_all();
  }

  [[noreturn]] void throw_failed(int rank, const std::string& op) {
    throw DistError(fmt::format("rank {}: {}: {}", rank, op, health.message()));
  }

  // Waits (lock held) until ready(); fails the group when a rank in waiting_for() has left or
  // the deadline passes, and throws once the group has failed. No rank leaves on a failure while
  // another still reads the buffers deposited for the collective (in_work), so a failure never
  // frees memory in use; at arrival a failure wins over readiness (no rank starts reading buffers
  // whose owner may be leaving), at completion readiness wins (a finished collective stands).
  template <typename Ready, typename Missing>
  void wait(std::unique_lock<std::mutex>& lk, int rank, const std::string& op, const char* phase, bool ready_wins,
            Ready ready, Missing waiting_for) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if ((ready_wins || !health.failed()) && ready()) return;
      if (health.failed()) {
        if (in_work == 0) throw_failed(rank, op);
        cv.wait(lk);
        continue;
      }
      const std::vector<int> missing = waiting_for();
      for (int p : missing)
        if (left[size_t(p)]) {
          fail_locked(fmt::format("rank {} left the group (it returned or exited) while rank {} waited for it in {}",
                                  p, rank, op));
          break;
        }
      if (health.failed()) continue;
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !ready() && !health.failed())
        fail_locked(fmt::format("rank {} timed out after {} s in {} ({}) waiting for rank(s) {}", rank,
                                double(timeout.count()) / 1000.0, op, phase, rank_list(waiting_for())));
    }
  }

  void make_split_groups() {  // caller holds mu; every slot holds (color, key)
    std::vector<char> seen(size_t(size), 0);
    for (int r = 0; r < size; ++r) {
      if (seen[size_t(r)]) continue;
      std::vector<int> members;
      for (int p = 0; p < size; ++p)
        if (slots[size_t(p)].color == slots[size_t(r)].color) members.push_back(p);
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return slots[size_t(a)].key < slots[size_t(b)].key; });
      auto st = std::make_shared<State>(int(members.size()), timeout);
      for (size_t i = 0; i < members.size(); ++i) {
        seen[size_t(members[i])] = 1;
        slots[size_t(members[i])].new_state = st;
        slots[size_t(members[i])].new_rank = int(i);
      }
    }
  }

  // One collective for `rank`: deposit, wait for all, work(), wait for all to finish, after().
  void collective(int rank, Slot mine, const std::function<void(const std::vector<Slot>&)>& work,
                  const std::function<void(Slot&)>& after = nullptr) {
    const std::string op = mine.op;
    std::unique_lock<std::mutex> lk(mu);
    if (health.failed()) throw_failed(rank, op);
    const uint64_t g = gen;
    slots[size_t(rank)] = std::move(mine);
    arrived_at[size_t(rank)] = g + 1;
    if (++arrived == size) {
      for (int p = 1; p < size; ++p)
        if (slots[size_t(p)].op != slots[0].op) {
          fail_locked(fmt::format("collectives out of step: rank 0 called {} while rank {} called {}", slots[0].op,
                                  p, slots[size_t(p)].op));
          throw_failed(rank, op);
        }
      if (op == "split") make_split_groups();
      working = true;
      cv.notify_all();
    }
    auto not_arrived = [&] {
      std::vector<int> m;
      for (int p = 0; p < size; ++p)
        if (arrived_at[size_t(p)] != g + 1) m.push_back(p);
      return m;
    };
    wait(lk, rank, op, "arrival", false, [&] { return (working && gen == g) || gen != g; }, not_arrived);
    const std::vector<Slot>& all = slots;
    ++in_work;
    lk.unlock();
    try {
      work(all);
    } catch (const std::exception& e) {
      lk.lock();
      --in_work;
      fail_locked(fmt::format("rank {} failed in {}: {}", rank, op, e.what()));
      cv.wait(lk, [&] { return in_work == 0; });  // peers may still read this rank's buffers
      throw_failed(rank, op);
    }
    lk.lock();
    --in_work;
    done_at[size_t(rank)] = g + 1;
    if (++done == size) {
      ++gen;
      arrived = done = 0;
      working = false;
    }
    cv.notify_all();  // a new generation, or one fewer reader for a waiter on a failure
    auto not_done = [&] {
      std::vector<int> m;
      for (int p = 0; p < size; ++p)
        if (done_at[size_t(p)] != g + 1) m.push_back(p);
      return m;
    };
    wait(lk, rank, op, "completion", true, [&] { return gen != g; }, not_done);
    Slot result = slots[size_t(rank)];
    lk.unlock();
    if (after) after(result);
  }
};

namespace {

void copy_raw(void* dst, Device dst_dev, const void* src, Device src_dev, int64_t bytes) {
  if (bytes <= 0) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) std::memcpy(dst, src, size_t(bytes));
  else {
    copy_bytes(dst, dst_dev, src, src_dev, size_t(bytes));
    // a peer may reuse its buffer once this rank reports done: the copy must have happened
    device_synchronize();
  }
}

int64_t total(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup::State> st, int rank) : st_(std::move(st)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return st_->size; }
  Device device() const override { return Device::CPU; }

  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_bytes, Tensor& recv,
                    const std::vector<int64_t>& recv_bytes) override {
    const char* op = "all_to_all_v";
    const size_t n = size_t(size());
    if (send_bytes.size() != n || recv_bytes.size() != n)
      fail("rank {}: {}: {} send and {} receive counts for {} ranks", rank_, op, send_bytes.size(), recv_bytes.size(), n);
    for (size_t p = 0; p < n; ++p)
      if (send_bytes[p] < 0 || recv_bytes[p] < 0) fail("rank {}: {}: negative byte count for rank {}", rank_, op, p);
    if (total(send_bytes) > (send.defined() ? send.nbytes() : 0) || total(recv_bytes) > (recv.defined() ? recv.nbytes() : 0))
      fail("rank {}: {}: counts of {} / {} bytes exceed the send / receive buffers", rank_, op, total(send_bytes),
           total(recv_bytes));
    Slot s;
    s.op = op;
    s.send = &send;
    s.send_bytes = &send_bytes;
    s.recv = &recv;
    s.recv_bytes = &recv_bytes;
    st_->collective(rank_, s, [&](const std::vector<Slot>& all) {
      int64_t dst_off = 0;
      for (size_t p = 0; p < n; ++p) {
        const Slot& peer = all[p];
        int64_t src_off = 0;
        for (int q = 0; q < rank_; ++q) src_off += (*peer.send_bytes)[size_t(q)];
        const int64_t bytes = (*peer.send_bytes)[size_t(rank_)];
        if (bytes != recv_bytes[p])
          fail("rank {} sends {} bytes to rank {}, which expects {}", p, bytes, rank_, recv_bytes[p]);
        if (bytes > 0)
          copy_raw(static_cast<char*>(recv.raw()) + dst_off, recv.device(),
                 static_cast<const char*>(peer.send->raw()) + src_off, peer.send->device(), bytes);
        dst_off += bytes;
      }
    });
  }

  void all_reduce_sum(Tensor& x) override {
    const char* op = "all_reduce_sum";
    if (!x.defined() || (x.dtype() != DType::F32 && x.dtype() != DType::F64))
      fail("rank {}: {}: needs an f32 or f64 tensor, got {}", rank_, op, x.defined() ? x.str() : "undefined");
    Slot s;
    s.op = op;
    s.x = &x;
    Tensor result;
    st_->collective(
        rank_, s,
        [&](const std::vector<Slot>& all) {
          for (const Slot& peer : all)
            if (peer.x->shape() != x.shape() || peer.x->dtype() != x.dtype())
              fail("ranks reduce different tensors: {} and {}", x.str(), peer.x->str());
          // Left fold in rank order on the host (the NCCL path folds in the same order on the GPU).
          std::vector<Tensor> host;
          for (const Slot& peer : all) host.push_back(peer.x->device() == Device::CPU ? *peer.x : peer.x->to(Device::CPU));
          result = host[0].clone();
          const int64_t n = x.numel();
          if (x.dtype() == DType::F32) {
            float* acc = result.data<float>();
            for (size_t p = 1; p < host.size(); ++p) {
              const float* v = host[p].data<float>();
              for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + v[i];
            }
          } else {
            double* acc = result.data<double>();
            for (size_t p = 1; p < host.size(); ++p) {
              const double* v = host[p].data<double>();
              for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + v[i];
            }
          }
        },
        [&](Slot&) { x.copy_from(result); });
  }

  void broadcast(Tensor& x, int root) override {
    const char* op = "broadcast";
    if (root < 0 || root >= size()) fail("rank {}: {}: root {} is not a rank of a group of {}", rank_, op, root, size());
    Slot s;
    s.op = op;
    s.x = &x;
    s.root = root;
    st_->collective(rank_, s, [&](const std::vector<Slot>& all) {
      const Tensor& src = *all[size_t(root)].x;
      if (src.nbytes() != x.nbytes() || all[size_t(rank_)].root != all[size_t(root)].root)
        fail("broadcast from rank {}: {} on the root, {} here (or different roots)", root, src.str(), x.str());
      if (rank_ != root) copy_raw(x.raw(), x.device(), src.raw(), src.device(), x.nbytes());
    });
  }

  void barrier() override {
    Slot s;
    s.op = "barrier";
    st_->collective(rank_, s, [](const std::vector<Slot>&) {});
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    Slot s;
    s.op = "split";
    s.color = color;
    s.key = key;
    std::unique_ptr<Communicator> out;
    st_->collective(rank_, s, [](const std::vector<Slot>&) {},
                    [&](Slot& mine) { out = std::make_unique<LocalCommunicator>(mine.new_state, mine.new_rank); });
    return out;
  }

  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lk(st_->mu);
    st_->fail_locked(fmt::format("rank {} aborted: {}", rank_, why));
  }

 private:
  std::shared_ptr<LocalGroup::State> st_;
  int rank_;
};

}  // namespace

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout) {
  if (size < 1) fail("LocalGroup: a group needs at least one rank, got {}", size);
  state_ = std::make_shared<State>(size, timeout);
}

int LocalGroup::size() const { return state_->size; }

std::unique_ptr<Communicator> LocalGroup::communicator(int rank) {
  if (rank < 0 || rank >= state_->size) fail("LocalGroup: rank {} outside a group of {}", rank, state_->size);
  return std::make_unique<LocalCommunicator>(state_, rank);
}

void LocalGroup::leave(int rank) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->left[size_t(rank)] = 1;
  state_->cv.notify_all();
}

void LocalGroup::run(int size, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout) {
  LocalGroup group(size, timeout);
  auto body = [&](int r) {
    try {
      auto comm = group.communicator(r);
      fn(*comm);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(group.state_->mu);
      group.state_->fail_locked(fmt::format("rank {} failed: {}", r, e.what()));  // no-op after the first
    }
    group.leave(r);
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < size; ++r) threads.emplace_back(body, r);
  body(0);
  for (auto& t : threads) t.join();
  if (group.state_->health.failed()) throw DistError(group.state_->health.message());
}

std::vector<int64_t> all_to_all_counts(Communicator& comm, const std::vector<int64_t>& send, int64_t per_peer) {
  const int n = comm.size();
  if (int64_t(send.size()) != int64_t(n) * per_peer)
    fail("all_to_all_counts: {} values for {} ranks x {} per peer", send.size(), n, per_peer);
  std::vector<int64_t> recv(send.size());
  const std::vector<int64_t> bytes(size_t(n), per_peer * int64_t(sizeof(int64_t)));
  if (n == 1) return send;
  const Tensor s = Tensor::from_host(send.data(), {int64_t(send.size())}, DType::I64, comm.device());
  Tensor r = Tensor::empty({int64_t(send.size())}, DType::I64, comm.device());
  comm.all_to_all_v(s, bytes, r, bytes);
  comm.wait_host();
  const Tensor h = r.to(Device::CPU);
  std::memcpy(recv.data(), h.data<int64_t>(), recv.size() * sizeof(int64_t));
  return recv;
}

}  // namespace fourbit::dist
