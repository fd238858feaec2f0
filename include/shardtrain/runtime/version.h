// The program's version string, written into what the program produces (checkpoint attributes,
// the prepare record) so that a file names the build that wrote it. Depends on nothing.
#pragma once

namespace shardtrain {

inline constexpr const char* kProgramVersion = "shardtrain 0.2.0";

}  // namespace shardtrain
