// A build without MPI: the job's communicator is always a local one.
#include "dist/mpi_world.h"

namespace mha::dist::detail {

bool mpi_built() { return false; }
std::unique_ptr<Communicator> mpi_world() { return nullptr; }

}  // namespace mha::dist::detail
