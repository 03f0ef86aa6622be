// MallocLibrary() in a program linked with mlakv_link_allocator, as
// mlakv-server is: it must name tcmalloc when the build links it (a linker
// that dropped the library, or a wrong link order, would leave glibc's malloc
// in use and fail here), and never claim tcmalloc when the build did not.
#include "server/observability/malloc_library.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlakv::server {
namespace {

TEST(MallocLibrary, NamesTheAllocatorThisProgramWasLinkedWith) {
  const std::string expected = MLAKV_EXPECTED_MALLOC_LIBRARY;
  const std::string found = MallocLibrary();
  if (expected == "system") {
    // The C library's malloc, or a sanitizer's defined in the program itself.
    EXPECT_THAT(found, ::testing::AnyOf("system", "malloc_library_test"));
  } else {
    EXPECT_EQ(found, expected);
  }
}

}  // namespace
}  // namespace mlakv::server
