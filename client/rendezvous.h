// Rendezvous (highest-random-weight) placement of sequences on servers.
//
// Every client that knows the same set of server keys picks the same server
// for a sequence id, without talking to the others: the server whose
// Weight(sequence, key) is highest. A server joining takes from each of the
// others only the sequences it now wins (about 1/N of them); one leaving
// hands on only its own. The arithmetic is fixed and documented in
// docs/deploy.md "Placement" so that other clients (client/python/mlakv/
// fleet.py) reproduce it bit for bit:
//
//   Fnv1a64(s)     64-bit FNV-1a over the bytes of s
//                  (offset 0xcbf29ce484222325, prime 0x100000001b3)
//   Mix64(x)       splitmix64's finalizer: x ^= x >> 30; x *= 0xbf58476d1ce4e5b9;
//                  x ^= x >> 27; x *= 0x94d049bb133111eb; x ^= x >> 31
//   Weight(q, k)   Mix64(Fnv1a64(k) ^ Mix64(Fnv1a64(q)))
//
// Ties (equal weights) go to the larger key in byte order.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace mlakv {

uint64_t Fnv1a64(std::string_view bytes);
uint64_t Mix64(uint64_t x);
uint64_t RendezvousWeight(std::string_view sequence, std::string_view server_key);

// Index in `keys` of the key that wins `sequence`; -1 when keys is empty.
int PickRendezvous(std::string_view sequence, const std::vector<std::string_view>& keys);

}  // namespace mlakv
