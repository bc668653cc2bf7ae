// The communicator over MPI: the one translation unit that includes mpi.h.
//
// Errors come back as return codes (MPI_ERRORS_RETURN) and leave as
// CommunicationError. Background work (Communicator::start: bucket
// all-reduces, ring attention's exchanges) runs on a thread of its own over a
// duplicate of the communicator: Open MPI makes no progress on a non-blocking
// call unless some thread calls into it, so that thread runs the blocking
// calls and the caller's thread goes on computing. Needs MPI_THREAD_MULTIPLE;
// where MPI offers less, the work runs at once on the caller's thread.
#include <mpi.h>

#include <climits>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "check.h"
#include "dist/mpi_world.h"

namespace mha::dist::detail {
namespace {

bool we_initialized = false;  // MPI_Finalize at the end only then

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::float32: return MPI_FLOAT;
    case DType::float64: return MPI_DOUBLE;
    case DType::int64: return MPI_INT64_T;
    default: return MPI_BYTE;  // bfloat16, boolean: moved as bytes
  }
}

// MPI counts are ints: elements of dtype, or bytes for the byte-moved types.
int mpi_count(int64_t count, DType dtype, const char* fn) {
  const int64_t n = mpi_type(dtype) == MPI_BYTE ? count * dtype_size(dtype) : count;
  if (count < 0 || n > INT_MAX)
    raise<ValueError>(fn, "count", "0 to " + std::to_string(INT_MAX) + " elements a call", std::to_string(count));
  return int(n);
}

void check(int code, const char* fn) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw CommunicationError("[" + std::string(fn) + "] MPI failed: " + std::string(text, size_t(length)));
}

struct Background {
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr error;
};

class BackgroundRequest final : public Request {
 public:
  explicit BackgroundRequest(std::shared_ptr<Background> state) : state_(std::move(state)) {}
  bool test() override {
    std::lock_guard lock(state_->mutex);
    if (state_->error) std::rethrow_exception(state_->error);
    return state_->done;
  }
  void wait() override {
    std::unique_lock lock(state_->mutex);
    state_->changed.wait(lock, [&] { return state_->done; });
    if (state_->error) std::rethrow_exception(state_->error);
  }

 private:
  std::shared_ptr<Background> state_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes MPI_COMM_WORLD (finalising MPI at the end) or a duplicate of it.
  MpiCommunicator(MPI_Comm comm, bool world, bool threads) : comm_(comm), world_(world), threads_(threads) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "mha::dist::world");
    check(MPI_Comm_rank(comm_, &rank_), "mha::dist::world");
    check(MPI_Comm_size(comm_, &size_), "mha::dist::world");
  }
  ~MpiCommunicator() override {
    if (worker_.joinable()) {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
      }
      work_.notify_all();
      worker_.join();
    }
    background_.reset();
    if (world_) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && we_initialized) MPI_Finalize();
    } else {
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void send(const void* data, int64_t count, DType dtype, int to, int tag) override {
    const int n = mpi_count(count, dtype, "mha::dist::send");
    check(MPI_Send(data, n, mpi_type(dtype), to, tag, comm_), "mha::dist::send");
    count_sent(count * dtype_size(dtype));
  }
  void receive(void* data, int64_t count, DType dtype, int from, int tag) override {
    const int n = mpi_count(count, dtype, "mha::dist::receive");
    MPI_Status status;
    check(MPI_Recv(data, n, mpi_type(dtype), from, tag, comm_, &status), "mha::dist::receive");
    check_received(status, n, dtype, "mha::dist::receive");
  }
  void send_receive(const void* send, int64_t send_count, int to, void* receive, int64_t receive_count, int from,
                    DType dtype, int tag) override {
    const char* fn = "mha::dist::send_receive";
    const int ns = mpi_count(send_count, dtype, fn), nr = mpi_count(receive_count, dtype, fn);
    MPI_Status status;
    check(MPI_Sendrecv(send, ns, mpi_type(dtype), to, tag, receive, nr, mpi_type(dtype), from, tag, comm_, &status), fn);
    check_received(status, nr, dtype, fn);
    count_sent(send_count * dtype_size(dtype));
  }
  std::unique_ptr<Request> start(std::function<void(Communicator&)> work) override {
    if (!threads_ || size_ == 1) return Communicator::start(std::move(work));
    auto state = std::make_shared<Background>();
    {
      std::lock_guard lock(mutex_);
      if (!background_) {
        MPI_Comm copy;
        check(MPI_Comm_dup(comm_, &copy), "mha::dist::Communicator::start");
        background_ = std::make_unique<MpiCommunicator>(copy, false, false);
        background_->bytes_sent_ = bytes_sent_;  // one count for the rank
        worker_ = std::thread([this] { serve(); });
      }
      queue_.push_back({std::move(work), state});
    }
    work_.notify_all();
    return std::make_unique<BackgroundRequest>(state);
  }
  void reduce_scatter(const void* send, void* receive, int64_t count, DType dtype) override {
    const char* fn = "mha::dist::reduce_scatter";
    const int n = mpi_count(count, dtype, fn);
    check(MPI_Reduce_scatter_block(send, receive, n, mpi_type(dtype), MPI_SUM, comm_), fn);
  }
  void all_gather(const void* send, void* receive, int64_t count, DType dtype) override {
    const char* fn = "mha::dist::all_gather";
    const int n = mpi_count(count, dtype, fn);
    check(MPI_Allgather(send, n, mpi_type(dtype), receive, n, mpi_type(dtype), comm_), fn);
  }
  void all_to_all(const void* send, void* receive, int64_t count, DType dtype) override {
    const char* fn = "mha::dist::all_to_all";
    const int n = mpi_count(count, dtype, fn);
    check(MPI_Alltoall(send, n, mpi_type(dtype), receive, n, mpi_type(dtype), comm_), fn);
    count_sent(count * dtype_size(dtype) * (size_ - 1));
  }
  void barrier() override { check(MPI_Barrier(comm_), "mha::dist::barrier"); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm part;
    check(MPI_Comm_split(comm_, color, key, &part), "mha::dist::split");
    return std::make_unique<MpiCommunicator>(part, false, threads_);
  }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  struct Task {
    std::function<void(Communicator&)> work;
    std::shared_ptr<Background> state;
  };

  void check_received(const MPI_Status& status, int expected, DType dtype, const char* fn) const {
    int got = 0;
    MPI_Get_count(&status, mpi_type(dtype), &got);
    if (got != expected)
      raise<CommunicationError>(fn, "message from rank " + std::to_string(status.MPI_SOURCE),
                                std::to_string(expected) + " elements", std::to_string(got));
  }

  // The background thread: works in the order they were started.
  void serve() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        task.work(*background_);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(task.state->mutex);
        task.state->done = true, task.state->error = error;
      }
      task.state->changed.notify_all();
    }
  }

  MPI_Comm comm_;
  bool world_, threads_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<MpiCommunicator> background_;
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable work_;
  std::deque<Task> queue_;
  bool stopping_ = false;
};

}  // namespace

bool mpi_built() { return true; }

std::unique_ptr<Communicator> mpi_world() {
  int initialized = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Query_thread(&provided);
  else {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "mha::dist::world");
    we_initialized = true;
  }
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, true, provided == MPI_THREAD_MULTIPLE);
}

}  // namespace mha::dist::detail
