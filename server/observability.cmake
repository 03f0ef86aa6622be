# Metrics (prometheus-cpp registry, prometheus-cpp Exposer /metrics endpoint), per-RPC
# metrics interceptor, TLS/mTLS server credentials with bearer-token auth,
# plaintext health-probe server: the server's operational components
# (docs/deploy.md). Included by server/CMakeLists.txt; linked into
# mlakv_server_lib.
#
# prometheus-cpp (Debian's prometheus-cpp-dev): core for the families and the
# text serializer, pull for the Exposer that serves /metrics on civetweb
# (libcivetweb-dev, which prometheus-cpp's config finds too; linked here only
# for mg_check_feature, to know whether civetweb has IPv6). All are shared
# libraries that the runtime image collects with
# scripts/collect_runtime_libs.sh.
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(civetweb CONFIG REQUIRED)

add_library(mlakv_observability STATIC
  ${CMAKE_CURRENT_LIST_DIR}/rpc_method_set.cc
  ${CMAKE_CURRENT_LIST_DIR}/scrape_time_collector.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/metrics_endpoint.cc
  ${CMAKE_CURRENT_LIST_DIR}/metrics_interceptor.cc
  ${CMAKE_CURRENT_LIST_DIR}/bearer_token_auth.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_credentials.cc
  ${CMAKE_CURRENT_LIST_DIR}/health_probe_server.cc
  ${CMAKE_CURRENT_LIST_DIR}/reflection_option.cc
  ${CMAKE_CURRENT_LIST_DIR}/probe_health_service.cc
  ${CMAKE_CURRENT_LIST_DIR}/instrumented_backend.cc)
target_link_libraries(mlakv_observability
  PUBLIC mlakv_proto mlakv_common gRPC::grpc++ gRPC::grpc++_reflection prometheus-cpp::core absl::status
         absl::statusor absl::strings absl::synchronization absl::time absl::flat_hash_map absl::flat_hash_set
  PRIVATE prometheus-cpp::pull civetweb::civetweb)
