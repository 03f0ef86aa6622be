#include "server/rpc/server_config.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"

namespace mlakv::server {
namespace {

constexpr uint64_t kBytesPerTokenPerLayer =
    format::kEntryBytes;  // 352

class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty()) first_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  void AddWarning(int, int, const std::string&) override {}
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

}  // namespace

v1::ServerConfig DefaultServerConfig() {
  v1::ServerConfig config;
  config.set_listen(kDefaultListen);
  config.set_max_message_bytes(kDefaultMaxMessageBytes);
  v1::PoolConfig* pool = config.add_pools();
  pool->set_name(kDefaultPoolName);
  pool->set_num_layers(kDefaultNumLayers);
  pool->set_page_size(kDefaultPageSize);
  pool->set_num_pages(kDefaultNumPages);
  return config;
}

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("config file '", path, "' cannot be opened"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseServerConfig(text.str(), absl::StrCat("config file '", path, "'"));
}

absl::StatusOr<v1::ServerConfig> ParseServerConfig(std::string_view text, std::string_view source) {
  v1::ServerConfig config;
  google::protobuf::TextFormat::Parser parser;
  ErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(source.data(), source.size()),
                                                   " is not a valid text-format mlakv.v1.ServerConfig: ",
                                                   errors.first()));
  }
  return config;
}

namespace {

// Eviction and leases of one pool (docs/server.md "Eviction", "Leases").
absl::Status CacheManagementFromConfig(const v1::PoolConfig& pc, const std::string& where, Pool::Options* o) {
  const v1::EvictionConfig& ev = pc.eviction();
  if (ev.policy().empty() || ev.policy() == "none") {
    o->eviction.lru = false;
  } else if (ev.policy() == "lru") {
    o->eviction.lru = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "eviction.policy ", Quote(ev.policy()), " is not \"none\" or \"lru\""));
  }
  if (ev.high_watermark() != 0.0f || ev.low_watermark() != 0.0f) {
    if (!o->eviction.lru) {
      return absl::InvalidArgumentError(absl::StrCat(where, "eviction watermarks need eviction.policy \"lru\""));
    }
    if (!(ev.high_watermark() > 0.0f && ev.high_watermark() <= 1.0f && ev.low_watermark() >= 0.0f &&
          ev.low_watermark() < ev.high_watermark())) {
      return absl::InvalidArgumentError(absl::StrCat(where, "eviction watermarks must satisfy 0 <= low (",
                                                     ev.low_watermark(), ") < high (", ev.high_watermark(),
                                                     ") <= 1"));
    }
  }
  o->eviction.high_watermark = ev.high_watermark();
  o->eviction.low_watermark = ev.low_watermark();
  if (ev.remember_evicted() > (1u << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "eviction.remember_evicted ", ev.remember_evicted(), " exceeds 1048576"));
  }
  // 0 in the config: Pool::Options' own default (the one place they are written).
  const Pool::Options defaults;
  auto or_default = [](uint32_t configured, uint32_t fallback) { return configured == 0 ? fallback : configured; };
  o->eviction.remember_ended = or_default(ev.remember_evicted(), defaults.eviction.remember_ended);
  o->max_leases = or_default(pc.max_leases(), defaults.max_leases);
  o->max_leases_per_sequence = or_default(pc.max_leases_per_sequence(), defaults.max_leases_per_sequence);
  const uint32_t max_s = or_default(
      pc.max_lease_seconds(), static_cast<uint32_t>(absl::ToInt64Seconds(defaults.max_lease_duration)));
  const uint32_t default_s = or_default(
      pc.default_lease_seconds(), static_cast<uint32_t>(absl::ToInt64Seconds(defaults.default_lease_duration)));
  if (max_s > 7 * 24 * 3600 || default_s > max_s) {
    return absl::InvalidArgumentError(absl::StrCat(where, "default_lease_seconds ", default_s,
                                                   " must be <= max_lease_seconds ", max_s, " <= 604800"));
  }
  o->max_lease_duration = absl::Seconds(max_s);
  o->default_lease_duration = absl::Seconds(default_s);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<Pool::Options>> PoolOptionsFromConfig(const v1::ServerConfig& config,
                                                                 const std::string& default_device) {
  std::vector<Pool::Options> out;
  v1::ServerConfig effective = config;
  if (effective.pools().empty()) *effective.add_pools() = DefaultServerConfig().pools(0);
  std::set<std::string> names;
  for (int i = 0; i < effective.pools_size(); ++i) {
    const v1::PoolConfig& pc = effective.pools(i);
    Pool::Options o;
    o.name = pc.name();
    if (o.name.empty()) {
      if (effective.pools_size() > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("pools[", i, "]: name is empty; with more than one pool every pool needs a name"));
      }
      o.name = kDefaultPoolName;
    }
    const std::string where = absl::StrCat("pool ", Quote(o.name), ": ");
    if (!names.insert(o.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, "name is used by two pools; names must be unique"));
    }
    // The one place a device is parsed ("auto" resolved); cuda:N must exist
    // before any pool allocates (a config naming cuda:1 on a one-GPU host
    // fails here, naming the devices there are).
    absl::StatusOr<Device> device = Device::Parse(pc.device().empty() ? default_device : pc.device());
    if (!device.ok()) return absl::InvalidArgumentError(absl::StrCat(where, device.status().message()));
    if (absl::Status s = device->CheckExists(); !s.ok()) return absl::Status(s.code(), absl::StrCat(where, s.message()));
    o.device = *device;
    o.num_layers = pc.num_layers() == 0 ? kDefaultNumLayers : pc.num_layers();
    o.page_size = pc.page_size() == 0 ? kDefaultPageSize : pc.page_size();
    if (pc.num_layers() > 4096) {
      return absl::InvalidArgumentError(absl::StrCat(where, "num_layers ", pc.num_layers(), " exceeds 4096"));
    }
    if (pc.page_size() > (1u << 20)) {
      return absl::InvalidArgumentError(absl::StrCat(where, "page_size ", pc.page_size(), " exceeds 1048576"));
    }
    uint64_t pages = kDefaultNumPages;
    if (pc.num_pages() != 0 && pc.cache_bytes() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "set num_pages (", pc.num_pages(), ") or cache_bytes (", pc.cache_bytes(),
                       "), not both"));
    } else if (pc.num_pages() != 0) {
      pages = pc.num_pages();
    } else if (pc.cache_bytes() != 0) {
      const uint64_t page_bytes = kBytesPerTokenPerLayer * o.page_size * o.num_layers;
      pages = pc.cache_bytes() / page_bytes;
      if (pages == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, "cache_bytes ", pc.cache_bytes(),
                                                       " holds less than one page (352 x page_size ", o.page_size,
                                                       " x num_layers ", o.num_layers, " = ", page_bytes, " bytes)"));
      }
    }
    if (pages * o.page_size > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(where, pages, " pages x page_size ", o.page_size,
                                                     " exceeds 2^31 - 1 tokens (positions are int32)"));
    }
    o.num_pages = static_cast<int32_t>(pages);

    // Scales: listed layers, then all_layers for the rest.
    o.layer_scales.assign(o.num_layers, std::nullopt);
    auto check = [&](const v1::LayerScaleConfig& ls, const std::string& field) -> absl::StatusOr<Pool::Options::Scales> {
      absl::StatusOr<float> ckv = CheckDecodeScale(ls.ckv_scale(), "ckv_scale");
      if (!ckv.ok()) return absl::InvalidArgumentError(absl::StrCat(where, field, ": ", ckv.status().message()));
      absl::StatusOr<float> kpe = CheckDecodeScale(ls.kpe_scale(), "kpe_scale");
      if (!kpe.ok()) return absl::InvalidArgumentError(absl::StrCat(where, field, ": ", kpe.status().message()));
      return Pool::Options::Scales{*ckv, *kpe};
    };
    for (int j = 0; j < pc.layer_scales_size(); ++j) {
      const v1::LayerScaleConfig& ls = pc.layer_scales(j);
      const std::string field = absl::StrCat("layer_scales[", j, "] (layer ", ls.layer(), ")");
      if (ls.layer() >= static_cast<uint32_t>(o.num_layers)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, field, ": layer is outside [0, ", o.num_layers, ")"));
      }
      if (o.layer_scales[ls.layer()]) {
        return absl::InvalidArgumentError(absl::StrCat(where, field, ": layer ", ls.layer(), " is listed twice"));
      }
      MLAKV_ASSIGN_OR_RETURN(Pool::Options::Scales s, check(ls, field));
      o.layer_scales[ls.layer()] = s;
    }
    if (pc.has_all_layers()) {
      MLAKV_ASSIGN_OR_RETURN(Pool::Options::Scales s, check(pc.all_layers(), "all_layers"));
      for (auto& entry : o.layer_scales) {
        if (!entry) entry = s;
      }
    }
    o.idle_ttl = absl::Seconds(pc.sequence_idle_ttl_seconds());
    o.max_sequences = pc.max_sequences() == 0 ? kDefaultMaxSequences : pc.max_sequences();
    MLAKV_RETURN_IF_ERROR(CacheManagementFromConfig(pc, where, &o));
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace mlakv::server
