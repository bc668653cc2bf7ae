// The ring all-reduce over any communicator's point-to-point calls, the
// one-rank communicator, and the choice of the job's communicator.
#include "mha/dist/communicator.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"
#include "dist/mpi_world.h"

namespace mha::dist {
namespace {

void check_reducible(DType dtype, const char* fn) {
  if (dtype != DType::float32 && dtype != DType::float64 && dtype != DType::int64)
    raise<DtypeError>(fn, "dtype", "float32, float64 or int64", to_string(dtype));
}

template <class T>
void add_into(void* to, const void* from, int64_t n) {
  T* a = static_cast<T*>(to);
  const T* b = static_cast<const T*>(from);
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void add_into(void* to, const void* from, int64_t n, DType dtype) {
  if (dtype == DType::float32) add_into<float>(to, from, n);
  else if (dtype == DType::float64) add_into<double>(to, from, n);
  else add_into<int64_t>(to, from, n);
}

// A request that finished when it was made.
struct DoneRequest final : Request {
  bool test() override { return true; }
  void wait() override {}
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "local"; }
  void send(const void*, int64_t, DType, int to, int) override { refuse("send", to); }
  void receive(void*, int64_t, DType, int from, int) override { refuse("receive", from); }
  void send_receive(const void* send, int64_t send_count, int to, void* receive, int64_t receive_count, int from,
                    DType dtype, int) override {
    if (to != 0 || from != 0) refuse("send_receive", to != 0 ? to : from);
    if (send_count != receive_count)
      raise<CommunicationError>("mha::dist::send_receive", "receive_count", std::to_string(send_count),
                                std::to_string(receive_count));
    std::memmove(receive, send, size_t(send_count * dtype_size(dtype)));
  }
  void reduce_scatter(const void* send, void* receive, int64_t count, DType dtype) override {
    check_reducible(dtype, "mha::dist::reduce_scatter");
    std::memmove(receive, send, size_t(count * dtype_size(dtype)));
  }
  void all_gather(const void* send, void* receive, int64_t count, DType dtype) override {
    std::memmove(receive, send, size_t(count * dtype_size(dtype)));
  }
  void all_to_all(const void* send, void* receive, int64_t count, DType dtype) override {
    std::memmove(receive, send, size_t(count * dtype_size(dtype)));
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<LocalCommunicator>(); }
  [[noreturn]] void abort(int code) override { std::_Exit(code); }

 private:
  [[noreturn]] static void refuse(const char* what, int peer) {
    raise<ValueError>(std::string("mha::dist::") + what, "peer", "a rank of a group of 1 other than itself",
                      "rank " + std::to_string(peer));
  }
};

}  // namespace

// Segment k of P: the elements [k·n/P, (k+1)·n/P). Reduce-scatter: in step s
// rank r sends its partial sum of segment r − s to r + 1 and adds what r − 1
// sends of segment r − s − 1; after P − 1 steps rank r holds the whole sum of
// segment r + 1. All-gather: P − 1 more steps pass the finished segments on.
// Each step sends about n/P elements: 2 (P − 1) n / P in all.
void Communicator::all_reduce(void* data, int64_t count, DType dtype) {
  check_reducible(dtype, "mha::dist::all_reduce");
  const int P = size(), r = rank();
  if (P == 1 || count == 0) return;
  const int64_t bytes = dtype_size(dtype);
  char* base = static_cast<char*>(data);
  const auto wrap = [P](int k) { return int64_t(((k % P) + P) % P); };
  const auto begin = [&](int k) { return wrap(k) * count / P; };
  const auto segment_length = [&](int k) { return (wrap(k) + 1) * count / P - wrap(k) * count / P; };
  std::vector<char> incoming(size_t((count / P + 1) * bytes));
  const int next = (r + 1) % P, previous = (r + P - 1) % P;
  constexpr int kTag = 0x6d68;  // "mh"
  for (int s = 0; s < P - 1; ++s) {
    const int out = r - s, in = r - s - 1;
    send_receive(base + begin(out) * bytes, segment_length(out), next, incoming.data(), segment_length(in), previous,
                 dtype, kTag);
    add_into(base + begin(in) * bytes, incoming.data(), segment_length(in), dtype);
  }
  for (int s = 0; s < P - 1; ++s) {
    const int out = r + 1 - s, in = r - s;
    send_receive(base + begin(out) * bytes, segment_length(out), next, base + begin(in) * bytes, segment_length(in),
                 previous, dtype, kTag + 1);
  }
}

std::unique_ptr<Request> Communicator::start(std::function<void(Communicator&)> work) {
  work(*this);
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Request> Communicator::all_reduce_start(void* data, int64_t count, DType dtype) {
  return start([=](Communicator& c) { c.all_reduce(data, count, dtype); });
}

std::unique_ptr<Request> Communicator::send_receive_start(const void* send, int64_t send_count, int to, void* receive,
                                                          int64_t receive_count, int from, DType dtype, int tag) {
  return start([=](Communicator& c) { c.send_receive(send, send_count, to, receive, receive_count, from, dtype, tag); });
}

std::unique_ptr<Communicator> local_communicator() { return std::make_unique<LocalCommunicator>(); }

bool mpi_built() { return detail::mpi_built(); }

// Open MPI's mpirun, MPICH's and Intel's (PMI), and Slurm's srun (PMIx) each set one of these.
bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name)) return true;
  return false;
}

Communicator& world() {
  static std::unique_ptr<Communicator> the_world = [] {
    std::unique_ptr<Communicator> mpi = launched_by_mpi() ? detail::mpi_world() : nullptr;
    return mpi ? std::move(mpi) : local_communicator();
  }();
  return *the_world;
}

}  // namespace mha::dist
