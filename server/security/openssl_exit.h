// OpenSSL's clean-up at process exit, turned off (OPENSSL_INIT_NO_ATEXIT).
//
// OpenSSL 3 frees its global state and deletes the thread-local key of each
// thread's error queue (ERR_STATE, 904 bytes) from an atexit handler. gRPC
// 1.51 leaves threads of its own running when main returns (detached
// executor and event-engine threads, the thread of an asynchronous
// grpc_shutdown); one that did TLS work and ends after that handler ran
// never frees its error queue (the key's destructor is gone), and one that
// touches OpenSSL after it runs uses freed state. Leak checkers report the
// first as a leak (LeakSanitizer, "904 byte(s) leaked" from CRYPTO_zalloc,
// seen once in CI on server_security_test); gRPC's issue 38539 describes
// the same. Without the handler the queues stay reachable from their
// threads and are freed as those threads end; the process's memory goes
// back to the system at exit either way.
#pragma once

namespace mlakv {

// Call first thing in main (before any gRPC or OpenSSL call: only OpenSSL's
// first initialization decides whether the handler is registered). Returns
// false when OpenSSL refused, which leaves its default in place.
bool KeepOpenSslStateAtExit();

}  // namespace mlakv
