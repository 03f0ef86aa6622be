// Which allocator this process runs on, found at run time rather than taken
// from the build: the shared object that the dynamic linker resolves `malloc`
// to. mlakv-server links tcmalloc (cmake/allocator.cmake); this says whether
// that took effect (an LD_PRELOAD or a linker that dropped the library would
// change it), in the start-up log and in mlakv_build_info{allocator}.
#pragma once

#include <string>

namespace mlakv::server {

// "libtcmalloc_minimal.so.4" or another library's file name (without its
// directory) when malloc comes from a shared library other than the C
// library; "system" for the C library's own malloc; the program's own file
// name when the program defines malloc itself (a sanitizer's runtime is
// linked into the program).
std::string MallocLibrary();

}  // namespace mlakv::server
