// TLS, mutual TLS and bearer-token auth of the server's credentials
// (server_credentials.h, bearer_token_auth.h) on a real loopback TCP port,
// with certificates made by openssl at test time (make_test_certs.sh). The
// service behind is a stand-in KvCache whose ListPools answers one pool: the
// security layer sits in front of any service, and tests/deploy/
// server_e2e_test.sh repeats the decisive cases against mlakv-server itself.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/security/openssl_exit.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/security/bearer_token_auth.h"
#include "server/security/server_credentials.h"

#ifndef MLAKV_MAKE_CERTS
#error "MLAKV_MAKE_CERTS must name tests/deploy/make_test_certs.sh"
#endif

namespace mlakv::server {
namespace {

// Before main, so before gRPC or OpenSSL start: the TLS servers' threads
// outlive the test's main (common/openssl_exit.h).
[[maybe_unused]] const bool kOpenSslKept = KeepOpenSslStateAtExit();

using ::testing::HasSubstr;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

class StandInService final : public v1::KvCache::CallbackService {
  grpc::ServerUnaryReactor* ListPools(grpc::CallbackServerContext* ctx, const v1::ListPoolsRequest*,
                                      v1::ListPoolsResponse* resp) override {
    resp->add_pools()->set_name("stand-in");
    // The token must not reach the service.
    if (ctx->client_metadata().count("authorization") != 0) leaked_token = true;
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

 public:
  std::atomic<bool> leaked_token{false};
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("mlakv-security-test-" + std::to_string(getpid())));
    std::string cmd = std::string("sh ") + MLAKV_MAKE_CERTS + " " + *dir_ + " >/dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    grpc::EnableDefaultHealthCheckService(true);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string F(const std::string& name) { return *dir_ + "/" + name; }

  // Starts the server with `o` (file paths relative to the cert dir).
  void Start(ServerSecurityOptions o) {
    o.on_auth_failure = [this](const std::string& reason) {
      absl::MutexLock l(&mu_);
      ++failures_[reason];
    };
    auto creds = BuildServerCredentials(o);
    ASSERT_TRUE(creds.ok()) << creds.status();
    grpc::ServerBuilder b;
    // No SO_REUSEPORT (gRPC's default on Linux): a server of another test
    // running at the same time must never share this port.
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    b.AddListeningPort("127.0.0.1:0", *creds, &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  ServerSecurityOptions Tls(bool mtls, bool token) {
    ServerSecurityOptions o;
    o.tls_cert_file = F("server.crt");
    o.tls_key_file = F("server.key");
    if (mtls) o.tls_client_ca_file = F("ca.crt");
    if (token) o.auth_token_file = F("token");
    return o;
  }
  std::shared_ptr<grpc::ChannelCredentials> ClientTls(const std::string& cert = "", const std::string& ca = "ca.crt") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Slurp(F(ca));
    if (!cert.empty()) {
      o.pem_cert_chain = Slurp(F(cert + ".crt"));
      o.pem_private_key = Slurp(F(cert + ".key"));
    }
    return grpc::SslCredentials(o);
  }
  std::shared_ptr<grpc::ChannelCredentials> WithToken(std::shared_ptr<grpc::ChannelCredentials> c,
                                                      const std::string& token_file) {
    return grpc::CompositeChannelCredentials(c, grpc::AccessTokenCredentials(Trim(Slurp(F(token_file)))));
  }
  grpc::Status CallListPools(std::shared_ptr<grpc::ChannelCredentials> creds,
                             const std::string& extra_auth_header = "") {
    auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), creds);
    auto stub = v1::KvCache::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!extra_auth_header.empty()) ctx.AddMetadata("authorization", extra_auth_header);
    v1::ListPoolsResponse resp;
    grpc::Status s = stub->ListPools(&ctx, v1::ListPoolsRequest(), &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.pools(0).name(), "stand-in");
    }
    // The code and message say why a call failed where a test expected OK.
    return grpc::Status(s.error_code(), absl::StrCat("[", s.error_code(), "] ", s.error_message(), " (port ",
                                                     port_, ", failures so far: missing ", Failures("missing"),
                                                     ", invalid ", Failures("invalid"), ")"),
                        s.error_details());
  }
  grpc::Status CallHealth(std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), creds);
    auto stub = grpc::health::v1::Health::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    }
    return s;
  }
  int Failures(const std::string& reason) {
    absl::MutexLock l(&mu_);
    return failures_[reason];
  }

  static std::string* dir_;
  StandInService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Mutex mu_;
  std::map<std::string, int> failures_;
};
std::string* SecurityTest::dir_ = nullptr;

TEST_F(SecurityTest, PlaintextServerServesPlaintextClients) {
  Start(ServerSecurityOptions{});
  grpc::Status s = CallListPools(grpc::InsecureChannelCredentials());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(SecurityTest, TlsServerServesTlsClients) {
  Start(Tls(false, false));
  grpc::Status s = CallListPools(ClientTls());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(SecurityTest, PlaintextClientAgainstTlsServerFails) {
  Start(Tls(false, false));
  grpc::Status s = CallListPools(grpc::InsecureChannelCredentials());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(SecurityTest, ClientThatDoesNotTrustTheServerCaFails) {
  Start(Tls(false, false));
  grpc::Status s = CallListPools(ClientTls("", "other-ca.crt"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(SecurityTest, NoTokenIsUnauthenticated) {
  Start(Tls(false, true));
  grpc::Status s = CallListPools(ClientTls());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("bearer token"));
  EXPECT_EQ(Failures("missing"), 1);
}

TEST_F(SecurityTest, WrongTokenIsUnauthenticated) {
  Start(Tls(false, true));
  grpc::Status s = CallListPools(WithToken(ClientTls(), "wrong-token"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_EQ(Failures("invalid"), 1);
}

TEST_F(SecurityTest, TokenWithAnotherSchemeIsUnauthenticated) {
  Start(Tls(false, true));
  std::string token = Trim(Slurp(F("token")));
  grpc::Status s = CallListPools(ClientTls(), "Basic " + token);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  // The token as a prefix of a longer one is wrong too.
  s = CallListPools(ClientTls(), "Bearer " + token + "x");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  s = CallListPools(ClientTls(), "Bearer " + token.substr(0, token.size() - 1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
}

TEST_F(SecurityTest, RightTokenWorksAndIsNotPassedToTheService) {
  Start(Tls(false, true));
  grpc::Status s = CallListPools(WithToken(ClientTls(), "token"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  // Scheme is case-insensitive (RFC 6750 follows RFC 7235).
  s = CallListPools(ClientTls(), "bearer " + Trim(Slurp(F("token"))));
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(service_.leaked_token.load());
  EXPECT_EQ(Failures("missing") + Failures("invalid"), 0);
}

TEST_F(SecurityTest, HealthNeedsNoToken) {
  Start(Tls(false, true));
  grpc::Status s = CallHealth(ClientTls());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(SecurityTest, MutualTlsRefusesClientWithoutCertificate) {
  Start(Tls(true, false));
  grpc::Status s = CallListPools(ClientTls());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(SecurityTest, MutualTlsRefusesCertificateFromAnotherCa) {
  Start(Tls(true, true));
  grpc::Status s = CallListPools(WithToken(ClientTls("other-client"), "token"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(SecurityTest, MutualTlsWithRightCertificateAndTokenWorks) {
  Start(Tls(true, true));
  grpc::Status s = CallListPools(WithToken(ClientTls("client"), "token"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  // Right certificate, no token: still refused.
  s = CallListPools(ClientTls("client"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
}

TEST_F(SecurityTest, CredentialErrorsNameTheFlag) {
  ServerSecurityOptions o;
  o.auth_token_file = F("token");
  auto r = BuildServerCredentials(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--auth_token_file needs --tls_cert"));

  o = ServerSecurityOptions{};
  o.tls_client_ca_file = F("ca.crt");
  EXPECT_EQ(BuildServerCredentials(o).status().code(), absl::StatusCode::kInvalidArgument);

  o = ServerSecurityOptions{};
  o.tls_cert_file = F("server.crt");
  r = BuildServerCredentials(o);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--tls_cert and --tls_key go together"));

  o.tls_key_file = F("no-such.key");
  r = BuildServerCredentials(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--tls_key"));

  o.tls_key_file = F("token");  // not PEM
  r = BuildServerCredentials(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not PEM"));

  std::ofstream(F("empty-token")) << "\n";
  o = Tls(false, false);
  o.auth_token_file = F("empty-token");
  EXPECT_THAT(std::string(BuildServerCredentials(o).status().message()), HasSubstr("empty token"));
}

TEST(BearerToken, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abd", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abcd", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("", "abc"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab"));
}

TEST(BearerToken, ReadTokenFileTrimsAndRejectsWhitespaceInside) {
  std::string p = std::filesystem::temp_directory_path() / ("mlakv-token-" + std::to_string(getpid()));
  std::ofstream(p) << "  s3cret \nsecond line ignored\n";
  auto t = ReadTokenFile(p);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "s3cret");
  std::ofstream(p) << "two words\n";
  EXPECT_EQ(ReadTokenFile(p).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(p);
  EXPECT_EQ(ReadTokenFile(p).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mlakv::server
