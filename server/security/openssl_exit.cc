#include "server/security/openssl_exit.h"

#include <openssl/crypto.h>

namespace mlakv {

bool KeepOpenSslStateAtExit() { return OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) == 1; }

}  // namespace mlakv
