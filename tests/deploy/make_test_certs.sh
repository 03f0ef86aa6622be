#!/bin/sh
# Generates throw-away test PKI in DIR with openssl (P-256 keys, valid 2 days):
#   ca.crt/ca.key            CA "mlakv-test-ca"
#   server.crt/server.key    signed by ca, SAN DNS:localhost, IP:127.0.0.1
#   client.crt/client.key    signed by ca (a client the server trusts)
#   other-ca.crt/.key        an unrelated CA
#   other-client.crt/.key    signed by other-ca (a client the server must refuse)
#   token, wrong-token       bearer tokens
set -eu
dir=$1
mkdir -p "$dir"
cd "$dir"
key() { openssl ecparam -name prime256v1 -genkey -noout -out "$1" 2>/dev/null; }
ca() {
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -sha256 -days 2 -subj "/CN=$2" -out "$1.crt"
}
leaf() {  # name ca cn ext
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$3" -out "$1.csr"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -sha256 -days 2 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca mlakv-test-ca
ca other-ca mlakv-other-ca
leaf server ca localhost "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
leaf client ca mlakv-client "extendedKeyUsage=clientAuth"
leaf other-client other-ca mlakv-other-client "extendedKeyUsage=clientAuth"
printf 'test-token-%s\n' "$(openssl rand -hex 16)" > token
printf 'test-token-%s\n' "$(openssl rand -hex 16)" > wrong-token
