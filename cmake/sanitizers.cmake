# Sanitizer and fuzzing builds (scripts/sanitize.sh, scripts/fuzz.sh).
#
#   -DMLAKV_SANITIZE=address   AddressSanitizer + UndefinedBehaviorSanitizer
#                              (+ LeakSanitizer at exit); any UB report aborts.
#   -DMLAKV_SANITIZE=thread    ThreadSanitizer; abseil's synchronization is made
#                              visible to it (cmake/tsan_sync.cmake).
#   -DMLAKV_FUZZ=ON            libFuzzer targets in tests/fuzz (clang only);
#                              implies MLAKV_SANITIZE=address.
#
# The flags go to C and C++ only. CUDA (.cu) files keep nvcc's normal flags:
# nvcc's host compiler is g++, whose sanitizer runtime is not clang's, and
# device code cannot run on the machines these builds run on anyway.
#
# A fuzz build instruments the whole project, not only the fuzz targets:
# every library is compiled with -fsanitize=address,undefined and with
# -fsanitize=fuzzer-no-link (coverage counters, comparison tracing). The
# parsers under test live in those libraries, so ASan must see their memory
# accesses and libFuzzer their branches; and one such build then also runs the
# ordinary tests under ASan (the coverage hooks have weak no-op definitions in
# the sanitizer runtime), so CI compiles the project once for both.

set(MLAKV_SANITIZE "" CACHE STRING "Sanitizer build: '' (none), 'address' (ASan+UBSan), 'thread' (TSan)")
set_property(CACHE MLAKV_SANITIZE PROPERTY STRINGS "" address thread)
option(MLAKV_FUZZ "Build the libFuzzer targets in tests/fuzz (clang; implies MLAKV_SANITIZE=address)" OFF)

if(MLAKV_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "MLAKV_FUZZ=ON needs clang (libFuzzer); configure with "
                        "-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 (scripts/fuzz.sh does)")
  endif()
  if(MLAKV_SANITIZE STREQUAL "")
    set(MLAKV_SANITIZE address CACHE STRING "" FORCE)
  elseif(NOT MLAKV_SANITIZE STREQUAL "address")
    message(FATAL_ERROR "MLAKV_FUZZ=ON runs under ASan+UBSan; MLAKV_SANITIZE=${MLAKV_SANITIZE} cannot be combined with it")
  endif()
endif()

if(MLAKV_SANITIZE STREQUAL "")
  return()
endif()

if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "MLAKV_SANITIZE needs clang (the project's sanitizer builds use clang-14's runtimes); "
                      "configure with -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14")
endif()

if(MLAKV_SANITIZE STREQUAL "address")
  # -fno-sanitize-recover: a UB report is an abort, so a test cannot pass over it.
  set(mlakv_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(MLAKV_SANITIZE STREQUAL "thread")
  set(mlakv_sanitize_flags -fsanitize=thread -fno-omit-frame-pointer)
else()
  message(FATAL_ERROR "MLAKV_SANITIZE=${MLAKV_SANITIZE}: expected address or thread")
endif()

set(mlakv_compile_flags ${mlakv_sanitize_flags})
if(MLAKV_FUZZ)
  list(APPEND mlakv_compile_flags -fsanitize=fuzzer-no-link)
endif()
# Line tables are enough for file:line in every report, at a fraction of -g's cost.
list(APPEND mlakv_compile_flags -gline-tables-only)

add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${mlakv_compile_flags}>")
# Only links done by clang get the runtime: an nvcc/g++ link would pull gcc's.
add_link_options("$<$<LINK_LANGUAGE:C,CXX>:${mlakv_sanitize_flags}>")
message(STATUS "mlakv: sanitizer build MLAKV_SANITIZE=${MLAKV_SANITIZE} MLAKV_FUZZ=${MLAKV_FUZZ} "
               "(C/C++: ${mlakv_compile_flags})")

if(MLAKV_SANITIZE STREQUAL "thread")
  include(${CMAKE_CURRENT_LIST_DIR}/tsan_sync.cmake)
endif()
