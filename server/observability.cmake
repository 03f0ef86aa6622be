# Metrics, metrics HTTP endpoint, per-RPC metrics interceptor, TLS/mTLS server
# credentials with bearer-token auth, plaintext health-probe server: the
# server's operational components (docs/deploy.md). Included by
# server/CMakeLists.txt; linked into mlakv_server_lib.
add_library(mlakv_observability STATIC
  ${CMAKE_CURRENT_LIST_DIR}/metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/metrics_http_server.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/metrics_interceptor.cc
  ${CMAKE_CURRENT_LIST_DIR}/bearer_token_auth.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_credentials.cc
  ${CMAKE_CURRENT_LIST_DIR}/health_probe_server.cc
  ${CMAKE_CURRENT_LIST_DIR}/reflection_option.cc
  ${CMAKE_CURRENT_LIST_DIR}/probe_health_service.cc
  ${CMAKE_CURRENT_LIST_DIR}/instrumented_backend.cc)
target_link_libraries(mlakv_observability
  PUBLIC mlakv_proto gRPC::grpc++ gRPC::grpc++_reflection absl::status absl::statusor absl::strings absl::synchronization absl::time)
