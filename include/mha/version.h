// Library version.
#pragma once

#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 1
#define MHA_VERSION_PATCH 0

namespace mha {
inline constexpr const char* version = "0.1.0";
}
