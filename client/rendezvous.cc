#include "client/rendezvous.h"

namespace mlakv {

uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

uint64_t RendezvousWeight(std::string_view sequence, std::string_view server_key) {
  return Mix64(Fnv1a64(server_key) ^ Mix64(Fnv1a64(sequence)));
}

int PickRendezvous(std::string_view sequence, const std::vector<std::string_view>& keys) {
  int best = -1;
  uint64_t best_weight = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint64_t w = RendezvousWeight(sequence, keys[i]);
    if (best < 0 || w > best_weight || (w == best_weight && keys[i] > keys[static_cast<size_t>(best)])) {
      best = static_cast<int>(i);
      best_weight = w;
    }
  }
  return best;
}

}  // namespace mlakv
