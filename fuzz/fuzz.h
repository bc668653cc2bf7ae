// Shared by the fuzz targets: which exceptions count as a clean refusal.
// Anything else escaping a target — another exception type, a crash, a
// sanitizer report, a mismatch (abort) — is a finding.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "mha/errors.h"

namespace mha::fuzz {

// Runs f; a typed refusal from the library's boundary is fine.
template <class F>
void refusals_allowed(F&& f) {
  try {
    f();
  } catch (const FormatError&) {
  } catch (const ShapeError&) {
  } catch (const DtypeError&) {
  } catch (const ValueError&) {
  } catch (const MemoryError&) {
  }
}

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what.c_str());
  std::abort();
}

}  // namespace mha::fuzz
