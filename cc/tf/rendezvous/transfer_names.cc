#include "cc/tf/rendezvous/transfer_names.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/runtime/stats.h"

namespace tf_rdma {

std::string TaskName(const tensorflow::DeviceNameUtils::ParsedName& device) {
  return absl::StrCat("/job:", device.job, "/replica:", device.replica, "/task:", device.task);
}

const char* KindOf(std::string_view tensor_name) {
  return absl::StartsWith(tensor_name, "edge_") ? kKindGraph : kKindEager;
}

std::string TransferName(std::string_view full_key) {
  return std::string(full_key.substr(0, full_key.rfind(';')));
}

}  // namespace tf_rdma
