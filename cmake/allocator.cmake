# The allocator mlakv-server (and the benchmarks that host the service in
# their own process) link: gperftools' tcmalloc_minimal by default
# (Debian/Ubuntu libgoogle-perftools-dev, installed by scripts/install_deps.sh).
#
# Why: a decode step's call allocates and frees thousands of small objects on
# gRPC's threads (the request's 256 SequenceRows, the transactions, the
# response), often freed on another thread than the one that allocated them.
# glibc's malloc cost the step 17-31% of its end-to-end p50 on the H200 host
# against tcmalloc in the same run (docs/performance.md "The allocator").
#
#   -DMLAKV_ALLOCATOR=tcmalloc   (default) link libtcmalloc_minimal; fails if it is missing
#   -DMLAKV_ALLOCATOR=system     the C library's malloc
#
# Sanitizer builds always use the system allocator: ASan and TSan replace
# malloc themselves.
set(MLAKV_ALLOCATOR "tcmalloc" CACHE STRING "mlakv-server's allocator: tcmalloc or system")
set_property(CACHE MLAKV_ALLOCATOR PROPERTY STRINGS tcmalloc system)
if(NOT MLAKV_ALLOCATOR MATCHES "^(tcmalloc|system)$")
  message(FATAL_ERROR "MLAKV_ALLOCATOR=${MLAKV_ALLOCATOR}: expected tcmalloc or system")
endif()

set(mlakv_allocator_effective "${MLAKV_ALLOCATOR}")
if(NOT MLAKV_SANITIZE STREQUAL "")
  set(mlakv_allocator_effective "system")
endif()

if(mlakv_allocator_effective STREQUAL "tcmalloc")
  find_library(MLAKV_TCMALLOC_LIBRARY NAMES tcmalloc_minimal)
  if(NOT MLAKV_TCMALLOC_LIBRARY)
    message(FATAL_ERROR "MLAKV_ALLOCATOR=tcmalloc: libtcmalloc_minimal not found; install libgoogle-perftools-dev "
                        "(scripts/install_deps.sh does) or configure with -DMLAKV_ALLOCATOR=system")
  endif()
endif()
message(STATUS "mlakv: allocator ${mlakv_allocator_effective} ${MLAKV_TCMALLOC_LIBRARY}")

# What a process linked with mlakv_link_allocator reports as the library its
# malloc comes from (MallocLibrary(), mlakv_build_info{allocator}); the
# end-to-end tests compare the running server's answer with it.
if(mlakv_allocator_effective STREQUAL "tcmalloc")
  set(MLAKV_EXPECTED_MALLOC_LIBRARY "libtcmalloc_minimal.so.4")
else()
  set(MLAKV_EXPECTED_MALLOC_LIBRARY "system")
endif()

# Links the chosen allocator into an executable. --no-as-needed (for the
# whole link: CMake merges repeated push/pop-state flags, so the library
# cannot be bracketed alone): a linker that drops libraries whose symbols the
# program does not name before it (Ubuntu's default) could drop tcmalloc, and
# glibc's malloc would be used after all. tests/server/observability/
# malloc_library_test and the end-to-end test check the running process.
function(mlakv_link_allocator target)
  if(mlakv_allocator_effective STREQUAL "tcmalloc")
    target_link_options(${target} PRIVATE "LINKER:--no-as-needed")
    target_link_libraries(${target} PRIVATE ${MLAKV_TCMALLOC_LIBRARY})
  endif()
endfunction()
