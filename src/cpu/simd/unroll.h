// MHA_UNROLL, for the register tiles of every instruction set's kernels.
#pragma once

// Before each loop over a register tile (an array of Vec indexed by loop
// counters with constant trip counts): the loop is unrolled completely early,
// where GCC's scalar replacement of aggregates still sees it, and the array
// becomes registers. Left to -O3, these loops were unrolled only after that
// pass, and the arrays lived on the stack at the tiles' ends: each micro-tile
// zeroed its 12-24 accumulators there, stored them there after its loop and
// read them back to write C (31-49 vector loads and stores against the stack
// in each of the attention's micro-tiles, now none; 603 -> 80 in the AVX-512
// sgemm's group_into, whose edge tiles live on the stack by design).
#define MHA_UNROLL _Pragma("GCC unroll 64")
