// Flags shared by several `mlakv` subcommands. absl flags are global, so a
// flag that means the same thing in two commands is defined once, here
// (cli_flags.cc); a flag only one command reads lives in that command's file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, server);
// A fleet instead of one server (docs/deploy.md "Placement").
ABSL_DECLARE_FLAG(std::string, servers);
ABSL_DECLARE_FLAG(std::string, service);
ABSL_DECLARE_FLAG(std::string, server_id);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, pool);
ABSL_DECLARE_FLAG(double, timeout_s);
ABSL_DECLARE_FLAG(std::string, sequence);
ABSL_DECLARE_FLAG(int32_t, layer);
ABSL_DECLARE_FLAG(std::string, input);
ABSL_DECLARE_FLAG(std::string, output);
ABSL_DECLARE_FLAG(std::optional<double>, ckv_scale);
ABSL_DECLARE_FLAG(std::optional<double>, kpe_scale);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int64_t, rows);
ABSL_DECLARE_FLAG(int64_t, length);
// Cache management (leases, forks, prefix matches).
ABSL_DECLARE_FLAG(std::optional<uint64_t>, expect_generation);
ABSL_DECLARE_FLAG(std::string, holder);
ABSL_DECLARE_FLAG(std::string, lease_holder);
ABSL_DECLARE_FLAG(uint32_t, duration_ms);
ABSL_DECLARE_FLAG(uint32_t, tokens);
ABSL_DECLARE_FLAG(bool, pin);
ABSL_DECLARE_FLAG(std::string, hashes);
// Transport security (docs/deploy.md).
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);
ABSL_DECLARE_FLAG(std::string, token_file);
