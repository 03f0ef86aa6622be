#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "client/cli/commands.h"

namespace {

struct Command {
  std::function<int(const std::vector<std::string>&)> run;
  const char* help;
};

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"quantize",
       {mlakv::cli::RunQuantize,
        "--input IN.safetensors --output OUT.safetensors [--device cpu|cuda|cuda:N|auto] [--ckv_scale X] "
        "[--kpe_scale Y]\n      quantize rows offline with the service's kernel"}},
      {"make-rows",
       {mlakv::cli::RunMakeRows,
        "--rows N --output FILE [--dtype bf16|f16] [--seed S] [--amax A]\n"
        "      write a row file of random rows (ckv, kpe, calibrated ckv_scale/kpe_scale) for append and quantize"}},
      {"pools",
       {mlakv::cli::RunPools,
        "[--json]\n      pools: geometry, device, pages total/used/free/shared, leases, eviction counters"}},
      {"pool",
       {mlakv::cli::RunPool,
        "[NAME] [--json]\n      one pool: pages used/free/shared/indexed, sequences retained, leases, eviction, scales"}},
      {"seqs", {mlakv::cli::RunSeqs, "[--pool P] [--json]\n      sequences of a pool: length, pages"}},
      {"seq",
       {mlakv::cli::RunSeq,
        "ID [--expect_generation G] [--lease_holder H [--duration_ms N]] [--pool P] [--json]\n"
        "      a sequence's page table, per-layer lengths, generation, leases, pin, shared pages"}},
      {"page", {mlakv::cli::RunPage, "N [--pool P] [--json]\n      a page's owner and filled entries per layer"}},
      {"free",
       {mlakv::cli::RunFree,
        "ID [--expect_generation G] [--pool P] [--json]\n"
        "      release a sequence and its pages (pages a lease holds stay until it ends)"}},
      {"fork",
       {mlakv::cli::RunFork,
        "SOURCE TARGET [--length N] [--pin] [--expect_generation G] [--pool P] [--json]\n"
        "      fork --hashes HEX[,HEX...] TARGET [--pin]\n"
        "      create TARGET sharing SOURCE's pages (or a cached block-hash chain's)"}},
      {"lease",
       {mlakv::cli::RunLease,
        "acquire SEQ --holder H [--duration_ms N] [--tokens N] [--expect_generation G] [--json]\n"
        "      lease renew ID [--duration_ms N] | lease release ID | lease list  [--pool P] [--json]\n"
        "      take, extend, end and list leases (what they cover does not change while they live)"}},
      {"match",
       {mlakv::cli::RunMatch,
        "HASH_HEX... [--lease_holder H [--duration_ms N]] [--pool P] [--json]\n"
        "      how many leading pages of a block-hash chain the pool holds (optionally leased)"}},
      {"truncate",
       {mlakv::cli::RunTruncate, "ID --length L [--pool P] [--json]\n      roll a sequence back to L tokens"}},
      {"append",
       {mlakv::cli::RunAppend,
        "--sequence ID --layer L --input FILE [--start POS] [--pool P] [--json]\n"
        "      append rows (ckv, kpe, optional ckv_scale/kpe_scale) of FILE to one layer;\n"
        "      or --ckv_region NAME:OFFSET[:STRIDE] --kpe_region NAME:OFFSET[:STRIDE] --rows N [--dtype bf16|f16]\n"
        "      instead of --input: N rows the server reads from registered regions"}},
      {"export",
       {mlakv::cli::RunExport,
        "--sequence ID --layer L --output FILE [--pool P] [--json]\n"
        "      write one layer's stored bytes (ckv_packed, ckv_sf, kpe, kv_indices, scales) to FILE"}},
      {"regions", {mlakv::cli::RunRegions, "[--json]\n      regions registered with the server (--allow_ipc)"}},
      {"region",
       {mlakv::cli::RunRegion,
        "register-shm --name N --shm_name /OBJ [--offset B] [--size B] [--json]\n"
        "      region register-cuda --name N (--handle_file F | --handle_hex HEX) --device_id D --size B\n"
        "          [--event_handle_file F | --event_handle_hex HEX] [--json]\n"
        "      region unregister --name N [--json]\n"
        "      register a shared-memory object or a CUDA allocation as a region; forget one"}},
      {"export-pool",
       {mlakv::cli::RunExportPool,
        "[--pool P] [--json]\n      CUDA IPC handles and layout of a cuda pool's caches (--allow_ipc)"}},
      {"bench",
       {mlakv::cli::RunBench,
        "[--mode append|decode] [--concurrency N] [--duration_s S | --requests N] [--json] ...\n"
        "      load generator: requests/s, GB/s of rows, latency percentiles, errors by code"}},
  };
  return *commands;
}

std::string Usage() {
  std::string text = "usage: mlakv COMMAND [flags]\n\ncommands:\n";
  for (const auto& [name, cmd] : Commands()) text += "  " + name + " " + cmd.help + "\n";
  text += "\nServer commands take --server ADDR (default 127.0.0.1:50051) and --timeout_s; for a TLS server --tls_ca FILE\n"
          "(and --tls_cert/--tls_key for mutual TLS, --tls_server_name NAME), for a token --token_file FILE.\n"
          "A fleet instead of one server: --servers A,B,C or --service dns:///NAME:PORT; commands for a sequence go to\n"
          "the server rendezvous hashing of its id picks (or --server_id ID), pools and seqs ask every server.\n"
          "Exit status: 0 ok, 1 the operation failed (the server's status code and message are printed), 2 bad usage.\n"
          "mlakv --help lists every flag.";
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  // Appends build multi-megabyte messages; without this glibc mmaps and
  // unmaps each one, paying fresh page faults per message (see mlakv-server).
  if (std::getenv("GLIBC_TUNABLES") == nullptr) {
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  }
  // --version: the repository's VERSION (also the server's and the Python package's).
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return std::string("mlakv " MLAKV_VERSION "\n"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(Usage());
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) {
    std::fprintf(stderr, "%s\n", Usage().c_str());
    return 2;
  }
  auto it = Commands().find(positional[1]);
  if (it == Commands().end()) {
    std::fprintf(stderr, "mlakv: unknown command \"%s\"\n\n%s\n", positional[1], Usage().c_str());
    return 2;
  }
  return it->second.run(std::vector<std::string>(positional.begin() + 2, positional.end()));
}
