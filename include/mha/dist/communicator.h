// Communicators: the few collective and point-to-point operations that
// data-parallel training and ring attention need, behind one interface.
//
// A Communicator is a group of `size()` ranks, this process being `rank()`.
// Every collective must be called by every rank of the group, in the same
// order, with the same counts. Buffers hold `count` elements of a dtype
// (float32, float64 or int64); reductions are sums.
//
// Implementations: local_communicator() (one rank; every call is a copy or
// nothing) and, in a build with MPI (mha::dist::mpi_built()), MPI's world
// (src/dist/mpi_communicator.cpp, the one place that includes mpi.h).
// world() picks MPI's when the process was started by mpirun, else a local one.
//
// all_reduce is the ring algorithm (a reduce-scatter, then an all-gather, over
// send_receive to the neighbours): every rank sends 2 (P − 1) / P of the
// buffer, counted in bytes_sent(), and every rank ends with the same bits
// (each segment is summed in one order, then copied).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "mha/dtype.h"

namespace mha::dist {

// A non-blocking operation in flight: test() says whether it has finished,
// wait() blocks until it has; either rethrows the operation's error.
class Request {
 public:
  virtual ~Request() = default;
  virtual bool test() = 0;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local" or "mpi".
  virtual std::string backend() const = 0;

  // Point to point. send_receive sends `send` to rank `to` while receiving
  // `receive` from rank `from` (no deadlock when every rank calls it in a ring).
  virtual void send(const void* data, int64_t count, DType dtype, int to, int tag) = 0;
  virtual void receive(void* data, int64_t count, DType dtype, int from, int tag) = 0;
  virtual void send_receive(const void* send, int64_t send_count, int to, void* receive, int64_t receive_count,
                            int from, DType dtype, int tag) = 0;

  // data (count) summed over the ranks, in place: the ring algorithm.
  void all_reduce(void* data, int64_t count, DType dtype);

  // Work started now and finished in the background: with MPI on a
  // communication thread of its own, over a duplicate of this communicator
  // (passed to `work`), in the order started, so that it progresses while
  // this thread computes; without, at once. Buffers stay untouched until the
  // request has finished. Every rank starts the same works in the same order.
  virtual std::unique_ptr<Request> start(std::function<void(Communicator&)> work);
  std::unique_ptr<Request> all_reduce_start(void* data, int64_t count, DType dtype);
  std::unique_ptr<Request> send_receive_start(const void* send, int64_t send_count, int to, void* receive,
                                              int64_t receive_count, int from, DType dtype, int tag);
  // send (size · count): block r of the sum over ranks lands in receive (count) on rank r.
  virtual void reduce_scatter(const void* send, void* receive, int64_t count, DType dtype) = 0;
  // send (count) from each rank, in rank order, into receive (size · count) on every rank.
  virtual void all_gather(const void* send, void* receive, int64_t count, DType dtype) = 0;
  // Block r (count) of send goes to rank r; block r of receive came from rank r.
  virtual void all_to_all(const void* send, void* receive, int64_t count, DType dtype) = 0;
  virtual void barrier() = 0;
  // The ranks that pass the same `color`, ordered by `key`, as a
  // communicator of their own (MPI_Comm_split); every rank calls it.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Ends every rank of the job at once, with `code` (MPI_Abort): for a
  // program that cannot go on after an error on one rank. The library never calls it.
  [[noreturn]] virtual void abort(int code) = 0;

  // Bytes this rank has sent through send, send_receive and all_reduce (the
  // counted figure of docs/distributed.md), and resetting the count.
  // A background all_reduce_start counts on the communicator it was started on.
  int64_t bytes_sent() const { return bytes_sent_->load(); }
  void reset_bytes_sent() { bytes_sent_->store(0); }

 protected:
  void count_sent(int64_t bytes) { *bytes_sent_ += bytes; }
  std::shared_ptr<std::atomic<int64_t>> bytes_sent_ = std::make_shared<std::atomic<int64_t>>(0);
};

// Templated conveniences: the dtype from the element type.
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::float32; }
template <> constexpr DType dtype_of<double>() { return DType::float64; }
template <> constexpr DType dtype_of<int64_t>() { return DType::int64; }
template <class T> void all_reduce(Communicator& comm, T* data, int64_t count) {
  comm.all_reduce(data, count, dtype_of<T>());
}

// One rank: collectives copy, point to point to oneself is refused.
std::unique_ptr<Communicator> local_communicator();
// Whether this build has MPI.
bool mpi_built();
// The job's communicator: MPI's world when this process runs under mpirun
// (or srun) in a build with MPI, initialising MPI on the first call and
// finalising it at exit; a local communicator otherwise. One per process:
// later calls return the same object.
Communicator& world();

}  // namespace mha::dist
