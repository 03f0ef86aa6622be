# ThreadSanitizer builds: the synchronization that happens inside
# uninstrumented libraries, made visible to TSan by interposing the functions
# that do it (why and how: common/tsan_absl_sync.cc, common/tsan_grpc_calls.cc).
# Included by cmake/sanitizers.cmake when MLAKV_SANITIZE=thread: every target
# defined after it links mlakv_tsan_sync, and every program takes both of its
# objects and exports their definitions, so that shared libraries (gRPC,
# protobuf, abseil itself) bind to them too.

# abseil's inline namespace, as the Itanium ABI mangles it: "debian3" -> "7debian3".
get_target_property(mlakv_absl_includes absl::base INTERFACE_INCLUDE_DIRECTORIES)
find_file(MLAKV_ABSL_OPTIONS_H absl/base/options.h PATHS ${mlakv_absl_includes} /usr/include NO_DEFAULT_PATH)
if(NOT MLAKV_ABSL_OPTIONS_H)
  message(FATAL_ERROR "MLAKV_SANITIZE=thread: absl/base/options.h not found (looked in ${mlakv_absl_includes})")
endif()
file(STRINGS ${MLAKV_ABSL_OPTIONS_H} mlakv_ns_line REGEX "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME ")
string(REGEX REPLACE "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME +([A-Za-z0-9_]+).*" "\\1" mlakv_absl_ns "${mlakv_ns_line}")
if(mlakv_absl_ns STREQUAL "" OR mlakv_absl_ns STREQUAL mlakv_ns_line)
  message(FATAL_ERROR "MLAKV_SANITIZE=thread: cannot read ABSL_OPTION_INLINE_NAMESPACE_NAME from ${MLAKV_ABSL_OPTIONS_H}")
endif()
string(LENGTH ${mlakv_absl_ns} mlakv_absl_ns_length)
set(mlakv_absl_ns_mangled "${mlakv_absl_ns_length}${mlakv_absl_ns}")

# Every function common/tsan_absl_sync.cc defines: "N" for members, "NK" for
# const members, then the mangled name after the inline namespace.
set(mlakv_tsan_absl_functions
  N:5Mutex4LockEv
  N:5Mutex6UnlockEv
  N:5Mutex10ReaderLockEv
  N:5Mutex12ReaderUnlockEv
  N:5Mutex7TryLockEv
  N:5Mutex13ReaderTryLockEv
  N:5Mutex8LockWhenERKNS0_9ConditionE
  N:5Mutex14ReaderLockWhenERKNS0_9ConditionE
  N:5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE
  N:5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE
  N:5Mutex5AwaitERKNS0_9ConditionE
  N:5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE
  N:5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE
  N:5MutexD1Ev
  N:5MutexD2Ev
  N:7CondVar4WaitEPNS0_5MutexE
  N:7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE
  N:7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE
  N:12Notification6NotifyEv
  NK:12Notification19WaitForNotificationEv
  NK:12Notification30WaitForNotificationWithTimeoutENS0_8DurationE
  NK:12Notification31WaitForNotificationWithDeadlineENS0_4TimeE)
set(mlakv_tsan_absl_symbols)
foreach(entry IN LISTS mlakv_tsan_absl_functions)
  string(REPLACE ":" ";" parts ${entry})
  list(GET parts 0 prefix)
  list(GET parts 1 suffix)
  list(APPEND mlakv_tsan_absl_symbols "_Z${prefix}4absl${mlakv_absl_ns_mangled}${suffix}")
endforeach()
# common/tsan_grpc_calls.cc: functions of gRPC's C core.
set(mlakv_tsan_grpc_symbols grpc_call_start_batch grpc_call_unref grpc_server_request_call
    grpc_server_request_registered_call grpc_completion_queue_next)

# Each must be defined by the installed library: a name that is not there
# would interpose nothing, silently.
find_program(MLAKV_NM NAMES nm llvm-nm-14 REQUIRED)
function(mlakv_tsan_check_symbols target)
  get_target_property(lib ${target} LOCATION)
  execute_process(COMMAND ${MLAKV_NM} -D --defined-only ${lib} OUTPUT_VARIABLE defined RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "MLAKV_SANITIZE=thread: ${MLAKV_NM} -D ${lib} failed")
  endif()
  foreach(symbol IN LISTS ARGN)
    string(FIND "${defined}" " ${symbol}\n" found)
    if(found EQUAL -1)
      message(FATAL_ERROR "MLAKV_SANITIZE=thread: ${symbol} is not defined by ${lib}; this library differs "
                          "from the one cmake/tsan_sync.cmake was written for (Debian 12's)")
    endif()
  endforeach()
endfunction()
find_package(gRPC CONFIG REQUIRED)
mlakv_tsan_check_symbols(absl::synchronization ${mlakv_tsan_absl_symbols})
mlakv_tsan_check_symbols(gRPC::grpc ${mlakv_tsan_grpc_symbols})

add_library(mlakv_tsan_sync STATIC ${PROJECT_SOURCE_DIR}/common/tsan_absl_sync.cc
                                   ${PROJECT_SOURCE_DIR}/common/tsan_grpc_calls.cc)
# gRPC++ for every TSan program: tsan_grpc_calls.cc runs grpcpp's callback
# tags (a program without gRPC just carries the library along).
target_link_libraries(mlakv_tsan_sync PUBLIC absl::synchronization absl::time gRPC::grpc++ ${CMAKE_DL_LIBS})
target_compile_definitions(mlakv_tsan_sync PRIVATE MLAKV_ABSL_NS="${mlakv_absl_ns_mangled}")

# --undefined (one symbol of each object): a program whose own objects call
# none of these must still take them (its shared libraries do); the archive
# comes first on every link line (link_libraries), before those libraries.
# --export-dynamic-symbol: shared libraries bind to a program's definition
# only if the program exports it.
list(GET mlakv_tsan_absl_symbols 0 mlakv_first_absl)
set(mlakv_tsan_link_flags "-Wl,--undefined=${mlakv_first_absl}" "-Wl,--undefined=grpc_call_start_batch")
foreach(symbol IN LISTS mlakv_tsan_absl_symbols mlakv_tsan_grpc_symbols)
  list(APPEND mlakv_tsan_link_flags "-Wl,--export-dynamic-symbol=${symbol}")
endforeach()
add_link_options("$<$<LINK_LANGUAGE:C,CXX>:${mlakv_tsan_link_flags}>")
link_libraries(mlakv_tsan_sync)
message(STATUS "mlakv: TSan build interposes abseil's Mutex/CondVar/Notification (inline namespace "
               "${mlakv_absl_ns}) and gRPC's batch start, call unref, server call requests and completion-queue next")
