// Where MPI enters: src/dist/mpi_communicator.cpp in a build with MPI,
// src/dist/no_mpi.cpp without.
#pragma once

#include <memory>

#include "mha/dist/communicator.h"

namespace mha::dist::detail {

bool mpi_built();
// MPI_COMM_WORLD's communicator, initialising MPI (MPI_THREAD_MULTIPLE where
// it is offered); null in a build without MPI.
std::unique_ptr<Communicator> mpi_world();

}  // namespace mha::dist::detail
